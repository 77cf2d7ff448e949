"""numpy wrappers around the Mojo ops, one op per call on the CPU: what the kernel tests
check against their naive forms (``srm_max.reference.mixer``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from srm_max.runtime.compile_cache import load_compiled
from srm_max.runtime.kernels import OP_DECODE_STEPS, OP_DECODE_STEP, OP_SCAN, OP_STEP_FUNCTIONAL, kernel_library

_session = None
_models: dict = {}


# --------------------------------------------------------------------------- #
# Graphs
# --------------------------------------------------------------------------- #


def _types(dev, *, scan: bool = False):
    from max.dtype import DType
    from max.graph import TensorType

    f32, i64 = DType.float32, DType.int64
    params = [
        TensorType(f32, ["H", "n"], dev),  # w
        TensorType(f32, ["H", "n"], dev),  # beta
        TensorType(f32, ["H"], dev),  # lam
    ]
    if scan:
        return [
            TensorType(f32, ["B", "T", "H", "hd"], dev),
            TensorType(i64, ["B"], dev),  # lengths
            TensorType(i64, ["B"], dev),  # start
            TensorType(f32, ["B", "H", "hd"], dev),  # init
            *params,
        ]
    return [
        TensorType(f32, ["B", "H", "hd"], dev),  # state
        TensorType(f32, ["B", "H", "hd"], dev),
        TensorType(i64, ["B"], dev),
        *params,
    ]


def build_step_graph(dev=None, *, library: Path | None = None):
    """Graph (state, u, positions, w, beta, lam) -> (y, new_state); all dims symbolic:
    one compiled model serves every B, H, hd, n."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    dev = dev or DeviceRef.CPU()
    lib = library or kernel_library()
    with Graph("srm_mixer_step_functional", input_types=_types(dev), custom_extensions=[lib]) as g:
        state, u, positions, w, beta, lam = (v.tensor for v in g.inputs)
        y_t = TensorType(DType.float32, u.shape, dev)
        y, new_state = ops.custom(OP_STEP_FUNCTIONAL, device=dev, values=[state, u, positions, w, beta, lam],
                                  out_types=[y_t, y_t])
        g.output(y.tensor, new_state.tensor)
    return g


def build_scan_graph(dev=None, *, library: Path | None = None):
    """Graph (u, lengths, start, init, w, beta, lam) -> (y, final_state); all dims symbolic."""
    from max.graph import DeviceRef, Graph

    dev = dev or DeviceRef.CPU()
    lib = library or kernel_library()
    with Graph("srm_mixer_scan", input_types=_types(dev, scan=True), custom_extensions=[lib]) as g:
        y, fin = scan_op(*(v.tensor for v in g.inputs), device=dev)
        g.output(y.tensor, fin.tensor)
    return g


def scan_op(u, lengths, start, init, w, beta, lam, *, device):
    """The scan op on a graph's values: (y [B, T, H, hd], final state [B, H, hd])."""
    from max.dtype import DType
    from max.graph import TensorType, ops

    f32 = DType.float32
    return ops.custom(OP_SCAN, device=device, values=[u, lengths, start, init, w, beta, lam],
                      out_types=[TensorType(f32, u.shape, device),
                                 TensorType(f32, [u.shape[0], u.shape[2], u.shape[3]], device)])


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
            g = build_step_graph()
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


def mixer_step(u, positions, w, beta, lam, state):
    """One decode step (``srm_mixer_step_functional``). Returns ``(y, new_state)`` as
    new float32 arrays. u, state [B, H, hd]; positions [B] (each in [0, n)); w, beta
    [H, n]; lam [H]."""
    u, state = _f32(u), _f32(state)
    positions, w, beta, lam = _i64(positions), _f32(w), _f32(beta), _f32(lam)
    if u.ndim != 3 or state.shape != u.shape or positions.shape != (u.shape[0],):
        raise ValueError(f"bad shapes: u {u.shape}, state {state.shape}, positions {positions.shape}")
    _check_params(w, beta, lam, u.shape[1])
    n = w.shape[1]
    if positions.size and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must lie in [0, {n}); got {positions.tolist()}")
    y, new_state = _model("step_functional").execute(state, u, positions, w, beta, lam)
    return y.to_numpy().copy(), new_state.to_numpy().copy()


def mixer_scan(u, lengths, w, beta, lam, start=None, init=None):
    """Prefill scan. Returns ``(y [B,T,H,hd], final_state [B,H,hd])``.

    ``final_state[b]`` is the state after token ``lengths[b]-1`` (``init[b]`` for
    length 0); tokens ``>= lengths[b]`` are padding. Requires ``T <= n``. Sample b
    starts at absolute position ``start[b]`` from state ``init[b]`` (default 0, zeros).
    """
    u, lengths = _f32(u), _i64(lengths)
    start = np.zeros(u.shape[0], np.int64) if start is None else _i64(start)
    init = np.zeros((u.shape[0], u.shape[2], u.shape[3]), np.float32) if init is None else _f32(init)
    w, beta, lam = _f32(w), _f32(beta), _f32(lam)
    if u.ndim != 4 or lengths.shape != (u.shape[0],):
        raise ValueError(f"bad shapes: u {u.shape}, lengths {lengths.shape}")
    _check_params(w, beta, lam, u.shape[2])
    if u.shape[1] > w.shape[1]:
        raise ValueError(f"sequence length {u.shape[1]} exceeds context n={w.shape[1]}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > u.shape[1]):
        raise ValueError(f"lengths must lie in [0, {u.shape[1]}]; got {lengths.tolist()}")
    y, fin = _model("scan").execute(u, lengths, start, init, w, beta, lam)
    return y.to_numpy().copy(), fin.to_numpy().copy()


# The whole-step decode op (mojo/decode_step.mojo), CPU only.
LAYER_PARAMS = ("cn_w", "cn_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b", "tn_w", "tn_b", "proj_w", "proj_b",
                "w", "beta", "lam", "out_w", "out_b")


def build_decode_step_graph(library: Path | None = None, greedy: bool = False):
    """Graph (ids, embedding, states, positions, *packing.INPUTS, eps, vocab) -> (logits,
    new_states): one ``srm_decode_step`` with float32 weights; every dim symbolic, CPU.
    ``vocab`` is any [V] array: it only names the logits' width. With ``greedy``:
    one ``srm_decode_steps``, further inputs steps [S], temperature / top_k / top_p /
    seed [B], mode [1] and scored [1] (0: no log-probabilities), and -> (tokens [B, S], new_states, last [B], next positions [B])."""
    from max.dtype import DType
    from max.graph import DeviceRef, Dim, Graph, TensorType, ops

    from srm_max.models.srm.packing import INPUTS

    dev, f32, i64 = DeviceRef.CPU(), DType.float32, DType.int64
    shapes = {"norms": ["L", 4, "d"], "fc1_b": ["L", "f"], "biases": ["L", 3, "d"], "w": ["L", "H", "n"],
              "beta": ["L", "H", "n"], "lam": ["L", "H"], "fc1": ["L", "P1"], "fc2": ["L", "P2"],
              "proj": ["L", "P3"], "out": ["L", "P3"], "head": ["P4"]}
    types = [TensorType(i64, ["B"], dev), TensorType(f32, ["E", "d"], dev),
             TensorType(f32, ["L", "B", "H", "hd"], dev),
             TensorType(i64, ["B"], dev), *(TensorType(f32, shapes[k], dev) for k in INPUTS),
             TensorType(f32, [1], dev), TensorType(f32, ["V"], dev)]
    if greedy:
        types += [TensorType(i64, ["S"], dev), TensorType(f32, ["B"], dev), TensorType(i64, ["B"], dev),
                  TensorType(f32, ["B"], dev), TensorType(DType.uint64, ["B"], dev), TensorType(i64, [1], dev),
                  TensorType(i64, [1], dev)]
    name = "srm_decode_steps_op" if greedy else "srm_decode_step_op"
    with Graph(name, input_types=types, custom_extensions=[library or kernel_library()]) as g:
        ids, embedding, states, positions, *rest = (v.tensor for v in g.inputs)
        choice = [rest.pop() for _ in range(7)][::-1] if greedy else []  # steps, sampling, scored
        vocab = rest.pop()
        activations = Dim("f") + 3 * Dim("d")
        if greedy:
            tokens, new_states, last, next_positions, *_ = ops.custom(
                OP_DECODE_STEPS, device=dev, values=[ids, embedding, states, positions, *rest, *choice],
                out_types=[TensorType(i64, ["B", "S"], dev), TensorType(f32, states.shape, dev),
                           TensorType(i64, ["B"], dev), TensorType(i64, ["B"], dev),
                           TensorType(f32, ["B", activations + vocab.shape[0]], dev),
                           TensorType(f32, ["B", "S"], dev), TensorType(f32, ["B", "S", 0], dev),
                           TensorType(i64, ["B", "S", 0], dev)])
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
    [V, d]. Lays them out with srm_max.models.srm.packing, as the engine does, and returns
    ``(logits [B, V], new_states [L, B, H, hd])``."""
    if "decode_step" not in _models:
        _models["decode_step"] = load_compiled(session(), build_decode_step_graph())
    out = _models["decode_step"].execute(
        *_decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps))
    return tuple(t.to_numpy().copy() for t in out)


def _decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps) -> list:
    """``build_decode_step_graph``'s inputs but the greedy op's steps, laid out as the engine does."""
    from srm_max.models.srm.packing import INPUTS, step_tensors

    inputs = step_tensors(layer_params, head_w)
    return [_i64(ids), _f32(embedding), _f32(states), _i64(positions), *(inputs[k] for k in INPUTS),
            np.array([eps], np.float32), np.zeros(len(head_w), np.float32)]


def decode_steps(ids, embedding, states, positions, layer_params: list[dict], head_w, eps: float,
                  steps: int, sampling=None):
    """``steps`` decode steps in one op, arguments as ``decode_step``; greedy, or drawn
    with ``sampling`` (a ``SamplingArrays``); -> ``(tokens [B, steps], new_states, last
    [B], next positions [B])``."""
    from srm_max.runtime.compiled import SamplingArrays

    if "decode_steps" not in _models:
        _models["decode_steps"] = load_compiled(session(), build_decode_step_graph(greedy=True))
    s = sampling or SamplingArrays.greedy(len(ids))
    out = _models["decode_steps"].execute(
        *_decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps),
        np.arange(steps, dtype=np.int64), s.temperature.astype(np.float32), s.top_k.astype(np.int64),
        s.top_p.astype(np.float32), s.seed.astype(np.uint64), np.array([s.mode()], np.int64),
        np.array([0], np.int64))  # no log-probabilities
    return tuple(t.to_numpy().copy() for t in out)


