"""The PHA decode graph: S steps in one ``execute`` (``graphs.loop``), states [L, B, X].

A step reads each layer's KV cache once (``attention.attn_step``) and, after the last
layer, writes every layer's new GSS state and one key and one value row per KV head
with a single ``scatter`` (``write_rows``). Inside ``ops.while_loop`` MAX 26.7
carries tensors, not buffers, so that scatter still yields a new tensor: the state is
copied once per step (one memcpy, not a pass of arithmetic over every cache).
"""

from __future__ import annotations

import math

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from ..loop import build_multistep_decode_graph
from ..ops import F32, I64, clamp_max, const, linear
from .attention import attn_step
from .gss import gss_step
from .model import PHAWeights, StateLayout, _Consts, _block, _embed, _ffn


def row_width(config) -> int:
    """The width w the state is cut into for ``write_rows``: divides the GSS state and a head."""
    lay = StateLayout.of(config)
    sizes = ([lay.gss] if lay.gss else []) + ([config.head_dim] if lay.kv else [])
    return math.gcd(*sizes) if sizes else 1


def write_rows(states: TensorValue, gss: list, keys: list, values: list, pos: TensorValue, config,
               device: DeviceRef) -> TensorValue:
    """states [L, B, X] with, per layer l and sample b, the GSS state gss[l] [B, 2HN] written
    whole and keys[l], values[l] [B, Hkv*dh] written as row min(pos, n-1) of each KV head.

    One ``scatter`` along the rows of the state seen as rows of w = ``row_width`` floats,
    with elementwise indices (a ``scatter_nd`` with (layer, sample, row) index vectors
    wrote other samples' rows too). A position past the context overwrites the last row:
    such a sample is finished (the host discards its tokens and its state).
    """
    c, lay = config, StateLayout.of(config)
    L, Hkv, dh, n = c.n_layers, c.n_kv_heads, c.head_dim, c.context_length
    w = row_width(c)
    B = pos.shape[0]
    # the rows each (l, b) writes: its GSS rows, then dh / w rows per KV head for k, then v
    base, step = [], []
    if lay.gss:
        base += list(range(lay.gss // w))
        step += [0] * (lay.gss // w)
    if lay.kv:
        for start in (lay.keys.start, lay.values.start):
            for h in range(Hkv):
                base += [(start + h * n * dh) // w + r for r in range(dh // w)]
                step += [dh // w] * (dh // w)
    R = len(base)
    row = ops.unsqueeze(clamp_max(pos, n - 1), 1) * const(np.array(step, np.int64).reshape(1, R), I64, device)
    row = row + const(np.array(base, np.int64).reshape(1, R), I64, device)  # [B, R]
    index = ops.broadcast_to(ops.reshape(row, [1, B, R, 1]), [L, B, R, w])  # the row of every element
    updates = []
    for l in range(L):
        parts = ([gss[l]] if lay.gss else []) + ([keys[l], values[l]] if lay.kv else [])
        flat = parts[0] if len(parts) == 1 else ops.concat(parts, axis=1)
        updates.append(ops.reshape(flat, [B, R, w]))
    rows = ops.reshape(states, [L, B, lay.width // w, w])
    out = ops.scatter(rows, ops.stack(updates, axis=0), index, axis=2)
    return ops.reshape(out, [L, B, lay.width])


def step(W: PHAWeights, ids: TensorValue, pos: TensorValue, states: TensorValue, device: DeviceRef):
    """One token for the whole batch: -> (logits [B, V], new states [L, B, X])."""
    c = W.config
    K = _Consts(c, device)
    lay = StateLayout.of(c)
    HN = lay.gss // 2
    x = _embed(W, ids)  # [B, E]
    gss, keys, values = [], [], []
    for l in range(c.n_layers):
        st = states[l]  # [B, X]

        def run(name, h, l=l, st=st):
            if name == "gss":
                out, re, im = gss_step(h, st[:, :HN], st[:, HN : 2 * HN], W.gss(l), c, K)
                gss.append(ops.concat([re, im], axis=1))
            elif name == "attn":
                out, (k, v) = attn_step(h, pos, st, W.attn(l), c, K, lay)
                keys.append(k)
                values.append(v)
            else:
                out = _ffn(h, W.ffn(l, int(name.removeprefix("ffn_"))))
            return out

        x = _block(x, l, W, run)
    logits = linear(x, W.output())
    if not (lay.gss or lay.kv):
        return logits, states
    return logits, write_rows(states, gss, keys, values, pos, c, device)


def build_pha_decode_graph(config, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                           name: str | None = None) -> Graph:
    """S decode steps for a batch in one ``execute`` (B and S symbolic).

    Inputs and outputs as ``graphs/loop.py`` (ids, positions, states, sampling, mode,
    steps, n_steps -> tokens [B, S], states, ids, positions), with states [L, B, X].
    """
    device = device or DeviceRef.CPU()
    c = config
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    state_type = TensorType(F32, [c.n_layers, "batch", StateLayout.of(c).width], device)

    def make_step():
        W = PHAWeights(c, wdtype, device)
        return lambda ids, pos, states: step(W, ids, pos, states, device)

    return build_multistep_decode_graph(name or f"pha_decode_{dt}", state_type, make_step, device)
