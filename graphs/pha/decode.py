"""The PHA decode graph: one step per ``execute``, the state ``[L, B, X]`` a buffer
written in place.

A step reads each layer's KV cache once (``attention.attn_step``) and, after the last
layer, writes every layer's new GSS state and one key and one value row per KV head
with one Mojo op (``srm_write_state_rows``, mojo/state_rows.mojo): the caches are
never copied. MAX 26.7's ``ops.while_loop`` carries tensors, not buffers, so an
in-place write cannot sit in a loop of steps; the engine calls this graph once per
step (``PHAEngine.decode``). Without a loop the graph also stays clear of the
loop-graph faults of docs/avx2_crash.md.
"""

from __future__ import annotations

import math

import numpy as np
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType, TensorValue, ops

from ..op_names import OP_PHA_DECODE_STEPS, OP_WRITE_STATE_ROWS
from ..ops import F32, I64, U64, clamp_max, const, linear
from ..sampler import drawn_logprobs, sample
from .attention import attn_step
from .gss import gss_step
from .model import PHAWeights, StateLayout, _Consts, _block, _embed, _ffn


def row_width(config) -> int:
    """The width w the state is cut into for ``row_updates``: divides the GSS state and a head."""
    lay = StateLayout.of(config)
    sizes = ([lay.gss] if lay.gss else []) + ([config.head_dim] if lay.kv else [])
    return math.gcd(*sizes) if sizes else 1


def row_updates(gss: list, keys: list, values: list, pos: TensorValue, config, device: DeviceRef):
    """What one step writes, per layer l and sample b: the GSS state gss[l] [B, 2HN] whole
    and keys[l], values[l] [B, Hkv*dh] as row min(pos, n-1) of each KV head.

    -> (rows [L, B, R, w], index [B, R]): the state seen as rows of w = ``row_width``
    floats, ``rows[l, b, r]`` goes to row ``index[b, r]`` (the same rows in every layer).
    A position past the context overwrites the last row: such a sample is finished (the
    host discards its tokens and its state).
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
    index = ops.unsqueeze(clamp_max(pos, n - 1), 1) * const(np.array(step, np.int64).reshape(1, R), I64, device)
    index = index + const(np.array(base, np.int64).reshape(1, R), I64, device)  # [B, R]
    updates = []
    for l in range(L):
        parts = ([gss[l]] if lay.gss else []) + ([keys[l], values[l]] if lay.kv else [])
        flat = parts[0] if len(parts) == 1 else ops.concat(parts, axis=1)
        updates.append(ops.reshape(flat, [B, R, w]))
    return ops.stack(updates, axis=0), index


def step(W: PHAWeights, ids: TensorValue, pos: TensorValue, states: TensorValue, device: DeviceRef):
    """One token for the whole batch: -> (logits [B, V], (gss, keys, values)), the per-layer
    pieces of the state this step writes (``row_updates``)."""
    c = W.config
    K = _Consts(c, device)
    lay = StateLayout.of(c)
    HN = lay.gss // 2
    x = _embed(W, ids)  # [B, E]
    gss, keys, values = [], [], []
    for l in range(c.n_layers):
        st = states[l]  # [B, X]

        def run(name, h, kept, l=l, st=st):  # kept: None (``_block`` without it)
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
    return linear(x, W.output()), (gss, keys, values)


def _step_inputs(layers, width, device: DeviceRef) -> list:
    """The inputs both decode graphs share: ids, positions, the states [layers, batch,
    width] (written in place; sizes or symbolic names) and the sampling parameters."""
    return [
        TensorType(I64, ["batch"], device),  # ids
        TensorType(I64, ["batch"], device),  # positions
        BufferType(F32, [layers, "batch", width], device),  # states, written in place
        TensorType(F32, ["batch"], device),  # temperature
        TensorType(I64, ["batch"], device),  # top_k
        TensorType(F32, ["batch"], device),  # top_p
        TensorType(U64, ["batch"], device),  # seed
        TensorType(I64, [], DeviceRef.CPU()),  # sampling mode
    ]


def build_pha_decode_graph(config, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                           kernel_library=None, name: str | None = None) -> Graph:
    """One decode step for a batch (B symbolic), the states updated in place.

    Inputs: ids [B], positions [B], states [L, B, X] (a buffer), temperature / top_k /
    top_p / seed [B], mode [] (host), as ``graphs/loop.py`` without its step counts, then
    its scored [] (host: 1 for the log-probabilities below, 0 for zeros at no cost).
    Outputs: the drawn token [B] (its random counter is its position, positions + 1)
    and positions + 1; then the token's raw log-probability [B] f32 (log_softmax of the
    logits, no temperature or filters) and the K likeliest tokens' [B, K] f32 with their
    ids [B, K] int64 (``sampler.drawn_logprobs``, K = ``scoring.top_width(V)``).
    ``kernel_library``: the Mojo package holding ``srm_write_state_rows``.
    """
    if kernel_library is None:
        raise ValueError("the PHA decode graph needs the Mojo kernel library (srm_write_state_rows)")
    device = device or DeviceRef.CPU()
    c, lay = config, StateLayout.of(config)
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    input_types = _step_inputs(c.n_layers, lay.width, device) + [TensorType(I64, [], DeviceRef.CPU())]  # scored
    with Graph(name or f"pha_decode_{dt}", input_types=input_types, custom_extensions=[kernel_library]) as g:
        ids, pos, states_buf, temperature, top_k, top_p, seed, mode, scored = g.inputs
        ids, pos = ids.tensor, pos.tensor
        states_buf = states_buf.buffer
        logits, (gss, keys, values) = step(PHAWeights(c, wdtype, device), ids, pos, ops.buffer_load(states_buf), device)
        nxt = sample(logits, temperature.tensor, top_k.tensor, top_p.tensor, seed.tensor, pos + 1, mode.tensor, device)
        if lay.gss or lay.kv:
            rows, index = row_updates(gss, keys, values, pos, c, device)
            # logits: a value computed from every read of the state, so the write follows them
            ops.inplace_custom(OP_WRITE_STATE_ROWS, device=device, values=[states_buf, rows, index, logits],
                               out_types=[TensorType(F32, rows.shape, device)])
        g.output(nxt, pos + 1, *drawn_logprobs(logits, nxt, scored.tensor, device))
    return g


def build_pha_decode_steps_graph(kernel_library, wdtype: DType = DType.float32, name: str | None = None) -> Graph:
    """S steps as ONE op (mojo/pha_decode_step.mojo ``pha_decode_steps``), CPU, the
    states written in place: each token the first argmax in ``sampler.MODE_GREEDY``,
    else drawn in the op as ``sampler.sample`` draws it (the random counter of a token
    is its position).

    Inputs: ``build_pha_decode_graph``'s, then steps [S] (its length is the step count),
    scored [] (host: 1 for the log-probabilities below, 0 for none at no cost) and top [N]
    (its length is the number of alternatives). Outputs: tokens [B, S], ids = tokens[:,
    -1], positions + S, each new token's raw log-probability [B, S] (log_softmax of the
    logits, no temperature or filters) and the N most likely tokens' [B, S, N] with their
    ids [B, S, N] (descending, ties by lower id). The same tokens and
    states as S calls of ``build_pha_decode_graph`` (tests/models/pha/test_pha_decode_op.py).

    The graph holds nothing of a model: every size is symbolic and the model comes as the
    last inputs (``srm_max.models.pha.packing.op_arrays``): the embedding [V, E] and the
    packed matrices [m] in ``wdtype``, the packed vectors [v], the layout [L, slots] and
    dims [D] int64 and the scalars [K] float32. So one compiled graph per weight dtype
    serves every PHA the op runs: a config costs no compile of its own.
    """
    device = DeviceRef.CPU()
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    input_types = _step_inputs("layers", "width", device) + [
        TensorType(I64, ["steps"], device),  # steps: only its length is read
        TensorType(I64, [], DeviceRef.CPU()),  # scored
        TensorType(I64, ["top"], device),  # top: only its length is read
        TensorType(wdtype, ["vocab", "embed"], device),  # embedding
        TensorType(wdtype, ["mats"], device),  # packed matrices
        TensorType(F32, ["vecs"], device),  # packed vectors
        TensorType(I64, ["blocks", "slots"], device),  # layout
        TensorType(I64, ["dims"], device),  # dims
        TensorType(F32, ["scalars"], device),  # scalars
    ]
    with Graph(name or f"pha_decode_steps_{dt}_kernels", input_types=input_types,
               custom_extensions=[kernel_library]) as g:
        ids, pos, states_buf, temperature, top_k, top_p, seed, mode, steps, scored, top, *model = g.inputs
        ids, pos, steps = ids.tensor, pos.tensor, steps.tensor
        embedding, mats, vecs, layout, dims, scalars = (v.tensor for v in model)
        B, S, N = ids.shape[0], steps.shape[0], top.tensor.shape[0]
        tokens, last, next_pos, logprobs, top_values, top_ids = ops.inplace_custom(
            OP_PHA_DECODE_STEPS, device=device,
            values=[states_buf.buffer, ids, embedding, pos, mats, vecs, layout, dims, scalars, steps,
                    temperature.tensor, top_k.tensor, top_p.tensor,
                    seed.tensor, ops.reshape(mode.tensor, [1]), ops.reshape(scored.tensor, [1])],
            out_types=[TensorType(I64, [B, S], device), TensorType(I64, [B], device), TensorType(I64, [B], device),
                       TensorType(F32, [B, S], device), TensorType(F32, [B, S, N], device),
                       TensorType(I64, [B, S, N], device)])
        g.output(tokens.tensor, last.tensor, next_pos.tensor, logprobs.tensor, top_values.tensor, top_ids.tensor)
    return g
