"""NetworkPolicies evaluated offline: which pod may open a connection to which pod and port, by the
Kubernetes semantics of podSelector, namespaceSelector, policyTypes, ports and the union of policies
(a pod selected by no policy of a type is not isolated for it). A stand-in for a CNI that enforces
them, shared by the chart's tests and the operator's per-service policies' tests. No tests here.
"""

from __future__ import annotations

from typing import Any


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (an empty selector selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


class Pod:
    def __init__(self, name: str, namespace: str, labels: dict[str, str]) -> None:
        self.name, self.namespace, self.labels = name, namespace, labels

    def __repr__(self) -> str:
        return f"{self.namespace}/{self.name}"


def _peer_matches(peer: dict[str, Any], pod: Pod, policy_ns: str) -> bool:
    ns_labels = {"kubernetes.io/metadata.name": pod.namespace}
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif pod.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], pod.labels)


def _rule_allows(rule: dict[str, Any], peers_key: str, other: Pod, port: int, proto: str, policy_ns: str) -> bool:
    ports = rule.get("ports")
    if ports and not any(p.get("port") in (None, port) and p.get("protocol", "TCP") == proto for p in ports):
        return False
    peers = rule.get(peers_key)
    return not peers or any(_peer_matches(peer, other, policy_ns) for peer in peers)


def allowed(policies: list[dict[str, Any]], src: Pod, dst: Pod, port: int, proto: str = "TCP") -> bool:
    """Whether NetworkPolicies let `src` open a connection to `dst`:`port` (egress of src and ingress of dst)."""

    def side(pod: Pod, kind: str, rules_key: str, peers_key: str, other: Pod) -> bool:
        mine = [
            p
            for p in policies
            if p["metadata"]["namespace"] == pod.namespace
            and selects(p["spec"]["podSelector"], pod.labels)
            and kind in p["spec"]["policyTypes"]
        ]
        if not mine:
            return True  # not isolated
        return any(
            _rule_allows(rule, peers_key, other, port, proto, pod.namespace)
            for p in mine
            for rule in p["spec"].get(rules_key) or []
        )

    return side(src, "Egress", "egress", "to", dst) and side(dst, "Ingress", "ingress", "from", src)
