"""A service's own NetworkPolicies: who may reach its routers and workers, built from its plan. Pure, no I/O.

Every rule names the service's pods by their labels (exitplan.io/service, the component, the split),
so no other service's pods, in the namespace or not, are admitted; the chart's namespace-wide policies
(charts/exitplan/templates/networkpolicy.yaml) deny everything else and open what is not per service:
the routers' inference port to clients, DNS, metrics scraping and the bundle store. For a plan of N
splits, where the routers send inputs to split F (0, or 1 when they run split 0 themselves, a
co-located plan), the children are:

| NetworkPolicy | selects | admits |
|---|---|---|
| `<svc>-net-router` | the routers | ingress on the control port (8081) from the operator's pods (its drift loop reads the routers and pushes the tuned thresholds) and the service's workers (shadow feedback) |
| `<svc>-net-router-to-split-<F>` | routers labelled `exitplan.io/sends-to: F` | egress to the workers of split F (8080) |
| `<svc>-net-split-<S>` | the workers of split S | ingress (8080) from the routers that send to S and the workers of split S-1; egress to the workers of split S+1 (8080) and the routers' control port |

A router pod carries the split it sends to as a label (names.L_SENDS_TO), so the policies admit each
router to the split its own command line names. While the routers of a plan that switches co-location
roll, the old ones keep reaching their split: a plan with worker pods for both split 0 and split 1
keeps `router-to-split-1` (a router that ran split 0 still sends to split 1 until it is replaced); in
steady state no router carries that label, and only split 0 is reached. `with_network_policies` adds
them to a plan's children when the operator's settings ask for them (guards.Settings.network_policies,
chart value networkPolicy.perService); apply.py creates, patches and prunes them with the other children,
and the ownerReference lets the garbage collector take them with the service.
"""

from __future__ import annotations

from exitplan.api.manifest import Manifest
from exitplan.api.plan import Plan
from exitplan.operator import guards, names
from exitplan.operator.ownership import adopt

NS_NAME_LABEL = "kubernetes.io/metadata.name"
"""The label every namespace carries with its name (what a namespaceSelector names one namespace by)."""


def _pods(service: str, component: str, split: int | None = None, sends_to: int | None = None) -> Manifest:
    """A peer: the service's pods of `component` (of split `split`; routers labelled to send to `sends_to`)."""
    labels = names.selector_labels(service, component, split=split)
    if sends_to is not None:
        labels[names.L_SENDS_TO] = str(sends_to)
    return {"podSelector": {"matchLabels": labels}}


def _ports(*ports: int) -> list[Manifest]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def operator_peer(settings: guards.Settings) -> Manifest:
    """The operator's pods: by their labels, in its namespace (the service's own when none is set)."""
    peer: Manifest = {"podSelector": {"matchLabels": dict(settings.operator_labels)}}
    if settings.operator_namespace:
        peer["namespaceSelector"] = {"matchLabels": {NS_NAME_LABEL: settings.operator_namespace}}
    return peer


def _policy(name: str, namespace: str, plan_hash: str, selects: Manifest, rules: Manifest) -> Manifest:
    """A NetworkPolicy over the pods `selects` names, with `rules` (ingress/egress) and their policyTypes."""
    labels = selects["podSelector"]["matchLabels"]
    kinds = [kind for kind in ("Ingress", "Egress") if kind.lower() in rules]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(
            name,
            namespace,
            {names.L_SERVICE: labels[names.L_SERVICE], names.L_COMPONENT: "network-policy"},
            plan_hash,
        ),
        "spec": {"podSelector": selects["podSelector"], "policyTypes": kinds, **rules},
    }


def first_split(plan: Plan) -> int:
    """The split the routers send inputs to: 1 when they run split 0 themselves, else 0."""
    return 1 if plan.colocate else 0


def worker_splits(plan: Plan) -> list[int]:
    """The splits that run in worker pods (all but a co-located plan's split 0)."""
    return [s.index for s in plan.splits if not (plan.colocate and s.index == 0)]


def build_network_policies(service: str, namespace: str, plan: Plan, settings: guards.Settings) -> list[Manifest]:
    """The service's NetworkPolicies for `plan` (see the module docstring); not yet adopted."""
    plan_hash, splits = plan.layout_hash(), worker_splits(plan)
    # split 1 too while split 0 runs in workers: a router that ran split 0 itself sends there until replaced
    routers_sending = sorted({s for s in (first_split(plan), 1) if s in splits})
    control = {"from": [operator_peer(settings), _pods(service, "worker")], "ports": _ports(names.CONTROL_PORT)}
    out = [
        _policy(
            names.dns_name(service, "net-router"),
            namespace,
            plan_hash,
            _pods(service, "router"),
            {"ingress": [control]},
        )
    ]
    for split in routers_sending:
        egress = [{"to": [_pods(service, "worker", split=split)], "ports": _ports(names.PORT)}]
        selects = _pods(service, "router", sends_to=split)
        name = names.dns_name(service, "net-router-to-split", split)
        out.append(_policy(name, namespace, plan_hash, selects, {"egress": egress}))
    for split in splits:
        senders = [_pods(service, "router", sends_to=split)] if split in routers_sending else []
        senders += [_pods(service, "worker", split=split - 1)] if split - 1 in splits else []
        egress = [{"to": [_pods(service, "router")], "ports": _ports(names.CONTROL_PORT)}]
        if split + 1 < len(plan.splits):
            egress.insert(0, {"to": [_pods(service, "worker", split=split + 1)], "ports": _ports(names.PORT)})
        rules = {"ingress": [{"from": senders, "ports": _ports(names.PORT)}], "egress": egress}
        selects = _pods(service, "worker", split=split)
        out.append(_policy(names.dns_name(service, "net-split", split), namespace, plan_hash, selects, rules))
    return out


def with_network_policies(
    owner: Manifest, plan: Plan, settings: guards.Settings, children: list[Manifest]
) -> list[Manifest]:
    """`children` and, when the operator's settings ask for them, the service's NetworkPolicies, adopted by `owner`."""
    if not settings.network_policies:
        return children
    meta = owner["metadata"]
    policies = build_network_policies(meta["name"], meta["namespace"], plan, settings)
    adopt(policies, owner=owner)
    return [*children, *policies]
