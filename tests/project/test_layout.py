"""The package's shape, checked: imports run one way, modules stay small, architectures
are looked up in the registry, and graphs/ depends on nothing it is not handed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT as ROOT

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


def architecture_literals(source: str, names) -> list[int]:
    """Lines of ``source`` holding a string constant that is an architecture's name
    (``== "pha"``, ``in ("srm", "pha")``, ``{"srm": ...}``): a decision that belongs to
    the registry."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names})


def test_the_architecture_check_sees_a_name():
    assert architecture_literals('if c.architecture in ("srm", "x"):\n    pass\n', {"srm", "pha"}) == [1]
    assert architecture_literals('d = {}\nd["pha"] = 1\n', {"srm", "pha"}) == [2]
    assert architecture_literals('x = "pha-like srm"\n', {"srm", "pha"}) == []


def test_architectures_are_named_only_in_models():
    """Nothing outside models/ names an architecture: every choice that depends on it is
    a registry lookup."""
    from srm_max.models import registry

    offenders = [f"{path.relative_to(ROOT)}:{line}" for name, path in modules().items()
                 if not name.startswith("srm_max.models")
                 for line in architecture_literals(path.read_text(), set(registry.names()))]
    assert offenders == []


# Wings that must not import another: (importer, imported, why). graphs/ has its own rule
# above (it imports nothing of the package outside itself).
FORBIDDEN_IMPORTS = [
    ("srm_max.checkpoints", "srm_max.serve", "checkpoints are read, written and verified without the serving wing"),
    ("srm_max.models", "srm_max.serve", "an architecture knows nothing of scheduling or HTTP"),
    ("srm_max.models", "srm_max.checkpoints", "checkpoints ask the registry, not the other way"),
    ("srm_max.runtime", "srm_max.models", "the runtime runs any architecture's graphs it is handed"),
    ("srm_max.runtime", "srm_max.serve", "the runtime knows nothing of scheduling"),
    ("srm_max.runtime", "srm_max.checkpoints", "the runtime is handed weights, it does not read files"),
    ("srm_max.reference", "srm_max.serve", "the ground truth depends on no engine"),
    ("srm_max.reference", "srm_max.runtime", "the ground truth depends on no engine"),
]


def wing_violations(graph: dict[str, set[str]], rules=FORBIDDEN_IMPORTS) -> list[str]:
    def inside(module: str, wing: str) -> bool:
        return module == wing or module.startswith(wing + ".")

    return sorted(f"{m} imports {t}: {why}" for m, targets in graph.items() for t in targets
                  for importer, imported, why in rules if inside(m, importer) and inside(t, imported))


@pytest.mark.parametrize("importer, imported, why", FORBIDDEN_IMPORTS)
def test_each_wing_rule_fails_on_a_synthetic_violation(importer, imported, why):
    graph = {f"{importer}.a": {f"{imported}.b"}, f"{importer}.c": {"srm_max.errors"}}
    assert wing_violations(graph) == [f"{importer}.a imports {imported}.b: {why}"]


def test_wings_import_only_what_they_may():
    assert wing_violations(import_graph()) == []


def test_the_srm_weight_names_are_written_once():
    """The SRM checkpoint's key names appear in its schema and nowhere else in the
    package (the weight adapter's patterns for the paper code's files aside)."""
    key = re.compile(r"channel_mixing_layer|token_mixing_layer|mixer_heads|proj_head|input_layer\.weight")
    allowed = {"srm_max.models.srm.schema", "srm_max.models.srm.weight_adapter", "srm_max.reference.srm",
               "srm_max.reference.mixer"}
    spelled = {name for name, path in modules().items() if key.search(path.read_text())}
    assert spelled <= allowed, spelled - allowed
    assert "srm_max.models.srm.schema" in spelled


@pytest.mark.parametrize("arch_dir", sorted(p.parent.name for p in (ROOT / "python/srm_max/models").glob("*/arch.py")))
def test_each_model_lists_its_files_and_they_exist(arch_dir):
    """models/<arch>/README.md names the model's files across the tree; each one named exists
    (paths are from the repository root, or from python/srm_max/ for the package's own)."""
    readme = ROOT / "python/srm_max/models" / arch_dir / "README.md"
    named = re.findall(r"`([\w./-]+\.(?:py|mojo|md))`", readme.read_text())
    assert len(named) >= 10
    missing = [p for p in named if not (ROOT / p).exists() and not (ROOT / "python/srm_max" / p).exists()
               and not (ROOT / "python/srm_max/models" / arch_dir / p).exists()]
    assert missing == []
