"""Shared fixtures: real model bundles, built once per test session and cached between sessions.

`minilm_bundle` and `digits_bundle` are the Path of a finished bundle directory: real weights,
trained head and ramps, exported ONNX blocks, held-out data and calibration window. They are built
with a smaller training subset than `exitplan prepare`'s defaults (to keep the suite fast) into
`artifacts/test-bundles/` (or $EXITPLAN_TEST_BUNDLES), reused while complete with the same options,
and built under a file lock, so parallel test sessions share one build.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_BUNDLES = Path(os.environ.get("EXITPLAN_TEST_BUNDLES", REPO / "artifacts" / "test-bundles"))
MINILM_TEST_OPTIONS = {"model": "minilm", "train_size": 2000, "heldout_size": 600}
DIGITS_TEST_OPTIONS = {"model": "digits-cnn"}


def _bundle(options: dict) -> Path:
    from exitplan.prepare.build import BuildOptions, tqdm_bar
    from exitplan.prepare.presets import prepare_bundle

    return prepare_bundle(BuildOptions(**options), TEST_BUNDLES / options["model"], bar=tqdm_bar(enabled=False)).path


@pytest.fixture(scope="session")
def minilm_bundle() -> Path:
    """The MiniLM early-exit bundle (6 blocks, ramps after blocks 0-4, head after block 5)."""
    return _bundle(MINILM_TEST_OPTIONS)


@pytest.fixture(scope="session")
def digits_bundle() -> Path:
    """The digits CNN early-exit bundle (3 blocks, ramps after blocks 0-1, head after block 2)."""
    return _bundle(DIGITS_TEST_OPTIONS)


@pytest.fixture(scope="session")
def shared_trace() -> Path:
    """The shared Azure trace (../shared/data/traces), which a test replays by default. A clone with no
    shared folder beside it skips such tests with this reason rather than failing on the missing file."""
    from exitplan.planner.traces import TraceError, default_trace_path

    try:
        return default_trace_path()
    except TraceError as err:
        pytest.skip(f"{err} (this test replays the shared trace; clone the repository beside the shared folder)")
