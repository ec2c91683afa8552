"""The one type of a Kubernetes object as exitplan handles it: its JSON as plain dicts.

The operator builds children as `Manifest`s (operator/builders.py and its neighbours), reads and writes
them through its API client (operator/kube.py), and the dev cluster stores and serves them
(devcluster/). Kubernetes objects are open-ended (every kind its own schema, unknown fields kept), so
the type is a plain mapping; the typed parts of exitplan's own kinds are the pydantic models of
api/resources.py.
"""

from __future__ import annotations

from typing import Any, TypeAlias

Manifest: TypeAlias = dict[str, Any]
"""A Kubernetes object (or a part of one: metadata, a pod spec, a container) as JSON."""

__all__ = ["Manifest"]
