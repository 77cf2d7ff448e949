"""The Mojo custom ops (``mojo/``, one op per file): where their sources are and the
kernel library they are precompiled into.

The Mojo sources live in ``mojo/`` at the repository root and ship as the data
package ``srm_max.mojo``. The ops' names are written once in ``graphs/op_names.py``;
what each does, its inputs and who calls it: each ``.mojo`` file's docstring and
docs/kernels.md. Every graph using them needs ``Graph(..., custom_extensions=[kernel_library()])``.
``kernel_library()`` precompiles the sources once into the user cache, so building
a graph runs no ``mojo precompile`` of its own (MAX would otherwise compile the package
for every ``Graph``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..graphs.op_names import OP_DECODE_STEP, OP_DECODE_STEPS, OP_SCAN, OP_STEP_FUNCTIONAL
from .compile_cache import cache_dir

# the op names are graphs/op_names.py's; these are imported from here by the GPU compile check and the tests
__all__ = ["OP_DECODE_STEPS", "OP_DECODE_STEP", "OP_SCAN", "OP_STEP_FUNCTIONAL", "kernel_library",
           "mojo_source_dir"]

_lock = threading.Lock()
_library: Path | None = None


# --------------------------------------------------------------------------- #
# Locating and precompiling the Mojo sources
# --------------------------------------------------------------------------- #


def _is_source_dir(p: Path) -> bool:
    return (p / "__init__.mojo").is_file()


def mojo_source_dir() -> Path:
    """The directory holding the kernels' ``__init__.mojo``.

    Order: ``$SRM_MAX_MOJO_DIR``; the ``srm_max.mojo`` package (an installed
    wheel puts it at ``site-packages/srm_max/mojo``); the repository layout of a
    source checkout / editable install (``<repo>/python/srm_max`` ->
    ``<repo>/mojo``; setuptools' editable finder does not expose the data-only
    ``srm_max.mojo`` package, so it is found by path).
    """
    candidates: list[Path] = []
    env = os.environ.get("SRM_MAX_MOJO_DIR")
    if env:
        candidates.append(Path(env))
    try:
        spec = importlib.util.find_spec("srm_max.mojo")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(p) for p in spec.submodule_search_locations)
    package = Path(__file__).resolve().parent.parent  # srm_max/
    candidates += [package / "mojo", package.parent.parent / "mojo"]
    for c in candidates:
        if _is_source_dir(c):
            return c
    raise FileNotFoundError(
        "srm_max Mojo kernel sources not found; looked in "
        + ", ".join(str(c) for c in candidates)
    )


def _sources_digest(src: Path) -> str:
    from max import engine

    h = hashlib.sha256(engine.__version__.encode())
    for f in sorted(src.rglob("*.mojo")):
        h.update(f.relative_to(src).as_posix().encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run_mojo(args: list[str]) -> subprocess.CompletedProcess:
    """Runs the ``mojo`` command line shipped with max (else one beside this Python or
    on PATH) with ``args``, capturing its output as text."""
    try:
        from mojo.run import subprocess_run_mojo  # the mojo shipped with max
    except ImportError:  # pragma: no cover - fall back to a mojo on PATH
        exe = Path(sys.executable).parent / "mojo"
        exe_s = str(exe) if exe.exists() else shutil.which("mojo")
        if exe_s is None:
            raise RuntimeError("cannot find the `mojo` executable")
        return subprocess.run([exe_s, *args], capture_output=True, text=True)
    return subprocess_run_mojo(args, capture_output=True, text=True)


def _run_mojo_precompile(src: Path, out: Path) -> None:
    proc = run_mojo(["precompile", str(src), "-o", str(out)])
    if proc.returncode != 0:
        raise RuntimeError(
            f"mojo precompile {src} failed (exit {proc.returncode}):\n"
            f"{proc.stdout}\n{proc.stderr}"
        )


def kernel_library(src: Path | None = None) -> Path:
    """Path of the precompiled kernel package (``.mojoc``), building it on a miss.

    Cached as ``cache_dir()/kernels/kernels_<hash>.mojoc``, keyed on the MAX
    version and the bytes of every ``.mojo`` source, so an edited kernel gets a
    new file (and therefore new ``.mef`` cache keys). Written atomically: the
    compiler bakes the module name from the output file's stem, so it is built
    under its final name in a private staging directory and then renamed.
    """
    global _library
    if src is None and _library is not None and _library.exists():
        return _library
    with _lock:
        source = src or mojo_source_dir()
        directory = cache_dir() / "kernels"
        out = directory / f"kernels_{_sources_digest(source)}.mojoc"
        if not out.exists():
            directory.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=directory, prefix=".staging-"))
            try:
                tmp = staging / out.name
                _run_mojo_precompile(source, tmp)
                os.replace(tmp, out)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        if src is None:
            _library = out
        return out
