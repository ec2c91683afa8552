"""The emulated API server (kmock subclass) over real HTTP: the semantics kopf and the operator
rely on (metadata, patch types, 409/422, watch resume, selectors, CRD validation, GC stand-in)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import aiohttp
import kmock
import pytest

from exitplan.devcluster.apiserver import ApiServer
from exitplan.operator import crdgen
from exitplan.operator.kube import ApiError, KubeClient, path


@pytest.fixture
async def api():
    async with ApiServer() as server:
        async with KubeClient(server.url) as client:
            yield server, client


def cm(name: str, labels: dict | None = None, **extra) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default", "labels": labels or {}, **extra},
        "data": {"a": "1"},
    }


async def test_metadata_and_generation(api):
    server, client = api
    created = await client.create(cm("one"))
    meta = created["metadata"]
    assert meta["uid"] and meta["generation"] == 1 and meta["creationTimestamp"].endswith("Z")
    rv1 = int(meta["resourceVersion"])
    url = path("ConfigMap", "default", "one")
    patched = await client.merge_patch(url, {"data": {"a": "2"}})
    assert patched["metadata"]["generation"] == 2 and int(patched["metadata"]["resourceVersion"]) > rv1
    labelled = await client.merge_patch(url, {"metadata": {"labels": {"x": "y"}}})
    assert labelled["metadata"]["generation"] == 2  # metadata changes do not bump generation
    same = await client.merge_patch(url, {"data": {"a": "2"}})
    assert same["metadata"]["resourceVersion"] == labelled["metadata"]["resourceVersion"]  # no-op patch
    assert labelled["metadata"]["uid"] == meta["uid"]


async def test_conflicts_and_errors(api):
    _, client = api
    await client.create(cm("two"))
    with pytest.raises(ApiError) as err:
        await client.create(cm("two"))
    assert err.value.status == 409
    url = path("ConfigMap", "default", "two")
    with pytest.raises(ApiError) as err:
        await client.merge_patch(url, {"metadata": {"resourceVersion": "1"}, "data": {"a": "3"}})
    assert err.value.status == 409
    with pytest.raises(ApiError) as err:  # kopf's optimistic concurrency: a failed JSON-patch test
        await client.request(
            "PATCH",
            url,
            body=[
                {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
                {"op": "replace", "path": "/data/a", "value": "9"},
            ],
            content_type="application/json-patch+json",
        )
    assert err.value.status == 422
    assert (await client.get(url))["data"]["a"] == "1"
    with pytest.raises(ApiError) as err:
        await client.get(path("ConfigMap", "default", "absent"))
    assert err.value.status == 404
    with pytest.raises(ApiError) as err:
        await client.delete(path("ConfigMap", "default", "absent"))
    assert err.value.status == 404


async def test_status_subresource_separates_spec_and_status(api):
    _, client = api
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "default"},
        "spec": {"replicas": 1},
    }
    await client.create(dep)
    url = path("Deployment", "default", "d")
    await client.merge_patch(url, {"spec": {"replicas": 2}, "status": {"readyReplicas": 5}})
    await client.merge_patch(url + "/status", {"spec": {"replicas": 9}, "status": {"readyReplicas": 2}})
    got = await client.get(url)
    assert got["spec"]["replicas"] == 2 and got["status"]["readyReplicas"] == 2
    assert got["metadata"]["generation"] == 2


async def read_events(rsp: aiohttp.ClientResponse, n: int) -> list[dict]:
    out = []
    while len(out) < n:
        line = await rsp.content.readline()
        if not line:
            break
        if line.strip():
            out.append(json.loads(line))
    return out


async def test_watch_resumes_from_resource_version_and_filters(api):
    server, client = api
    await client.create(cm("w1", {"app": "x"}))
    listing = await client.request("GET", path("ConfigMap", "default"), params={"labelSelector": "app=x"})
    since = listing["metadata"]["resourceVersion"]
    assert [i["metadata"]["name"] for i in listing["items"]] == ["w1"]
    await client.create(cm("w2", {"app": "y"}))
    await client.create(cm("w3", {"app": "x"}))
    await client.merge_patch(path("ConfigMap", "default", "w1"), {"data": {"a": "5"}})
    url = f"{server.url}{path('ConfigMap', 'default')}?watch=true&resourceVersion={since}&labelSelector=app%3Dx"
    async with aiohttp.ClientSession() as session, session.get(url) as rsp:
        events = await read_events(rsp, 2)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "w3"), ("MODIFIED", "w1")]
        await client.delete(path("ConfigMap", "default", "w3"))
        (gone,) = await read_events(rsp, 1)
        assert gone["type"] == "DELETED" and gone["object"]["metadata"]["name"] == "w3"
    # timeoutSeconds ends the stream server-side
    url = f"{server.url}{path('ConfigMap', 'default')}?watch=true&resourceVersion={server.api._rv}&timeoutSeconds=1"
    async with aiohttp.ClientSession() as session, session.get(url) as rsp:
        assert await rsp.read() == b""
    selected = await client.list(path("ConfigMap", "default"), "app in (x,y),app!=y")
    assert [i["metadata"]["name"] for i in selected] == ["w1"]


async def test_gc_stand_in_and_finalizers(api):
    _, client = api
    owner = await client.create(cm("owner"))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    await client.create(cm("child", ownerReferences=[ref]))
    blocked = await client.create(cm("blocked", finalizers=["x/y"]))
    await client.delete(path("ConfigMap", "default", "owner"))
    names = {i["metadata"]["name"] for i in await client.list(path("ConfigMap", "default"))}
    assert names == {"blocked"}  # the owned child went with its owner (the emulator's GC stand-in)
    marked = await client.delete(path("ConfigMap", "default", "blocked"))
    assert marked["metadata"]["deletionTimestamp"]
    assert (await client.get(path("ConfigMap", "default", "blocked")))["metadata"]["uid"] == blocked["metadata"]["uid"]
    await client.merge_patch(path("ConfigMap", "default", "blocked"), {"metadata": {"finalizers": None}})
    assert await client.list(path("ConfigMap", "default")) == []


async def install_crds(client: KubeClient) -> None:
    for kind in crdgen.KINDS:
        crd = crdgen.build_crd(kind)
        await client.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body=crd)


async def test_crds_register_validate_and_print(api):
    server, client = api
    with pytest.raises(ApiError) as err:
        await client.list(path("GPUPool"))
    assert err.value.status == 404
    await install_crds(client)
    pool = {"apiVersion": "exitplan.io/v1alpha1", "kind": "GPUPool", "metadata": {"name": "a"}, "spec": {"capacity": 2}}
    created = await client.create(pool)
    assert created["spec"]["gpuResource"] == "nvidia.com/gpu"  # schema defaults applied
    bad = {
        "apiVersion": "exitplan.io/v1alpha1",
        "kind": "EarlyExitService",
        "metadata": {"name": "s", "namespace": "default"},
        "spec": {
            "model": {"name": "m", "bundle": "/b"},
            "slo": {"latencyMs": 10, "slackMs": 20},
            "pools": [{"name": "a"}],
        },
    }
    with pytest.raises(ApiError) as err:
        await client.create(bad)
    assert err.value.status == 422 and "slackMs must be below" in err.value.message
    async with aiohttp.ClientSession() as session:
        async with session.get(
            server.url + path("GPUPool"), headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}
        ) as rsp:
            table = await rsp.json()
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]][:3] == ["Name", "Capacity", "GPU"]
    assert table["rows"][0]["cells"][:3] == ["a", 2, "nvidia.com/gpu"]


async def test_injected_fault_intercepts_without_mutation(api):
    """kmock's DSL still works on the subclass: a test can make the server fail a request."""
    server, client = api
    await client.create(cm("f"))
    server.api["patch", kmock.resource("v1/configmaps")] << 500
    client.backoffs = (0.01,)
    with pytest.raises(ApiError) as err:
        await client.merge_patch(path("ConfigMap", "default", "f"), {"data": {"a": "x"}})
    assert err.value.status == 500
    assert (await client.get(path("ConfigMap", "default", "f")))["data"]["a"] == "1"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed on this machine")
async def test_kubectl_applies_and_prints_columns(api, tmp_path):
    server, _ = api
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(server.kubeconfig())
    for name in crdgen.render_all():
        (tmp_path / name).write_text((crdgen.CRD_DIR / name).read_text())
    pool = tmp_path / "pool.yaml"
    pool.write_text("apiVersion: exitplan.io/v1alpha1\nkind: GPUPool\nmetadata: {name: gpu-a}\nspec: {capacity: 3}\n")

    def kubectl(*args: str) -> str:
        proc = subprocess.run(
            ["kubectl", f"--kubeconfig={kubeconfig}", f"--cache-dir={tmp_path / 'cache'}", *args],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    await asyncio.to_thread(kubectl, "apply", "--validate=false", "-f", str(tmp_path / "gpupools.yaml"))
    await asyncio.to_thread(kubectl, "apply", "--validate=false", "-f", str(pool))
    out = await asyncio.to_thread(kubectl, "get", "gpool")
    assert out.split("\n")[0].split() == ["NAME", "CAPACITY", "GPU", "COST/H", "AGE"]
    assert out.split("\n")[1].split()[:3] == ["gpu-a", "3", "nvidia.com/gpu"]


async def test_the_oldest_events_are_dropped_past_the_bound(api, monkeypatch):
    """Events are kept up to MAX_EVENTS_STORED, oldest dropped first, as a real server's TTL would; one
    deleted and created again under its name is the newest, not dropped with the old one's place."""
    from exitplan.devcluster import apiserver

    server, client = api
    monkeypatch.setattr(apiserver, "MAX_EVENTS_STORED", 3)

    def event(name: str) -> dict:
        return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": "default"}}

    for name in ("e0", "e1", "e2"):
        await client.create(event(name))
    await client.delete(path("Event", "default", "e0"))
    await client.create(event("e0"))  # again: now the newest
    await client.create(event("e3"))  # one past the bound: e1, the oldest live one, goes
    names = sorted(e["metadata"]["name"] for e in await client.list(path("Event", "default")))
    assert names == ["e0", "e2", "e3"]
