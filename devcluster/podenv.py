"""What a local pod's containers find around them: their volumes as local folders and files, their environment.

A kubelet stand-in for the pod runner (pods.py): configMap and secret volumes are files under the pod's
folder, rewritten when the ConfigMap or Secret changes (a Secret's files readable by the owner only);
emptyDir is a folder; hostPath is the path itself. Arguments and env values under a mountPath are
rewritten to the local folder (`local_path`). A container's env holds its `env` entries (values,
fieldRefs), what its `envFrom` Secrets and ConfigMaps bring, and what the runner adds: its ports
(EXITPLAN_PORT, EXITPLAN_<NAME>_PORT), the resolve file of headless Services, the kubeconfig, the pod IP.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import TYPE_CHECKING

from exitplan.api.manifest import Manifest

if TYPE_CHECKING:
    from exitplan.devcluster.pods import LocalPod

ConfigMaps = dict[tuple[str, str], Manifest]
"""(namespace, name) -> ConfigMap (the runner keeps Secrets the same way)."""


def mount(pod: LocalPod) -> None:
    """A local folder (or the hostPath) for every volume the pod's containers mount (`pod.mounts`)."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for container in pod.containers:
        for volume_mount in container.get("volumeMounts", []):
            vol = volumes.get(volume_mount["name"], {})
            if "hostPath" in vol:
                pod.mounts[volume_mount["mountPath"]] = Path(vol["hostPath"]["path"])
                continue
            local = pod.folder / "volumes" / volume_mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            pod.mounts[volume_mount["mountPath"]] = local


def _write_secret(pod: LocalPod, vol: Manifest, secrets: ConfigMaps) -> None:
    secret = secrets.get((pod.namespace, vol["secret"]["secretName"])) or {}
    for key, value in (secret.get("data") or {}).items():
        target = pod.folder / "volumes" / vol["name"] / key
        text = base64.b64decode(value).decode()
        if pod.config.get(str(target)) != text:
            tmp = target.with_suffix(".tmp")
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
                fh.write(text)
            os.replace(tmp, target)
            pod.config[str(target)] = text


def write_config(pod: LocalPod, configmaps: ConfigMaps, secrets: ConfigMaps) -> None:
    """The files of the pod's configMap and secret volumes, as their objects hold them now (a file
    is replaced atomically, and only when its content changed)."""
    for vol in pod.spec.get("volumes", []):
        if "secret" in vol:
            _write_secret(pod, vol, secrets)
        if "configMap" not in vol:
            continue
        cm = configmaps.get((pod.namespace, vol["configMap"]["name"]))
        local = pod.folder / "volumes" / vol["name"]
        for key, value in ((cm or {}).get("data") or {}).items():
            target = local / key
            if pod.config.get(str(target)) != value:
                tmp = target.with_suffix(".tmp")
                tmp.write_text(value)
                os.replace(tmp, target)
                pod.config[str(target)] = value


def local_path(pod: LocalPod, value: str) -> str:
    """`value` with a mountPath it starts with replaced by the local folder of that volume."""
    for mount_path in sorted(pod.mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(pod.mounts[mount_path]) + value[len(mount_path.rstrip("/")) :]
    return value


def env_from(
    container: Manifest, namespace: str, secrets: ConfigMaps, configmaps: ConfigMaps | None = None
) -> dict[str, str]:
    """The variables a container's envFrom brings (a missing optional source brings none)."""
    out: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "secretRef" in source:
            obj = secrets.get((namespace, source["secretRef"]["name"])) or {}
            out.update({prefix + k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()})
            out.update({prefix + k: str(v) for k, v in (obj.get("stringData") or {}).items()})
        elif "configMapRef" in source:
            obj = (configmaps or {}).get((namespace, source["configMapRef"]["name"])) or {}
            out.update({prefix + k: str(v) for k, v in (obj.get("data") or {}).items()})
    return out


def container_env(
    pod: LocalPod, container: Manifest, secrets: ConfigMaps, resolve_file: Path, kubeconfig: Path
) -> dict[str, str]:
    """The environment a container of `pod` starts with (this process's, then the pod's; see the module docstring)."""
    env = dict(os.environ)
    fields = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "status.podIP": "127.0.0.1",
        "spec.nodeName": "localhost",
    }
    env.update(env_from(container, pod.namespace, secrets))
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = local_path(pod, str(item["value"]))
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = fields.get(item["valueFrom"]["fieldRef"]["fieldPath"], "")
    env.update(
        EXITPLAN_PORT=str(pod.port),
        **{f"EXITPLAN_{n.upper().replace('-', '_')}_PORT": str(p) for n, p in pod.ports.items() if p != pod.port},
        EXITPLAN_RESOLVE_FILE=str(resolve_file),
        KUBECONFIG=str(kubeconfig),
        POD_IP="127.0.0.1",
        TMPDIR=str(pod.folder / "volumes" / "tmp")
        if (pod.folder / "volumes" / "tmp").exists()
        else env.get("TMPDIR", "/tmp"),
    )
    return env
