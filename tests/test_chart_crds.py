"""The chart's CRDs: templates (templates/crds.yaml) rendered from the generated crds/*.yaml, so that
`helm upgrade` applies a changed schema (Helm installs a chart's crds/ folder once and never
upgrades it), labelled like every object of the release and kept on uninstall (cert-manager's
`crds.enabled` / `crds.keep`).

The upgrade is shown twice: the template output of a chart whose generated CRD changed carries the
change, and kubectl applies the two renders one after the other to the emulated API server, which
then serves the changed CRD (its new printer column in `kubectl get`).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart_support import CHART, ROOT, chart, chart_copy, crd_objects, of_kind, render, render_dir

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra: pip install -e '.[dev]'")

GENERATED = ROOT / "crds"
LINKS = CHART / "files" / "crds"


def _generated() -> dict[str, dict[str, Any]]:
    """metadata.name -> the generated CRD (crds/*.yaml, written by exitplan.operator.crdgen)."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted(GENERATED.glob("*.yaml"))]
    assert len(docs) == 3, "crds/*.yaml should hold the three kinds"
    return {d["metadata"]["name"]: d for d in docs}


def _by_name(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in of_kind(objs, "CustomResourceDefinition")}


def test_the_template_reads_the_generated_files_through_links(tmp_path: Path) -> None:
    generated = {p.name: p.read_bytes() for p in sorted(GENERATED.glob("*.yaml"))}
    links = sorted(LINKS.glob("*.yaml"))
    assert [p.name for p in links] == sorted(generated), "files/crds must hold one link per crds/*.yaml"
    for link in links:
        assert link.is_symlink() and link.resolve() == (GENERATED / link.name).resolve()
    assert not (CHART / "crds").exists()  # else Helm would install them once more, unlabelled
    assert chart().crds == []
    # a packaged chart carries the files themselves (links dereferenced)
    archive = helm_python.package(CHART, destination=tmp_path)
    with tarfile.open(archive) as tar:
        for name, data in generated.items():
            member = tar.getmember(f"exitplan/files/crds/{name}")
            assert member.isfile()
            assert tar.extractfile(member).read() == data


def test_rendered_crds_are_the_generated_ones_labelled_and_kept() -> None:
    rendered = _by_name(crd_objects())
    generated = _generated()
    assert sorted(rendered) == sorted(generated)
    sts_labels = next(o for o in render() if o["kind"] == "StatefulSet")["metadata"]["labels"]
    for name, crd in rendered.items():
        want = generated[name]
        assert (crd["apiVersion"], crd["kind"], crd["spec"]) == (want["apiVersion"], want["kind"], want["spec"])
        labels = crd["metadata"]["labels"]
        for key in ("helm.sh/chart", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by"):
            assert labels[key] == sts_labels[key], key  # the chart's own labels (helpers)
        assert labels["app.kubernetes.io/component"] == "crd"
        assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    peering = _by_name(render())["clusterkopfpeerings.kopf.dev"]
    assert peering["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_crds_options_keep_and_enabled() -> None:
    loose = _by_name(render({"crds": {"keep": False}}))
    assert len(loose) == 4
    assert all("annotations" not in crd["metadata"] for crd in loose.values())
    assert _by_name(render({"crds": {"enabled": False}})) == {}
    others = {o["kind"] for o in render({"crds": {"enabled": False}})}
    assert "StatefulSet" in others  # only the CRDs go


def _changed_chart(tmp_path: Path) -> Path:
    """A copy of the chart whose generated EarlyExitService CRD changed the way a new release's
    would: a new optional spec field and a new printer column."""
    copy = chart_copy(tmp_path)
    path = copy / "files" / "crds" / "earlyexitservices.yaml"
    assert not path.is_symlink()  # the copy holds the file itself
    crd = yaml.safe_load(path.read_text())
    (version,) = crd["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["upgradeProbe"] = {"type": "string", "description": "added by the next release"}
    version["additionalPrinterColumns"].insert(0, {"name": "Probe", "type": "string", "jsonPath": ".spec.upgradeProbe"})
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    return copy


def _ees(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return _by_name(objs)["earlyexitservices.exitplan.io"]


def test_an_upgrade_that_changes_a_crd_renders_the_change(tmp_path: Path) -> None:
    before = _ees(render())
    after = _ees(render_dir(_changed_chart(tmp_path)))

    def columns(crd: dict[str, Any]) -> list[str]:
        return [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]

    def fields(crd: dict[str, Any]) -> set[str]:
        return set(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])

    assert "Probe" not in columns(before) and columns(after) == ["Probe", *columns(before)]
    assert fields(after) - fields(before) == {"upgradeProbe"}
    assert after["metadata"] == before["metadata"]  # same object, same labels and keep policy


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed on this machine")
async def test_kubectl_applies_an_upgraded_crd_to_the_api_server(tmp_path: Path) -> None:
    """Both renders applied with kubectl, as `helm upgrade` patches a template's object: the API
    server then serves the new schema and printer column."""
    from exitplan.devcluster.apiserver import ApiServer

    v1 = tmp_path / "v1.yaml"
    v2 = tmp_path / "v2.yaml"
    v1.write_text(yaml.safe_dump_all(crd_objects()))
    v2.write_text(yaml.safe_dump_all(of_kind(render_dir(_changed_chart(tmp_path)), "CustomResourceDefinition")))
    service = tmp_path / "service.yaml"
    service.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "exitplan.io/v1alpha1",
                "kind": "EarlyExitService",
                "metadata": {"name": "minilm", "namespace": "default"},
                "spec": {
                    "model": {"name": "minilm", "bundle": "/b"},
                    "slo": {"latencyMs": 100},
                    "pools": [{"name": "a"}],
                },
            }
        )
    )
    async with ApiServer() as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(server.kubeconfig())

        def kubectl(*args: str) -> str:
            proc = subprocess.run(
                ["kubectl", f"--kubeconfig={kubeconfig}", f"--cache-dir={tmp_path / 'cache'}", *args],
                capture_output=True,
                text=True,
            )
            assert proc.returncode == 0, proc.stderr
            return proc.stdout

        def served() -> dict[str, Any]:
            return yaml.safe_load(kubectl("get", "crd", "earlyexitservices.exitplan.io", "-o", "yaml"))

        await asyncio.to_thread(kubectl, "apply", "--validate=false", "-f", str(v1))
        first = await asyncio.to_thread(served)
        assert first["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert first["metadata"]["labels"]["app.kubernetes.io/component"] == "crd"
        await asyncio.to_thread(kubectl, "apply", "--validate=false", "-f", str(service))
        header = (await asyncio.to_thread(kubectl, "get", "ees")).splitlines()[0].split()
        assert "PROBE" not in header
        await asyncio.to_thread(kubectl, "apply", "--validate=false", "-f", str(v2))
        second = await asyncio.to_thread(served)
        (version,) = second["spec"]["versions"]
        assert version["additionalPrinterColumns"][0]["name"] == "Probe"
        assert "upgradeProbe" in version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        assert second["metadata"]["uid"] == first["metadata"]["uid"]  # patched in place, not replaced
        header = (await asyncio.to_thread(kubectl, "get", "ees")).splitlines()[0].split()
        assert header[:2] == ["NAME", "PROBE"]
