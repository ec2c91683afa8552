"""The pipeline-based mode across real split worker processes (`exitplan generate-stage`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer
from generation_helpers import PROMPTS, tiny_decoder_bundle

from exitplan.localrun.ports import free_port
from exitplan.worker_image.generate.decoder import DecoderModel, full_greedy
from exitplan.worker_image.generate.local_pipeline import PipelineEngine
from exitplan.worker_image.generate.remote_pipeline import RemotePipelineEngine
from exitplan.worker_image.generate.routes import generation_app

TOL = 1e-5
EXITPLAN = [sys.executable, "-c", "from exitplan.cli import app; app()"]


@pytest.fixture(scope="module")
def bundle():
    return tiny_decoder_bundle()


@pytest.fixture(scope="module")
def stages(bundle):
    """Two stage processes: blocks 0-1 (exits after 0 and 1) and block 2 (the final head)."""
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    commands = [
        ["--first", "0", "--last", "1", "--port", str(ports[0]), "--next", urls[1]],
        ["--first", "2", "--last", "2", "--port", str(ports[1])],
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [*EXITPLAN, "generate-stage", "--bundle", str(bundle), *c],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for c in commands
    ]
    try:
        for url, proc in zip(urls, procs):
            for _ in range(600):  # wait for readiness (bounded; the processes import numpy/onnxruntime first)
                if proc.poll() is not None:
                    raise RuntimeError(f"stage exited: {proc.stderr.read().decode()[-2000:]}")
                try:
                    urllib.request.urlopen(url + "/v2/health/ready", timeout=1).read()
                    break
                except OSError:
                    time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()


@pytest.fixture(scope="module")
def remote(bundle, stages):
    engine = RemotePipelineEngine(bundle, stages)
    yield engine
    engine.close()


def test_threshold_one_is_plain_greedy_with_exact_caches_across_processes(remote, bundle):
    model = DecoderModel(bundle)
    for prompt in PROMPTS[:2]:
        expected, _, _ = full_greedy(model, model.codec.encode(prompt), 10, ignore_eos=True)
        handle = remote.open(prompt, 10, 1.0, ignore_eos=True)
        got = []
        try:
            while not handle.finished:
                got.append(remote.step(handle).token_id)
                keys, values = remote.snapshot(handle)
                reference = model.full_forward(handle.ids[:-1])
                for block in range(model.n_blocks):
                    assert keys[block].shape[2] == len(handle.ids) - 1
                    np.testing.assert_allclose(keys[block], reference.keys[block], atol=TOL, rtol=0)
                    np.testing.assert_allclose(values[block], reference.values[block], atol=TOL, rtol=0)
        finally:
            remote.release(handle)
        assert got == expected
    assert remote.active_caches == 0 and remote.stage_caches() == [0, 0]


def test_exits_across_processes_match_in_process_pipeline_and_fill_every_cache(remote, bundle):
    model = DecoderModel(bundle)
    local = PipelineEngine(bundle, splits=[(0, 1), (2, 2)])
    try:
        for threshold in (0.0, 0.08):
            handle = remote.open(PROMPTS[2], 14, threshold, ignore_eos=True)
            events = []
            try:
                while not handle.finished:
                    events.append(remote.step(handle))
                keys, values = remote.snapshot(handle)
                reference = model.full_forward(handle.ids[:-1])
                for block in range(model.n_blocks):  # the exited tokens' later blocks were filled by the stages
                    np.testing.assert_allclose(keys[block], reference.keys[block], atol=TOL, rtol=0)
            finally:
                remote.release(handle)
            expected = [(e.token_id, e.exit) for e in local.generate(PROMPTS[2], 14, threshold, ignore_eos=True)]
            assert [(e.token_id, e.exit) for e in events] == expected
            if threshold == 0.0:
                assert {e.exit for e in events[1:]} == {"exit0"}
    finally:
        local.close()
    assert remote.stage_caches() == [0, 0]


async def test_disconnect_releases_the_cache_on_every_stage(bundle, stages):
    engine = RemotePipelineEngine(bundle, stages)
    server = TestServer(generation_app(engine, "tiny"))
    await server.start_server()
    try:
        async with aiohttp.ClientSession(base_url=str(server.make_url(""))) as session:
            body = {"text_input": PROMPTS[0], "parameters": {"max_tokens": 480, "threshold": 0.0, "ignore_eos": True}}
            response = await session.post("/v2/models/tiny/generate_stream", json=body)
            assert (await response.content.readline()).startswith(b"data: ")
            response.close()
            for _ in range(2000):  # bounded wait for the server to notice
                if engine.active_caches == 0:
                    break
                await asyncio.sleep(0.01)
        assert engine.active_caches == 0
        assert await asyncio.get_running_loop().run_in_executor(None, engine.stage_caches) == [0, 0]
    finally:
        await server.close()
        engine.close()
