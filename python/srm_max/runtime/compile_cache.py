"""Compiled-model cache: each distinct MAX graph is compiled once, ever.

A cold MAX compile takes minutes on a small CPU, and MAX's own cache still
costs seconds per graph (and sometimes misses). So compiled models are
exported as ``.mef`` files keyed on everything that changes the code:
the MAX version, the CPU the code is compiled for (``cpu_target``), the
graph's MLIR text (shapes, dtypes, device, constants, custom-op names) and
every kernel library it uses. Loading a ``.mef`` takes milliseconds; weights
are bound at load time, so one file serves every checkpoint of the same shape.

The key does not depend on where the files are (the cache directory, a source
checkout or an installed wheel), so a graph compiled on one machine for a named
CPU target has the same key on every other: that is how the package's shipped
graphs (``shipped_graphs``) are found.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from max import engine
from max.engine import InferenceSession, Model
from max.graph import Graph, Module

from ..files import atomic_file
from . import cpu_target

log = logging.getLogger(__name__)

# where MAX keeps its own caches, a compiled-model cache among them
MAX_CACHE_ENV = "MODULAR_CACHE_DIR"

# before anything compiles: SRM_MAX_CPU_TARGET (a virtual CPU target) holds for every graph
cpu_target.apply_requested()


def cache_dir() -> Path:
    """``$SRM_MAX_CACHE`` or ``~/.cache/srm-max``."""
    root = os.environ.get("SRM_MAX_CACHE") or Path.home() / ".cache" / "srm-max"
    return Path(root)


def _library_identity(lib: Path) -> bytes:
    """What identifies a kernel library on every machine.

    Our Mojo packages (``kernels.kernel_library``) are named after a digest of
    the MAX version and every ``.mojo`` source; their bytes also record where
    the sources were, so they differ between a checkout and an installed wheel
    while the compiled code does not. Their name identifies them; any other
    library, its bytes."""
    if re.fullmatch(r"kernels_[0-9a-f]{16}\.mojoc", lib.name):
        return lib.name.encode()
    return lib.read_bytes()


_COUNTER = re.compile(r" \{counter = \d+ : i64\}$", re.MULTILINE)


def graph_key(graph: Graph, graph_salt: bytes = b"", target: str | None = None) -> str:
    """The cache key of ``graph`` compiled for the CPU ``target`` (default: what
    this process compiles for, ``cpu_target.current()``)."""
    digest = hashlib.sha256(engine.__version__.encode())
    digest.update((target or cpu_target.current()).encode())
    libs = sorted(str(p) for p in graph.kernel_libraries_paths)
    # MAX stamps a graph with a counter of the IR it has made in this process (``{counter
    # = N}``), which changes with what else the process built or compiled, not the code
    text = _COUNTER.sub("", str(graph))
    for lib in libs:  # the MLIR names each library by its path, which is this machine's
        text = text.replace(lib, Path(lib).name)
    digest.update(text.encode())
    for lib in libs:
        digest.update(_library_identity(Path(lib)))
    digest.update(graph_salt)
    return digest.hexdigest()[:24]


def mef_path(graph: Graph, graph_salt: bytes = b"", target: str | None = None) -> Path:
    """Where the compiled ``graph`` is (or would be) cached, compiled for the CPU ``target``
    (default: what this process compiles for)."""
    return cache_dir() / "mef" / f"{graph.name}-{graph_key(graph, graph_salt, target)}.mef"


def graph_name(mef: Path) -> str:
    """The name of the graph whose cache path is ``mef`` (``mef_path``)."""
    return mef.stem.rsplit("-", 1)[0]


def compile_to_cache(session: InferenceSession, builders: Sequence[tuple[Callable[[], Graph], bytes]],
                     fresh: bool = False):
    """Build the graphs (``builders``: a function and the salt of its cache key each),
    compile them as one unit and export it to each graph's ``.mef`` path (atomically;
    the paths are links to one file); -> the compiled unit. ``fresh``: beside MAX's own
    caches (``load_unit`` says why), in an empty directory of their own.

    MAX compiles the kernels of a unit together, and a compile pays a fixed cost of
    its own (its JIT session) besides its kernels, while graphs of one model share
    many kernels (a prefill and a decode run the same matmuls): so graphs compile in
    less time as one unit than apart (docs/testing.md). A unit is loaded with one
    weights registry (``load_unit``), so the graphs in it that bind weights must
    be one engine's."""
    graphs, paths = [], []
    for build, graph_salt in builders:
        # the key is taken at once: MAX's text of a graph can change when the next graph is
        # built (a counter it keeps), and every process takes it right after the build
        graphs.append(build())
        paths.append(mef_path(graphs[-1], graph_salt))
    if len(graphs) == 1:
        compile_it = functools.partial(session.compile, graphs[0])
    else:
        libraries = sorted({str(lib) for graph in graphs for lib in graph.kernel_libraries_paths})
        compile_it = functools.partial(session.compile, _one_module(graphs), custom_extensions=libraries)
    with _fresh_max_cache() if fresh else contextlib.nullcontext():
        compiled = compile_it()
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(paths[0]) as first:  # concurrent processes never see half a file
        compiled.export_mef(str(first))
        # the other paths link to this export itself, not to paths[0] once it is in place,
        # which another process may replace meanwhile with a unit that lacks their graphs
        for path in paths[1:]:
            with atomic_file(path) as tmp:
                try:
                    os.link(first, tmp)
                except OSError:  # a file system without hard links
                    shutil.copyfile(first, tmp)
    return compiled


@contextlib.contextmanager
def _fresh_max_cache():
    """MAX's own caches (``MODULAR_CACHE_DIR``) in an empty temporary directory meanwhile.
    The setting is the process's: a compile in another thread meanwhile uses that directory
    too (slower, never wrong), which this rare rebuild accepts."""
    before = os.environ.get(MAX_CACHE_ENV)
    with tempfile.TemporaryDirectory(prefix="srm-max-fresh-") as folder:
        os.environ[MAX_CACHE_ENV] = folder
        try:
            yield
        finally:
            if before is None:
                del os.environ[MAX_CACHE_ENV]
            else:
                os.environ[MAX_CACHE_ENV] = before


def _one_module(graphs: list[Graph]) -> Module:
    """The graphs moved into the first one's module (each is then unusable on its own)."""
    names = [graph.name for graph in graphs]
    if len(set(names)) != len(names):
        raise ValueError(f"graphs compiled as one unit need distinct names, got {names}")
    module = graphs[0].module
    last = list(module.mlir_module.body)[-1]
    for graph in graphs[1:]:
        (op,) = list(graph.module.mlir_module.body)
        op.move_after(last)
        last = op
    return module


def load_compiled(
    session: InferenceSession,
    graph: Graph | Callable[[], Graph],
    weights_registry: Mapping | None = None,
    graph_salt: bytes = b"",
    mef: Path | None = None,
) -> Model:
    """Load ``graph`` from the ``.mef`` cache, compiling and exporting it on a miss.

    ``graph`` may be a function that builds it; with ``mef``, its cache path when
    already known, a hit loads without building the graph at all."""
    if mef is None:
        graph = graph if isinstance(graph, Graph) else graph()
        mef = mef_path(graph, graph_salt)
    return load_unit(session, graph, weights_registry, graph_salt, mef)[graph_name(mef)]


def load_unit(
    session: InferenceSession,
    graph: Graph | Callable[[], Graph],
    weights_registry: Mapping | None,
    graph_salt: bytes,
    mef: Path,
) -> dict[str, Model]:
    """Every graph of the cached file ``mef`` (``graph``'s cache path), initialized with
    ``weights_registry``, by name: a file holds the graphs compiled with ``graph`` as one
    unit (``compile_to_cache``), which a caller may keep for their own later use. On a
    miss, or a file that does not hold ``graph`` (damaged, or written under this key by
    another version), ``graph`` is compiled and exported first."""
    name = graph_name(mef)
    if mef.exists():
        try:
            models = session.init_all(engine.read(mef), weights_registry=weights_registry)
        except Exception:  # a damaged cache entry, or one whose graphs bind other weights
            models = {}
        if name in models:
            return models
        log.warning("the cached %s does not hold its graph (damaged or stale): compiling it again", mef)
        mef.unlink(missing_ok=True)
    build = (lambda: graph) if isinstance(graph, Graph) else graph
    for fresh in (False, True):
        # MAX's own compile cache answers a compile with an earlier one of the same code,
        # under that one's graph names (which a graph of another name, in an earlier version
        # or another unit, may have had): then compile beside it
        models = session.init_all(compile_to_cache(session, [(build, graph_salt)], fresh),
                                  weights_registry=weights_registry)
        if name in models:
            break
    return models
