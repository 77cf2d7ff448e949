"""The SRM token-mixer Mojo custom ops: library location, precompilation, wrappers.

The Mojo sources live in ``mojo/`` at the repository root and ship as the data
package ``srm_max.mojo``. Three mixer ops are registered, plus the whole decode
step of ``decode_step.mojo`` (``srm_decode_step``: every layer and the logits
in one op; ``srm_decode_greedy``: S greedy steps in one op; CPU only, used by
graphs/decode.py), see the ``.mojo`` files for
the exact semantics; all tensors are float32 except positions/lengths (int64).
Heads ``0 .. H/2-1`` are column-repeat, ``H/2 .. H-1`` row-repeat; ``lam`` is the
per-head decay already computed by the caller (``clip(decay,0.9,1)**(1/c)``).

``srm_mixer_step`` (decode, state updated IN PLACE; ``state`` must be a BufferValue)::

    (y,) = ops.inplace_custom(
        "srm_mixer_step", device=dev,
        values=[state_buf, u, positions, w, beta, lam],
        out_types=[TensorType(DType.float32, u.shape, dev)])
    # state_buf [B,H,hd] f32 (BufferValue), u [B,H,hd] f32, positions [B] i64,
    # w, beta [H,n] f32, lam [H] f32  ->  y [B,H,hd]

``srm_mixer_step_functional`` (decode, state in -> new state out)::

    y, new_state = ops.custom(
        "srm_mixer_step_functional", device=dev,
        values=[state, u, positions, w, beta, lam],
        out_types=[TensorType(DType.float32, u.shape, dev)] * 2)

``srm_mixer_scan`` (prefill; y for all T positions, state after ``lengths[b]-1``)::

    y, final_state = ops.custom(
        "srm_mixer_scan", device=dev,
        values=[u, lengths, w, beta, lam],          # u [B,T,H,hd], lengths [B] i64
        out_types=[TensorType(DType.float32, u.shape, dev),                  # [B,T,H,hd]
                   TensorType(DType.float32, [u.shape[0], u.shape[2], u.shape[3]], dev)])

Every graph using them needs ``Graph(..., custom_extensions=[kernel_library()])``.
``kernel_library()`` precompiles the sources once into the user cache, so building
a graph costs no ``mojo precompile`` (MAX would otherwise spend ~4 s per Graph).
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

import numpy as np

from .compile_cache import cache_dir, load_compiled

__all__ = [
    "OP_STEP",
    "OP_STEP_FUNCTIONAL",
    "OP_SCAN",
    "OP_DECODE_STEP",
    "OP_DECODE_GREEDY",
    "mojo_source_dir",
    "kernel_library",
    "session",
    "mixer_step",
    "mixer_scan",
    "build_step_graph",
    "build_scan_graph",
    "build_decode_step_graph",
    "decode_step",
    "decode_greedy",
    "compile_for_virtual_gpu",
]

OP_STEP = "srm_mixer_step"
OP_STEP_FUNCTIONAL = "srm_mixer_step_functional"
OP_SCAN = "srm_mixer_scan"
OP_DECODE_STEP = "srm_decode_step"
OP_DECODE_GREEDY = "srm_decode_greedy"

_lock = threading.Lock()
_library: Path | None = None
_session = None
_models: dict[str, object] = {}


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
    here = Path(__file__).resolve().parent
    candidates += [here / "mojo", here.parent.parent / "mojo"]
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


def _run_mojo_precompile(src: Path, out: Path) -> None:
    args = ["precompile", str(src), "-o", str(out)]
    try:
        from mojo.run import subprocess_run_mojo  # the mojo shipped with max
    except ImportError:  # pragma: no cover - fall back to a mojo on PATH
        exe = Path(sys.executable).parent / "mojo"
        exe_s = str(exe) if exe.exists() else shutil.which("mojo")
        if exe_s is None:
            raise RuntimeError("cannot find the `mojo` executable to precompile kernels")
        proc = subprocess.run([exe_s, *args], capture_output=True, text=True)
    else:
        proc = subprocess_run_mojo(args, capture_output=True, text=True)
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


# --------------------------------------------------------------------------- #
# Graphs
# --------------------------------------------------------------------------- #


def _types(dev, *, inplace: bool | None = None, scan: bool = False):
    from max.dtype import DType
    from max.graph import BufferType, TensorType

    f32, i64 = DType.float32, DType.int64
    params = [
        TensorType(f32, ["H", "n"], dev),  # w
        TensorType(f32, ["H", "n"], dev),  # beta
        TensorType(f32, ["H"], dev),  # lam
    ]
    if scan:
        return [
            TensorType(f32, ["B", "T", "H", "hd"], dev),
            TensorType(i64, ["B"], dev),
            *params,
        ]
    state_t = (BufferType if inplace else TensorType)(f32, ["B", "H", "hd"], dev)
    return [
        state_t,
        TensorType(f32, ["B", "H", "hd"], dev),
        TensorType(i64, ["B"], dev),
        *params,
    ]


def build_step_graph(dev=None, *, inplace: bool = True, library: Path | None = None):
    """Graph (state, u, positions, w, beta, lam) -> y (in place) or (y, new_state).

    All dims symbolic: one compiled model serves every B, H, hd, n.
    """
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    dev = dev or DeviceRef.CPU()
    lib = library or kernel_library()
    name = "srm_mixer_step_inplace" if inplace else "srm_mixer_step_functional"
    with Graph(name, input_types=_types(dev, inplace=inplace), custom_extensions=[lib]) as g:
        state = g.inputs[0].buffer if inplace else g.inputs[0].tensor
        u, positions, w, beta, lam = (v.tensor for v in g.inputs[1:])
        y_t = TensorType(DType.float32, u.shape, dev)
        if inplace:
            (y,) = ops.inplace_custom(
                OP_STEP, device=dev, values=[state, u, positions, w, beta, lam], out_types=[y_t]
            )
            g.output(y.tensor)
        else:
            y, new_state = ops.custom(
                OP_STEP_FUNCTIONAL,
                device=dev,
                values=[state, u, positions, w, beta, lam],
                out_types=[y_t, y_t],
            )
            g.output(y.tensor, new_state.tensor)
    return g


def build_scan_graph(dev=None, *, library: Path | None = None):
    """Graph (u, lengths, w, beta, lam) -> (y, final_state); all dims symbolic."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    dev = dev or DeviceRef.CPU()
    lib = library or kernel_library()
    with Graph("srm_mixer_scan", input_types=_types(dev, scan=True), custom_extensions=[lib]) as g:
        u, lengths, w, beta, lam = (v.tensor for v in g.inputs)
        f32 = DType.float32
        y, fin = ops.custom(
            OP_SCAN,
            device=dev,
            values=[u, lengths, w, beta, lam],
            out_types=[
                TensorType(f32, u.shape, dev),
                TensorType(f32, [u.shape[0], u.shape[2], u.shape[3]], dev),
            ],
        )
        g.output(y.tensor, fin.tensor)
    return g


def session():
    """The process-wide CPU InferenceSession used by the wrappers below.

    (``InferenceSession(num_threads=...)`` aborts in MAX 26.7: never pass it.)
    """
    global _session
    if _session is None:
        from max.driver import CPU
        from max.engine import InferenceSession

        _session = InferenceSession(devices=[CPU()])
    return _session


def _model(kind: str):
    m = _models.get(kind)
    if m is None:
        if kind == "scan":
            g = build_scan_graph()
        else:
            g = build_step_graph(inplace=(kind == "step_inplace"))
        m = load_compiled(session(), g)
        _models[kind] = m
    return m


# --------------------------------------------------------------------------- #
# numpy wrappers (CPU; for tests and reference checks)
# --------------------------------------------------------------------------- #


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _check_params(w, beta, lam, H: int) -> None:
    if w.ndim != 2 or w.shape != beta.shape or w.shape[0] != H or lam.shape != (H,):
        raise ValueError(
            f"expected w, beta [H, n] and lam [H] with H={H}; "
            f"got w {w.shape}, beta {beta.shape}, lam {lam.shape}"
        )


def mixer_step(u, positions, w, beta, lam, state, *, inplace: bool = True):
    """One decode step. Returns ``(y, new_state)`` as new float32 arrays.

    u, state [B, H, hd]; positions [B] (each in [0, n)); w, beta [H, n]; lam [H].
    ``inplace=True`` runs ``srm_mixer_step`` on a copy of ``state`` (the op
    mutates its buffer); ``inplace=False`` runs ``srm_mixer_step_functional``.
    The caller's ``state`` is never modified.
    """
    from max.driver import Buffer

    u, state = _f32(u), _f32(state)
    positions, w, beta, lam = _i64(positions), _f32(w), _f32(beta), _f32(lam)
    if u.ndim != 3 or state.shape != u.shape or positions.shape != (u.shape[0],):
        raise ValueError(f"bad shapes: u {u.shape}, state {state.shape}, positions {positions.shape}")
    _check_params(w, beta, lam, u.shape[1])
    n = w.shape[1]
    if positions.size and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must lie in [0, {n}); got {positions.tolist()}")
    if inplace:
        new_state = state.copy()
        buf = Buffer.from_numpy(new_state)  # shares memory with new_state
        (y,) = _model("step_inplace").execute(buf, u, positions, w, beta, lam)
        return y.to_numpy().copy(), buf.to_numpy().copy()
    y, new_state = _model("step_functional").execute(state, u, positions, w, beta, lam)
    return y.to_numpy().copy(), new_state.to_numpy().copy()


def mixer_scan(u, lengths, w, beta, lam):
    """Prefill scan. Returns ``(y [B,T,H,hd], final_state [B,H,hd])``.

    ``final_state[b]`` is the state after position ``lengths[b]-1`` (zero for
    length 0); positions ``>= lengths[b]`` are padding. Requires ``T <= n``.
    """
    u, lengths = _f32(u), _i64(lengths)
    w, beta, lam = _f32(w), _f32(beta), _f32(lam)
    if u.ndim != 4 or lengths.shape != (u.shape[0],):
        raise ValueError(f"bad shapes: u {u.shape}, lengths {lengths.shape}")
    _check_params(w, beta, lam, u.shape[2])
    if u.shape[1] > w.shape[1]:
        raise ValueError(f"sequence length {u.shape[1]} exceeds context n={w.shape[1]}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > u.shape[1]):
        raise ValueError(f"lengths must lie in [0, {u.shape[1]}]; got {lengths.tolist()}")
    y, fin = _model("scan").execute(u, lengths, w, beta, lam)
    return y.to_numpy().copy(), fin.to_numpy().copy()


# The whole-step decode op (mojo/decode_step.mojo), CPU only.
LAYER_PARAMS = ("cn_w", "cn_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b", "tn_w", "tn_b", "proj_w", "proj_b",
                "w", "beta", "lam", "out_w", "out_b")


def build_decode_step_graph(library: Path | None = None, greedy: bool = False):
    """Graph (ids, embedding, states, positions, *packing.INPUTS, eps, vocab) -> (logits,
    new_states): one ``srm_decode_step`` with float32 weights; every dim symbolic, CPU.
    ``vocab`` is any [V] array: it only names the logits' width. With ``greedy``:
    one ``srm_decode_greedy``, a last input steps [S], and -> (tokens [B, S],
    new_states, last [B], next positions [B])."""
    from max.dtype import DType
    from max.graph import DeviceRef, Dim, Graph, TensorType, ops

    from .packing import INPUTS

    dev, f32, i64 = DeviceRef.CPU(), DType.float32, DType.int64
    shapes = {"norms": ["L", 4, "d"], "fc1_b": ["L", "f"], "biases": ["L", 3, "d"], "w": ["L", "H", "n"],
              "beta": ["L", "H", "n"], "lam": ["L", "H"], "fc1": ["L", "P1"], "fc2": ["L", "P2"],
              "proj": ["L", "P3"], "out": ["L", "P3"], "head": ["P4"]}
    types = [TensorType(i64, ["B"], dev), TensorType(f32, ["E", "d"], dev),
             TensorType(f32, ["L", "B", "H", "hd"], dev),
             TensorType(i64, ["B"], dev), *(TensorType(f32, shapes[k], dev) for k in INPUTS),
             TensorType(f32, [1], dev), TensorType(f32, ["V"], dev)]
    if greedy:
        types.append(TensorType(i64, ["S"], dev))
    name = "srm_decode_greedy_op" if greedy else "srm_decode_step_op"
    with Graph(name, input_types=types, custom_extensions=[library or kernel_library()]) as g:
        ids, embedding, states, positions, *rest = (v.tensor for v in g.inputs)
        steps = rest.pop() if greedy else None
        vocab = rest.pop()
        activations = Dim("f") + 3 * Dim("d")
        if greedy:
            tokens, new_states, last, next_positions, _ = ops.custom(
                OP_DECODE_GREEDY, device=dev, values=[ids, embedding, states, positions, *rest, steps],
                out_types=[TensorType(i64, ["B", "S"], dev), TensorType(f32, states.shape, dev),
                           TensorType(i64, ["B"], dev), TensorType(i64, ["B"], dev),
                           TensorType(f32, ["B", activations + vocab.shape[0]], dev)])
            g.output(tokens.tensor, new_states.tensor, last.tensor, next_positions.tensor)
        else:
            logits, new_states, _, _ = ops.custom(
                OP_DECODE_STEP, device=dev, values=[ids, embedding, states, positions, *rest],
                out_types=[TensorType(f32, ["B", vocab.shape[0]], dev), TensorType(f32, states.shape, dev),
                           TensorType(f32, ["B", activations], dev), TensorType(i64, ["B"], dev)])
            g.output(logits.tensor, new_states.tensor)
    return g


def decode_step(ids, embedding, states, positions, layer_params: list[dict], head_w, eps: float):
    """One whole decode step: ids [B] (rows of embedding [E, d]), states [L, B, H, hd]
    (positions past n are clamped to n - 1), one dict of
    LAYER_PARAMS arrays per layer (w, beta [H, n], lam [H] the decay per step), head_w
    [V, d]. Lays them out with srm_max/packing.py, as the engine does, and returns
    ``(logits [B, V], new_states [L, B, H, hd])``."""
    if "decode_step" not in _models:
        _models["decode_step"] = load_compiled(session(), build_decode_step_graph())
    out = _models["decode_step"].execute(
        *_decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps))
    return tuple(t.to_numpy().copy() for t in out)


def _decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps) -> list:
    """``build_decode_step_graph``'s inputs but the greedy op's steps, laid out as the engine does."""
    from .packing import INPUTS, step_tensors

    inputs = step_tensors(layer_params, head_w)
    return [_i64(ids), _f32(embedding), _f32(states), _i64(positions), *(inputs[k] for k in INPUTS),
            np.array([eps], np.float32), np.zeros(len(head_w), np.float32)]


def decode_greedy(ids, embedding, states, positions, layer_params: list[dict], head_w, eps: float,
                  steps: int):
    """``steps`` greedy decode steps in one op, arguments as ``decode_step``; ->
    ``(tokens [B, steps], new_states, last [B], next positions [B])``."""
    if "decode_greedy" not in _models:
        _models["decode_greedy"] = load_compiled(session(), build_decode_step_graph(greedy=True))
    out = _models["decode_greedy"].execute(
        *_decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps),
        np.arange(steps, dtype=np.int64))
    return tuple(t.to_numpy().copy() for t in out)


# --------------------------------------------------------------------------- #
# GPU compile check without a GPU (MAX "virtual device" mode)
# --------------------------------------------------------------------------- #


def compile_for_virtual_gpu(arch: str = "sm_90a", mef_out: Path | None = None) -> float:
    """Compile all three ops' GPU paths for ``arch`` without a GPU; returns seconds.

    Must run in a fresh process: virtual device mode has to be set before any
    device (including the CPU session above) is created. Raises RuntimeError
    with the compiler's message if the GPU code does not build. The compiled
    model is kept as ``cache_dir()/mef/srm_mixer_ops_gpu-<arch>-<kernels>.mef``
    (or ``mef_out``); if that file exists nothing is recompiled (returns 0.0).
    The ``.mef`` holds SM binaries for ``arch`` and cannot be loaded on a CPU.
    Run as ``python -m srm_max.kernels --virtual-gpu sm_90a``.
    """
    import time

    from max import engine

    lib = kernel_library()
    if mef_out is None:
        tag = hashlib.sha256(f"{engine.__version__}|{arch}|{lib.name}".encode()).hexdigest()[:16]
        mef_out = cache_dir() / "mef" / f"srm_mixer_ops_gpu-{arch}-{tag}.mef"
    if mef_out.exists():
        return 0.0

    from max import driver

    driver.set_virtual_device_api("cuda")
    driver.set_virtual_device_target_arch(arch)
    driver.set_virtual_device_count(1)
    from max.driver import Accelerator
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

    acc, gpu = Accelerator(), DeviceRef.GPU()
    f32, i64 = DType.float32, DType.int64
    types = [
        BufferType(f32, ["B", "H", "hd"], gpu),  # state (in place)
        TensorType(f32, ["B", "H", "hd"], gpu),  # state (functional)
        TensorType(f32, ["B", "H", "hd"], gpu),  # u
        TensorType(i64, ["B"], gpu),  # positions
        TensorType(f32, ["B2", "T", "H", "hd"], gpu),  # u (scan)
        TensorType(i64, ["B2"], gpu),  # lengths
        TensorType(f32, ["H", "n"], gpu),
        TensorType(f32, ["H", "n"], gpu),
        TensorType(f32, ["H"], gpu),
    ]
    with Graph("srm_mixer_ops_gpu", input_types=types, custom_extensions=[lib]) as g:
        sbuf = g.inputs[0].buffer
        s, u, pos, us, lens, w, beta, lam = (v.tensor for v in g.inputs[1:])
        yt = TensorType(f32, u.shape, gpu)
        (y1,) = ops.inplace_custom(OP_STEP, device=gpu, values=[sbuf, u, pos, w, beta, lam], out_types=[yt])
        y2, ns = ops.custom(OP_STEP_FUNCTIONAL, device=gpu, values=[s, u, pos, w, beta, lam], out_types=[yt, yt])
        y3, fin = ops.custom(
            OP_SCAN,
            device=gpu,
            values=[us, lens, w, beta, lam],
            out_types=[
                TensorType(f32, us.shape, gpu),
                TensorType(f32, [us.shape[0], us.shape[2], us.shape[3]], gpu),
            ],
        )
        g.output(y1.tensor, y2.tensor, ns.tensor, y3.tensor, fin.tensor)
    t0 = time.perf_counter()
    try:
        compiled = InferenceSession(devices=[acc]).compile(g)
    except Exception as e:  # the compiler's message is in __cause__
        raise RuntimeError(f"GPU compile for {arch} failed: {e}\ncause: {e.__cause__}") from None
    seconds = time.perf_counter() - t0
    mef_out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=mef_out.parent, suffix=".mef.tmp")
    os.close(fd)
    try:
        compiled.export_mef(tmp)
        os.replace(tmp, mef_out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return seconds


if __name__ == "__main__":  # pragma: no cover - used by the virtual-GPU test
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--virtual-gpu", default="sm_90a", metavar="ARCH")
    ap.add_argument("--mef-out", type=Path, default=None)
    a = ap.parse_args()
    try:
        secs = compile_for_virtual_gpu(a.virtual_gpu, a.mef_out)
    except Exception as e:
        print(f"FAILED: {e}", flush=True)
        os._exit(1)  # sys.exit after a failed compile can abort (exit 134)
    print(f"OK {a.virtual_gpu} {secs:.1f}s", flush=True)
    os._exit(0)
