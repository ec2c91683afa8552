"""Which image the operator's pods run, how it is pulled, and with which pull Secrets.

The operator's defaults come from its environment (the chart sets them from its values):

| env | chart value | default |
|---|---|---|
| EXITPLAN_IMAGE | dataPlane.image (repository:tag) | DEFAULT_IMAGE |
| EXITPLAN_IMAGE_PULL_POLICY | dataPlane.image.pullPolicy | IfNotPresent |
| EXITPLAN_IMAGE_PULL_SECRETS | dataPlane.imagePullSecrets (names, comma-separated) | none |

A GPUPool may name its own `image` and `imagePullPolicy` (the worker and profiling pods on it run
them) and add `imagePullSecrets`. Routers belong to no pool: they run the defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from exitplan.api.manifest import Manifest
from exitplan.api.resources import GPUPoolSpec

ENV_IMAGE = "EXITPLAN_IMAGE"
ENV_PULL_POLICY = "EXITPLAN_IMAGE_PULL_POLICY"
ENV_PULL_SECRETS = "EXITPLAN_IMAGE_PULL_SECRETS"
POLICIES = ("Always", "IfNotPresent", "Never")
DEFAULT_IMAGE = "ghcr.io/exitplan/exitplan:0.1.0"


@dataclass(frozen=True)
class Images:
    image: str
    pull_policy: str = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, default_image: str, env: dict[str, str] | None = None) -> Images:
        env = dict(os.environ if env is None else env)
        policy = env.get(ENV_PULL_POLICY) or "IfNotPresent"
        if policy not in POLICIES:
            raise ValueError(f"{ENV_PULL_POLICY}={policy!r}: give one of {list(POLICIES)}")
        secrets = tuple(dict.fromkeys(s.strip() for s in env.get(ENV_PULL_SECRETS, "").split(",") if s.strip()))
        return cls(env.get(ENV_IMAGE) or default_image, policy, secrets)

    def for_pool(self, pool: GPUPoolSpec | None) -> Images:
        """The pool's image, pull policy and extra pull Secrets over these defaults."""
        if pool is None:
            return self
        return replace(
            self,
            image=pool.image or self.image,
            pull_policy=pool.image_pull_policy or self.pull_policy,
            pull_secrets=tuple(dict.fromkeys([*self.pull_secrets, *(s.name for s in pool.image_pull_secrets)])),
        )

    def container(self) -> Manifest:
        """A container's `image` and `imagePullPolicy`."""
        return {"image": self.image, "imagePullPolicy": self.pull_policy}

    def pod(self) -> Manifest:
        """A pod spec's `imagePullSecrets` (nothing when there are none)."""
        return {"imagePullSecrets": [{"name": s} for s in self.pull_secrets]} if self.pull_secrets else {}


IMAGE = os.environ.get(ENV_IMAGE, DEFAULT_IMAGE)
"""Container image of routers, workers and the operator's Jobs (env EXITPLAN_IMAGE of the operator)."""
IMAGES = Images.from_env(IMAGE)
"""IMAGE with its pull policy and pull Secrets; a GPUPool may override them for its pods (`for_pool`)."""
