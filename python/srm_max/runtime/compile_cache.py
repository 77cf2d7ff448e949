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

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from max import engine
from max.engine import InferenceSession, Model
from max.graph import Graph

from ..files import atomic_file
from . import cpu_target

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


def graph_key(graph: Graph, graph_salt: bytes = b"", target: str | None = None) -> str:
    """The cache key of ``graph`` compiled for the CPU ``target`` (default: what
    this process compiles for, ``cpu_target.current()``)."""
    digest = hashlib.sha256(engine.__version__.encode())
    digest.update((target or cpu_target.current()).encode())
    libs = sorted(str(p) for p in graph.kernel_libraries_paths)
    text = str(graph)
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


def compile_to_cache(session: InferenceSession, graph: Graph, graph_salt: bytes = b""):
    """Compile ``graph`` and export it to its ``.mef`` path (atomically); -> the compiled model."""
    mef = mef_path(graph, graph_salt)
    compiled = session.compile(graph)
    mef.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(mef) as tmp:  # concurrent processes never see half a file
        compiled.export_mef(str(tmp))
    return compiled


def load_compiled(
    session: InferenceSession,
    graph: Graph | Callable[[], Graph],
    weights_registry: Mapping | None = None,
    graph_salt: bytes = b"",
    mef: Path | None = None,
) -> Model:
    """Load ``graph`` from the ``.mef`` cache, compiling and exporting it on a miss.

    ``graph`` may be a function that builds it; with ``mef``, its cache path when
    already known, a hit loads without building the graph at all.
    """
    if mef is None:
        graph = graph if isinstance(graph, Graph) else graph()
        mef = mef_path(graph, graph_salt)
    compiled = None
    if mef.exists():
        try:
            compiled = engine.read(mef)
        except Exception:  # a stale or damaged cache entry: rebuild it
            mef.unlink(missing_ok=True)
    if compiled is None:
        compiled = compile_to_cache(session, graph if isinstance(graph, Graph) else graph(), graph_salt)
    return session.init(compiled, weights_registry=weights_registry)
