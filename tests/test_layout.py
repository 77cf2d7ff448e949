"""The package's shape, checked: imports run one way, modules stay small, architectures
are looked up in the registry, and graphs/ depends on nothing it is not handed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"srm_max": ROOT / "python" / "srm_max", "srm_max.graphs": ROOT / "graphs"}
MAX_LINES = 420  # "about 400": one concept per module


def modules() -> dict[str, Path]:
    """Every module of the package (graphs/ included, as srm_max.graphs) -> its file."""
    found = {}
    for package, root in PACKAGE_DIRS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "srm_max" and parts[:1] == ["graphs"]:
                continue
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (function-level imports
    too: they hide circles, they do not remove them)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # ``from a.b import name``: the module a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 50 and "srm_max.serve.scheduler" in graph["srm_max.serve.generator"]
    assert cycles(graph) == []


def test_graphs_depend_only_on_what_they_are_handed():
    """graphs/ builds MAX graphs from a config and a weight schema it is given: it imports
    nothing of the package outside graphs/."""
    graph = import_graph()
    outside = {(m, t) for m, targets in graph.items() if m.startswith("srm_max.graphs")
               for t in targets if not t.startswith("srm_max.graphs")}
    assert outside == set()


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_are_small(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines: split it by concept"


ARCH_COMPARISON = re.compile(r"""(==|!=)\s*["'](srm|pha)["']|["'](srm|pha)["']\s*(==|!=)|architecture\s*(==|!=|in\b)""")


def test_architectures_are_looked_up_in_the_registry():
    """No ``== "pha"`` dispatch outside models/: every choice that depends on the
    architecture is a registry lookup."""
    offenders = []
    for name, path in modules().items():
        if name.startswith("srm_max.models"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ARCH_COMPARISON.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_the_srm_weight_names_are_written_once():
    """The SRM checkpoint's key names appear in its schema and nowhere else in the
    package (the converter's patterns for the paper code's files aside)."""
    key = re.compile(r"channel_mixing_layer|token_mixing_layer|mixer_heads|proj_head|input_layer\.weight")
    allowed = {"srm_max.models.srm.schema", "srm_max.checkpoints.convert", "srm_max.reference.srm",
               "srm_max.reference.mixer"}
    spelled = {name for name, path in modules().items() if key.search(path.read_text())}
    assert spelled <= allowed, spelled - allowed
    assert "srm_max.models.srm.schema" in spelled
