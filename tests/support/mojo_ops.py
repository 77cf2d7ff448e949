"""numpy wrappers around the Mojo ops, one op per call on the CPU through the op's own
graph (tests/support/op_graphs.py): what the kernel tests check against their naive forms
(``srm_max.reference.mixer``)."""

from __future__ import annotations

import numpy as np

from srm_max.graphs.op_names import OP_DECODE_STEP, OP_DECODE_STEPS, OP_SCAN, OP_STEP_FUNCTIONAL
from tests.support.op_graphs import model


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
    y, new_state = model(OP_STEP_FUNCTIONAL).execute(state, u, positions, w, beta, lam)
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
    if lengths.size and (lengths.min() < 0 or lengths.max() > u.shape[1]):
        raise ValueError(f"lengths must lie in [0, {u.shape[1]}]; got {lengths.tolist()}")
    y, fin = model(OP_SCAN).execute(u, lengths, start, init, w, beta, lam)
    return y.to_numpy().copy(), fin.to_numpy().copy()


# The whole-step decode op (mojo/decode_step.mojo), CPU only.
LAYER_PARAMS = ("cn_w", "cn_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b", "tn_w", "tn_b", "proj_w", "proj_b",
                "w", "beta", "lam", "out_w", "out_b")


def decode_step(ids, embedding, states, positions, layer_params: list[dict], head_w, eps: float):
    """One whole decode step: ids [B] (rows of embedding [E, d]), states [L, B, H, hd]
    (positions past n are clamped to n - 1), one dict of
    LAYER_PARAMS arrays per layer (w, beta [H, n], lam [H] the decay per step), head_w
    [V, d]. Lays them out with srm_max.models.srm.packing, as the engine does, and returns
    ``(logits [B, V], new_states [L, B, H, hd])``."""
    out = model(OP_DECODE_STEP).execute(
        *_decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps))
    return tuple(t.to_numpy().copy() for t in out)


def _decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps) -> list:
    """The decode op graph's inputs but the greedy op's steps (tests/support/op_graph_builders.py
    ``decode_step_graph``), laid out as the engine does."""
    from srm_max.models.srm.packing import INPUTS, step_tensors

    inputs = step_tensors(layer_params, head_w)
    return [_i64(ids), _f32(embedding), _f32(states), _i64(positions), *(inputs[k] for k in INPUTS),
            np.array([eps], np.float32), np.zeros(len(head_w), np.float32)]


def decode_steps(ids, embedding, states, positions, layer_params: list[dict], head_w, eps: float,
                  steps: int, sampling=None):
    """``steps`` decode steps in one op, arguments as ``decode_step``; greedy, or drawn
    with ``sampling`` (a ``SamplingArrays``); -> ``(tokens [B, steps], new_states, last
    [B], next positions [B])``."""
    from srm_max.runtime.call_types import SamplingArrays

    s = sampling or SamplingArrays.greedy(len(ids))
    out = model(OP_DECODE_STEPS).execute(
        *_decode_op_args(ids, embedding, states, positions, layer_params, head_w, eps),
        np.arange(steps, dtype=np.int64), s.temperature.astype(np.float32), s.top_k.astype(np.int64),
        s.top_p.astype(np.float32), s.seed.astype(np.uint64), np.array([s.mode()], np.int64),
        np.array([0], np.int64))  # no log-probabilities
    return tuple(t.to_numpy().copy() for t in out)


