"""The chart's RBAC rules are exactly what the code uses: nothing missing, nothing extra.

What the code needs comes from two places, both derived here rather than written down:

- the application: a static scan of the modules `exitplan operator` runs (operator/handlers.py and
  operator/peering.py with everything they import from exitplan.operator, and the command in
  exitplan/cmd_operator.py). Every KubeClient call (get, list, create, merge_patch, delete, request)
  is resolved to (API group, resource, verb): URLs built with `path("Kind", ...)`, `object_path(obj)`
  or constants; object kinds followed through variables, loops, comprehensions, builder functions
  (their `"kind": ...` literals) and into generic helpers (apply_one, delete_one) at their call
  sites. `kopf.event` means events/create; `kopf.adopt` means finalizers/update on the owner (the
  resource kopf's handlers serve). A call the scan cannot resolve fails the test, naming the line.
- kopf itself: the handlers kopf has registered for exitplan (list+watch every served resource;
  patch where change handlers store progress/diff-base annotations and timers add their finalizer),
  events/create for its own posts, CRD list+watch for resource discovery, and, by mode, the
  ClusterKopfPeering (list, watch, patch) or namespaces (list, watch) — as kopf's source does it
  (kopf/_core/engines/peering.py, posting.py, kopf/_core/reactor/observation.py).

The profiling Job's identity is scanned the same way from `exitplan operator publish-profile` and
`exitplan operator publish-bundle-info` (the bundle-info Job's, which runs under the same identity).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ast_source
import pytest
from test_chart_support import NAMESPACE, RESTRICTED, ROOT, VARIANTS, of_kind, one, render

pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra: pip install -e '.[dev]'")

Need = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)
CLIENT_VERBS = {
    "get": "get",
    "list": "list",
    "list_at": "list",
    "watch": "watch",
    "create": "create",
    "merge_patch": "patch",
    "delete": "delete",
}
CLIENT_NON_API = {"close", "from_config"}
HTTP_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
URL_RE = re.compile(
    r"^/(?:api|apis/(?P<group>[^/]+))/(?P<version>v[^/]+)/(?:namespaces/[^/]+/)?"
    r"(?P<plural>[a-z0-9]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[a-z]+))?$"
)
OPERATOR_ROOTS = ("exitplan.operator.handlers", "exitplan.operator.peering")
PEERING_MODULE = "exitplan.operator.peering"
CLUSTER_SCOPED = {
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("", "namespaces"),
    ("kopf.dev", "clusterkopfpeerings"),
}


class Unresolved(Exception):
    """The scan cannot tell what an expression holds."""


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    funcs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    consts: dict[str, str] = field(default_factory=dict)
    imports: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Param:
    name: str
    mode: str  # obj | str | url


class Scanner:
    """Resolves the Kubernetes API calls of a set of modules (see the module docstring)."""

    def __init__(self, sources: dict[str, tuple[str, str]], kinds: dict[str, tuple[str, str, bool]]) -> None:
        self.kinds = kinds  # kind -> (api prefix, plural, namespaced)
        self.names = set(sources)
        self.modules: dict[str, Module] = {}
        for name, (path, text) in sources.items():
            self.modules[name] = self._load(name, path, text)
        self.unresolved: list[str] = []
        self.adopts: list[str] = []
        self._effects: dict[tuple[str, str], frozenset] = {}
        self._busy: set[tuple[str, str]] = set()

    # ---------------------------------------------------------- loading

    def _load(self, name: str, path: str, text: str) -> Module:
        mod = Module(name, path, ast_source.parse(text, path))
        package = name.rsplit(".", 1)[0]
        for node in mod.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.funcs[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        mod.methods[f"{node.name}.{item.name}"] = item
            elif (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        mod.consts[target.id] = node.value.value
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                for alias in node.names:
                    local = alias.asname or alias.name
                    full = f"{base}.{alias.name}"
                    mod.aliases[local] = ("module", full) if full in self.names else ("attr", base, alias.name)
                    mod.imports.add(base)
                    mod.imports.add(f"{base}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    mod.aliases[alias.asname or alias.name] = ("module", alias.name)
                    mod.imports.add(alias.name)
        return mod

    def closure(self, roots: tuple[str, ...]) -> list[str]:
        seen: list[str] = []
        todo = list(roots)
        while todo:
            name = todo.pop()
            if name in seen or name not in self.modules:
                continue
            seen.append(name)
            todo.extend(i for i in self.modules[name].imports if i in self.modules)
        return sorted(seen)

    # ---------------------------------------------------------- name resolution

    def function(self, mod: Module, func: ast.expr) -> tuple[Module, ast.FunctionDef | ast.AsyncFunctionDef] | None:
        """The scanned module-level function a call names, if any."""
        if isinstance(func, ast.Name):
            if func.id in mod.funcs:
                return mod, mod.funcs[func.id]
            alias = mod.aliases.get(func.id)
            if alias and alias[0] == "attr" and alias[1] in self.modules and alias[2] in self.modules[alias[1]].funcs:
                target = self.modules[alias[1]]
                return target, target.funcs[alias[2]]
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            alias = mod.aliases.get(func.value.id)
            if (
                alias
                and alias[0] == "module"
                and alias[1] in self.modules
                and func.attr in self.modules[alias[1]].funcs
            ):
                target = self.modules[alias[1]]
                return target, target.funcs[func.attr]
        return None

    def const(self, mod: Module, name: str) -> str | None:
        if name in mod.consts:
            return mod.consts[name]
        alias = mod.aliases.get(name)
        if alias and alias[0] == "attr" and alias[1] in self.modules:
            return self.modules[alias[1]].consts.get(alias[2])
        return None

    @staticmethod
    def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
        return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]

    @staticmethod
    def _binds(target: ast.expr, name: str) -> bool:
        """Whether assigning to `target` rebinds `name` (x = ..., x, y = ...; not x[k] = ...)."""
        if isinstance(target, ast.Name):
            return target.id == name
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(Scanner._binds(t, name) for t in target.elts)
        if isinstance(target, ast.Starred):
            return Scanner._binds(target.value, name)
        return False

    def _loop_source(self, name: str, at: ast.AST, parents: dict[ast.AST, ast.AST]) -> tuple[ast.expr, ast.AST] | None:
        """The iterable a loop or comprehension binds `name` from, around `at`."""
        child, node = at, parents.get(at)
        while node is not None:
            if isinstance(node, (ast.For, ast.AsyncFor)) and child is not node.iter and self._binds(node.target, name):
                return node.iter, node
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                for gen in node.generators:
                    if self._binds(gen.target, name) and child is not gen.iter:
                        return gen.iter, gen.iter
            child, node = node, parents.get(node)
        return None

    def _assignments(self, fn: ast.AST, name: str) -> list[ast.expr]:
        out = []
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(self._binds(t, name) for t in node.targets):
                out.append(node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None and self._binds(node.target, name):
                out.append(node.value)
        return out

    def _where(self, mod: Module, node: ast.AST) -> str:
        return f"{Path(mod.path).name}:{getattr(node, 'lineno', '?')}"

    # ---------------------------------------------------------- what expressions hold

    def strings(self, mod: Module, fn: Any, expr: ast.expr, parents: dict) -> set:
        """Kind names an expression can hold (literal strings, or a Param)."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return {expr.value}
        if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(self.strings(mod, fn, e, parents) for e in expr.elts))
        if isinstance(expr, ast.Name):
            loop = self._loop_source(expr.id, expr, parents)
            if loop is not None:
                return self.strings(mod, fn, loop[0], parents)
            if expr.id in self.params(fn):
                return {Param(expr.id, "str")}
            values = self._assignments(fn, expr.id)
            if values:
                return set().union(*(self.strings(mod, fn, v, parents) for v in values))
            const = self.const(mod, expr.id)
            if const is not None:
                return {const}
        raise Unresolved(f"{self._where(mod, expr)}: cannot tell which kind `{ast.unparse(expr)}` names")

    def objects(self, mod: Module, fn: Any, expr: ast.expr, parents: dict) -> set:
        """Kinds of the manifest(s) an expression can hold (or a Param)."""
        if isinstance(expr, ast.Constant) and expr.value is None:
            return set()  # `return None`: no object
        if isinstance(expr, ast.Dict):
            for key, value in zip(expr.keys, expr.values):
                if isinstance(key, ast.Constant) and key.value == "kind":
                    return self.strings(mod, fn, value, parents)
            raise Unresolved(f"{self._where(mod, expr)}: a manifest literal without a kind")
        if isinstance(expr, ast.Await):
            return self.objects(mod, fn, expr.value, parents)
        if isinstance(expr, ast.Starred):
            return self.objects(mod, fn, expr.value, parents)
        if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(self.objects(mod, fn, e, parents) for e in expr.elts)) if expr.elts else set()
        if isinstance(expr, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return self.objects(mod, fn, expr.elt, parents)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            return self.objects(mod, fn, expr.left, parents) | self.objects(mod, fn, expr.right, parents)
        if isinstance(expr, ast.IfExp):
            return self.objects(mod, fn, expr.body, parents) | self.objects(mod, fn, expr.orelse, parents)
        if isinstance(expr, ast.Subscript):
            try:
                keys = self.strings(mod, fn, expr.slice, parents)
            except Unresolved:
                keys = set()
            if keys and all(isinstance(k, str) and k in self.kinds for k in keys):
                return keys  # a mapping of objects by kind (apply.list_children)
            return self.objects(mod, fn, expr.value, parents)
        if isinstance(expr, ast.Name):
            loop = self._loop_source(expr.id, expr, parents)
            if loop is not None:
                return self.objects(mod, fn, loop[0], parents)
            if expr.id in self.params(fn):
                return {Param(expr.id, "obj")}
            values = self._assignments(fn, expr.id)
            if values:
                return set().union(*(self.objects(mod, fn, v, parents) for v in values))
        if isinstance(expr, ast.Call):
            if (
                isinstance(expr.func, ast.Attribute)
                and expr.func.attr in ("deepcopy", "copy")
                or isinstance(expr.func, ast.Name)
                and expr.func.id in ("dict", "list", "tuple", "sorted")
            ):
                return self.objects(mod, fn, expr.args[0], parents)
            found = self.function(mod, expr.func)
            if found is not None:
                return self.returns(found[0], found[1], expr, mod, fn, parents)
        raise Unresolved(f"{self._where(mod, expr)}: cannot tell which kind of object `{ast.unparse(expr)[:80]}` holds")

    def returns(self, gmod: Module, g: Any, call: ast.Call, mod: Module, fn: Any, parents: dict) -> set:
        """Kinds a function returns, its Params bound to the call's arguments."""
        gparents = _parents(g)
        out: set = set()
        for node in ast.walk(g):
            if isinstance(node, ast.Return) and node.value is not None and _owner(node, gparents) is g:
                out |= self.objects(gmod, g, node.value, gparents)
        return self._bind(out, g, call, mod, fn, parents)

    def _bind(self, items: set, g: Any, call: ast.Call, mod: Module, fn: Any, parents: dict) -> set:
        out: set = set()
        names = self.params(g)
        for item in items:
            if not isinstance(item, Param):
                out.add(item)
                continue
            arg = None
            if item.name in names[: len(call.args)]:
                arg = call.args[names.index(item.name)]
            for kw in call.keywords:
                if kw.arg == item.name:
                    arg = kw.value
            if arg is None:
                raise Unresolved(f"{self._where(mod, call)}: `{item.name}` of {g.name}() is not passed")
            resolver = {"obj": self.objects, "str": self.strings, "url": self.urls}[item.mode]
            out |= resolver(mod, fn, arg, parents)
        return out

    def urls(self, mod: Module, fn: Any, expr: ast.expr, parents: dict) -> set:
        """(group, resource) targets, or kind names, or Params, of a URL expression."""
        if isinstance(expr, ast.Call):
            callee = expr.func.id if isinstance(expr.func, ast.Name) else getattr(expr.func, "attr", "")
            if callee in ("path", "object_path"):
                sub = None
                rest = expr.args[1:] if callee == "object_path" else expr.args[3:]
                for kw in expr.keywords:
                    if kw.arg == "subresource":
                        rest = [kw.value]
                if rest and isinstance(rest[0], ast.Constant):
                    sub = rest[0].value
                found = (self.objects if callee == "object_path" else self.strings)(mod, fn, expr.args[0], parents)
                return {("kind", k, sub) if isinstance(k, str) else k for k in found}
        if isinstance(expr, ast.Name):
            if expr.id in self.params(fn):
                return {Param(expr.id, "url")}
            values = self._assignments(fn, expr.id)
            if values:
                return set().union(*(self.urls(mod, fn, v, parents) for v in values))
        text = self._template(mod, expr)
        if text is not None:
            match = URL_RE.match(text)
            if match:
                resource = match["plural"] + (f"/{match['sub']}" if match["sub"] else "")
                return {("res", match["group"] or "", resource, bool(match["name"]))}
        raise Unresolved(f"{self._where(mod, expr)}: cannot tell which API path `{ast.unparse(expr)[:80]}` is")

    def _template(self, mod: Module, expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        if isinstance(expr, ast.Name):
            return self.const(mod, expr.id)
        if isinstance(expr, ast.JoinedStr):
            parts = []
            for value in expr.values:
                if isinstance(value, ast.Constant):
                    parts.append(str(value.value))
                else:
                    inner = value.value if isinstance(value, ast.FormattedValue) else value
                    const = self.const(mod, inner.id) if isinstance(inner, ast.Name) else None
                    parts.append(const if const is not None else "x")
            return "".join(parts)
        return None

    # ---------------------------------------------------------- effects

    def to_need(self, target: tuple, verb: str) -> Need | Param:
        if target[0] == "kind":
            _, kind, sub = target
            prefix, plural, _ = self.kinds[kind]
            group = "" if prefix == "/api/v1" else prefix.split("/")[2]
            return (group, plural + (f"/{sub}" if sub else ""), verb)
        if target[0] == "res":
            return (target[1], target[2], verb)
        raise AssertionError(target)

    def effects(self, mod: Module, fn: Any) -> frozenset:
        """(group, resource, verb) needs of a function, or (Param, verb) for generic helpers."""
        key = (mod.name, f"{fn.name}:{fn.lineno}")
        if key in self._effects:
            return self._effects[key]
        if key in self._busy:
            return frozenset()
        self._busy.add(key)
        parents = _parents(fn)
        out: set = set()
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            try:
                out |= self._call_effects(mod, fn, call, parents)
            except Unresolved as err:
                self.unresolved.append(str(err))
        self._busy.discard(key)
        self._effects[key] = frozenset(out)
        return self._effects[key]

    def _call_effects(self, mod: Module, fn: Any, call: ast.Call, parents: dict) -> set:
        func = call.func
        if isinstance(func, ast.Attribute):
            receiver = ast.unparse(func.value)
            if isinstance(func.value, ast.Name) and func.value.id == "kopf" or receiver.endswith("kopf"):
                if func.attr in ("event", "info", "warn", "exception"):
                    return {("", "events", "create")}
                if func.attr in ("adopt", "append_owner_reference"):
                    self.adopts.append(self._where(mod, call))
                return set()
            if re.search(r"(^|\.)client$|\[['\"]client['\"]\]$", receiver):
                return self._client_call(mod, fn, call, func.attr, parents)
            if re.search(r"(^|\.)(CoreV1Api|AppsV1Api|BatchV1Api|CustomObjectsApi|ApiClient)\b", receiver):
                raise Unresolved(
                    f"{self._where(mod, call)}: kubernetes client call `{ast.unparse(call)[:60]}` is not scanned"
                )
        found = self.function(mod, func)
        if found is None:
            return set()
        gmod, g = found
        out: set = set()
        for need in self.effects(gmod, g):
            if isinstance(need[0], Param):
                for target in self._bind({need[0]}, g, call, mod, fn, parents):
                    out.add(self._concrete(target, need[1]))
            else:
                out.add(need)
        return out

    def _concrete(self, target: Any, verb: str) -> Any:
        if isinstance(target, Param):
            return (target, verb)
        if isinstance(target, str):
            return self.to_need(("kind", target, None), verb)
        if target[0] == "res":
            return self.to_need(target, verb)
        return self.to_need(target, verb)

    def _client_call(self, mod: Module, fn: Any, call: ast.Call, method: str, parents: dict) -> set:
        if method in CLIENT_NON_API:
            return set()
        if method == "request":
            verb_arg = call.args[0]
            if not isinstance(verb_arg, ast.Constant):
                raise Unresolved(f"{self._where(mod, call)}: HTTP method is not a literal")
            targets = self.urls(mod, fn, call.args[1], parents)
            out = set()
            for t in targets:
                if verb_arg.value == "GET":
                    named = t[3] if t[0] == "res" else True
                    verb = "get" if named else "list"
                else:
                    verb = HTTP_VERBS[verb_arg.value]
                out.add(self._concrete(t, verb))
            return out
        if method not in CLIENT_VERBS:
            raise Unresolved(f"{self._where(mod, call)}: unknown client method `{method}`")
        verb = CLIENT_VERBS[method]
        if method == "create":
            targets = self.objects(mod, fn, call.args[0], parents)
        else:
            targets = self.urls(mod, fn, call.args[0], parents)
        return {self._concrete(t, verb) for t in targets}

    def needs(
        self, module_names: list[str], functions: list[tuple[str, str]] | None = None, exclude: set[str] = frozenset()
    ) -> set[Need]:
        """Concrete needs of every function (and method) of the modules, or of the named functions."""
        out: set[Need] = set()
        todo: list[tuple[Module, Any]] = []
        if functions is not None:
            todo = [(self.modules[m], self.modules[m].funcs[f]) for m, f in functions]
        for name in module_names:
            if name in exclude:
                continue
            mod = self.modules[name]
            todo += [(mod, f) for f in (*mod.funcs.values(), *mod.methods.values())]
        for mod, fn in todo:
            out |= {n for n in self.effects(mod, fn) if not isinstance(n[0], Param)}
        return out


def _parents(root: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(root) for child in ast.iter_child_nodes(node)}


def _owner(node: ast.AST, parents: dict) -> ast.AST | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return node
    return None


def _sources() -> dict[str, tuple[str, str]]:
    out = {f"exitplan.operator.{p.stem}": (str(p), p.read_text()) for p in sorted((ROOT / "operator").glob("*.py"))}
    path = ROOT / "exitplan" / "cmd_operator.py"
    out["exitplan.cmd_operator"] = (str(path), path.read_text())
    return out


def scanner(extra: dict[str, str] | None = None) -> Scanner:
    from exitplan.operator.kube import KINDS

    sources = _sources()
    for name, text in (extra or {}).items():
        sources[name] = (f"{name.rsplit('.', 1)[-1]}.py", text)
    return Scanner(sources, KINDS)


# ------------------------------------------------------------------ what each identity needs


@dataclass
class Needs:
    app: set[Need]
    app_peering: set[Need]
    kopf_handlers: set[Need]
    adopt_owners: set[Need]
    profiler: set[Need]
    unresolved: list[str]


def kopf_handler_needs() -> tuple[set[Need], set[tuple[str, str]]]:
    """What kopf does for the handlers exitplan registers: list+watch every served resource; patch
    where change handlers keep progress/diff-base annotations or handlers need a finalizer."""
    import kopf

    import exitplan.operator.handlers  # noqa: F401  (registers the handlers)

    registry = kopf.get_default_registry()
    out: set[Need] = set()
    changed: set[tuple[str, str]] = set()
    groups = {
        "changing": registry._changing,
        "watching": registry._watching,
        "spawning": registry._spawning,
        "indexing": registry._indexing,
        "webhooks": registry._webhooks,
    }
    for kind, reg in groups.items():
        for handler in reg.get_all_handlers():
            if not getattr(handler.fn, "__module__", "").startswith("exitplan."):
                continue
            sel = handler.selector
            assert sel.group and sel.plural, f"handler {handler.id}: give group and plural explicitly"
            out |= {(sel.group, sel.plural, "list"), (sel.group, sel.plural, "watch")}
            if kind in ("changing", "spawning") or getattr(handler, "requires_finalizer", False):
                out.add((sel.group, sel.plural, "patch"))
                changed.add((sel.group, sel.plural))
    return out, changed


def kopf_framework_needs(*, clusterwide: bool, peering: bool) -> set[Need]:
    out = {
        ("", "events", "create"),  # posting.py
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),  # observation.py resource_observer
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
    if peering:
        assert clusterwide, "the operator's peering is the cluster-wide ClusterKopfPeering"
        out |= {("kopf.dev", "clusterkopfpeerings", v) for v in ("list", "watch", "patch")}  # peering.py
    if not clusterwide:
        out |= {("", "namespaces", "list"), ("", "namespaces", "watch")}  # observation.py namespace_observer
    return out


@functools.lru_cache(maxsize=1)
def code_needs() -> Needs:
    scan = scanner()
    operator_modules = scan.closure(OPERATOR_ROOTS)
    app = scan.needs(operator_modules, exclude={PEERING_MODULE})
    # `exitplan operator` calls operator/peering.py only with --peering: those needs follow the mode
    app_peering = scan.needs([PEERING_MODULE], functions=[("exitplan.cmd_operator", "command")])
    kopf_needs, owners = kopf_handler_needs()
    adopt = {(g, f"{p}/finalizers", "update") for g, p in owners} if scan.adopts else set()
    profiler = scan.needs(
        [], functions=[("exitplan.cmd_operator", "publish_profile"), ("exitplan.cmd_operator", "publish_bundle_info")]
    )
    return Needs(app, app_peering, kopf_needs, adopt, profiler, list(scan.unresolved))


def expected(*, clusterwide: bool, peering: bool) -> set[Need]:
    needs = code_needs()
    out = (
        needs.app
        | needs.kopf_handlers
        | needs.adopt_owners
        | kopf_framework_needs(clusterwide=clusterwide, peering=peering)
    )
    if peering:
        out |= needs.app_peering
    return out


def is_cluster_scoped(need: Need) -> bool:
    from exitplan.operator.kube import KINDS

    group, resource, _ = need
    plural = resource.split("/")[0]
    if (group, plural) in CLUSTER_SCOPED:
        return True
    for _prefix, kplural, namespaced in KINDS.values():
        if kplural == plural:
            return not namespaced
    return False


def rule_needs(role: dict[str, Any]) -> set[Need]:
    out: list[Need] = []
    for rule in role["rules"]:
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], f"wildcard rule {rule}"
        out += [(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]]
    assert len(out) == len(set(out)), f"{role['kind']} {role['metadata']['name']} repeats a rule"
    return set(out)


def diff(have: set[Need], want: set[Need]) -> str:
    missing = sorted(want - have)
    extra = sorted(have - want)
    return f"missing (the code calls, the chart does not grant): {missing}; extra (granted, never called): {extra}"


# ------------------------------------------------------------------ tests


def test_scan_resolves_every_api_call() -> None:
    needs = code_needs()
    assert needs.unresolved == [], "\n".join(needs.unresolved)
    # the scan sees the calls it must (a floor, so a broken scan cannot pass by finding nothing)
    assert ("", "configmaps", "get") in needs.app and ("apps", "deployments", "delete") in needs.app
    assert ("exitplan.io", "earlyexitservices/status", "patch") in needs.app
    assert ("kopf.dev", "clusterkopfpeerings", "create") in needs.app_peering
    assert ("exitplan.io", "modelprofiles", "create") in needs.profiler
    assert ("", "configmaps", "patch") in needs.profiler  # publish-bundle-info (operator/bundle_info.py)


def is_secret(need: Need) -> bool:
    return need[:2] == ("", "secrets")


def test_cluster_wide_rules_match_the_code_exactly() -> None:
    """Everything the code needs, with Secrets split out of the ClusterRole into a Role of each
    namespace the chart serves (issue 28 item 7: no cluster-wide Secrets in the default mode)."""
    objs = render()
    role = one(objs, "ClusterRole", "exitplan-operator")
    want = expected(clusterwide=True, peering=True)
    cluster_want = {n for n in want if not is_secret(n)}
    assert rule_needs(role) == cluster_want, diff(rule_needs(role), cluster_want)
    (ns_role,) = [r for r in of_kind(objs, "Role") if r["metadata"]["name"] == "exitplan-operator"]
    assert ns_role["metadata"]["namespace"] == "default"
    assert (
        rule_needs(ns_role) == {n for n in want if is_secret(n)} == {("", "secrets", "get"), ("", "secrets", "create")}
    )
    binding = one(objs, "ClusterRoleBinding", "exitplan-operator")
    sts = one(objs, "StatefulSet")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    subject = {
        "kind": "ServiceAccount",
        "name": sts["spec"]["template"]["spec"]["serviceAccountName"],
        "namespace": NAMESPACE,
    }
    assert binding["subjects"] == [subject]
    role_binding = one(objs, "RoleBinding", "exitplan-operator", "default")
    assert role_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "exitplan-operator",
    }
    assert role_binding["subjects"] == [subject]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_cluster_wide_secrets_in_any_variant(variant: str) -> None:
    """The attack: a ClusterRole that gets or creates Secrets lets the operator (and whoever holds its
    token) read every Secret of the cluster. In every rendered variant no ClusterRole names Secrets, and
    a Role grants them only in the namespaces the chart serves."""
    objs = render(VARIANTS[variant])
    for cluster_role in of_kind(objs, "ClusterRole"):
        granted = {r for rule in cluster_role["rules"] for r in rule["resources"]}
        assert "secrets" not in granted and "*" not in granted, (variant, cluster_role["metadata"]["name"])
    served = set(VARIANTS[variant].get("namespaces", {}).get("services", ["default"]))
    with_secrets = {
        r["metadata"]["namespace"]
        for r in of_kind(objs, "Role")
        if any("secrets" in x["resources"] for x in r["rules"])
    }
    assert with_secrets == served, variant
    print(f"{variant}: Secrets granted in {sorted(with_secrets)} only, no ClusterRole names them")


def test_rules_without_peering_drop_exactly_the_peering_needs() -> None:
    objs = render({"leaderElection": {"enabled": False}})
    have = rule_needs(one(objs, "ClusterRole"))
    want = {n for n in expected(clusterwide=True, peering=False) if not is_secret(n)}
    assert have == want, diff(have, want)
    assert not any(r == "clusterkopfpeerings" for _, r, _ in have)


def test_restricted_rules_split_into_cluster_and_namespaced_roles() -> None:
    objs = render(RESTRICTED)
    want = expected(clusterwide=False, peering=False)
    cluster_want = {n for n in want if is_cluster_scoped(n)}
    ns_want = want - cluster_want
    have_cluster = rule_needs(one(objs, "ClusterRole", "exitplan-operator"))
    assert have_cluster == cluster_want, diff(have_cluster, cluster_want)
    for ns in RESTRICTED["namespaces"]["services"]:
        have_ns = rule_needs(one(objs, "Role", "exitplan-operator", ns))
        assert have_ns == ns_want, diff(have_ns, ns_want)
        assert ("", "secrets", "get") in have_ns
        binding = one(objs, "RoleBinding", "exitplan-operator", ns)
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "exitplan-operator",
        }
        assert binding["subjects"][0]["namespace"] == NAMESPACE


def test_profiler_role_matches_publish_profile_exactly() -> None:
    objs = render()
    want = code_needs().profiler
    for ns in ("default",):
        have = rule_needs(one(objs, "Role", "exitplan-profiler", ns))
        assert have == want, diff(have, want)


def test_every_rule_is_commented_as_kopf_or_app() -> None:
    text = (ROOT / "charts" / "exitplan" / "templates" / "_rbac_rules.tpl").read_text()
    rules = re.findall(r"((?:#[^\n]*\n)+)- apiGroups", text)
    assert len(rules) == text.count("- apiGroups"), "every rule needs a comment block above it"
    for comment in rules:
        assert "kopf" in comment or "app:" in comment, comment


# ------------------------------------------------------------------ the scan itself can fail


SWEEP = """
from exitplan.operator.kube import KubeClient, path
from exitplan.operator import apply as applying


async def sweep(client: KubeClient, namespace: str) -> None:
    for kind in ("Job", "Pod"):
        for obj in await client.list(path(kind, namespace)):
            await client.delete(path(kind, namespace, obj["metadata"]["name"]))
    report = applying.ApplyReport()
    await applying.apply_one(client, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}, report)
"""


def test_scan_notices_a_new_api_call() -> None:
    """A handler that deletes Jobs and Pods and applies a Namespace: the scan reports exactly those
    needs, and the chart's rules (which do not grant them) would fail the comparison."""
    scan = scanner({"exitplan.operator.sweep": SWEEP})
    got = scan.needs(["exitplan.operator.sweep"])
    assert scan.unresolved == []
    assert got == {
        ("batch", "jobs", "list"),
        ("batch", "jobs", "delete"),
        ("", "pods", "list"),
        ("", "pods", "delete"),
        ("", "namespaces", "get"),
        ("", "namespaces", "create"),
        ("", "namespaces", "patch"),
    }
    have = rule_needs(one(render(), "ClusterRole"))
    assert ("batch", "jobs", "delete") not in have and ("", "pods", "delete") not in have


def test_scan_refuses_what_it_cannot_resolve() -> None:
    code = """
async def mystery(client, body):
    await client.create(body["children"][0] if body else {})
"""
    scan = scanner({"exitplan.operator.mystery": code})
    scan.needs(["exitplan.operator.mystery"])
    assert len(scan.unresolved) == 1 and "mystery.py:3" in scan.unresolved[0]


def test_kopf_handler_needs_come_from_the_registry() -> None:
    needs, changed = kopf_handler_needs()
    assert ("exitplan.io", "earlyexitservices") in changed
    assert ("exitplan.io", "modelprofiles", "watch") in needs
    assert ("exitplan.io", "modelprofiles", "patch") not in needs  # an event handler stores nothing
    assert "kopf" in sys.modules
