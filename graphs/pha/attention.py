"""The GQA branch: causal attention over a prompt, and one decode step over the KV cache.

Query head h reads KV head h // G (G = Hq / Hkv). q and k are L2-normalised and rotated
(RoPE); the per-head logit scale rides on q (``model._qkv``).
"""

from __future__ import annotations

from max.graph import TensorType, TensorValue, ops

from ..op_names import OP_PHA_PREFILL_ATTENTION, OP_PHA_QK_ROPE
from ..ops import F32, Dense, Rows, linear
from .model import StateLayout, _Consts, _masked_softmax, _qkv


def attn_prefill(x: TensorValue, pos: TensorValue, pos_cols: TensorValue, lengths: TensorValue, a: dict, c,
                 K: _Consts, tiled: bool = False, dense_op: Dense = None, kept: Rows = None,
                 query_at: TensorValue | None = None):
    """x [B, T, E] at positions 0..T-1 -> (out [B, T, E], (keys, values) [B, T, Hkv*dh]),
    the keys and values at the T positions (``model.PrefillStates`` places them in the
    state's caches).

    ``tiled``: q and k are made ready by one Mojo op (``qk_rope_op``) and the attention is
    another (mojo/pha_prefill_attention.mojo, CPU code: tiles with an online softmax, O(T)
    memory, rows past each prompt's length zero); else
    plain ops with a [B, T, T] score matrix per query head (``full_attention``), the GPU
    path and the op's reference. ``dense_op``: the projections through the linear op.
    ``kept``: out only at the rows it keeps ([B, R, E]; ``prefill.pha_layers``' ``out_at``),
    the output projection on those rows alone, and the op's attention for those queries alone
    (the keys and values still come from every row). ``query_at`` [B, R] (tiled only): the
    positions of the queries the op computes, ``kept.at`` or every position, made once by the
    caller for every block.
    """
    if tiled:
        q, k = qk_rope_op(linear(x, a["q"], op_device=dense_op), linear(x, a["k"], op_device=dense_op), pos,
                          a["scale"], K)
        v = linear(x, a["v"], op_device=dense_op)
        att = tiled_attention(kept(q) if kept else q, k, v, lengths, query_at, c, K.device)
        return linear(att, a["o"], op_device=dense_op), (k, v)
    q, k, v = _qkv(x, ops.unsqueeze(ops.cast(pos, F32), -1), a, c, K, dense_op)
    att = full_attention(q, k, v, pos, pos_cols, c, K)
    return linear(kept(att) if kept else att, a["o"], op_device=dense_op), (k, v)


def full_attention(q: TensorValue, k: TensorValue, v: TensorValue, pos: TensorValue, pos_cols: TensorValue, c,
                   K: _Consts) -> TensorValue:
    """Causal attention with plain ops: one rank-3 attention per query head on channel
    slices ([B, T, T] logits) -> [B, T, Hq*dh]."""
    Hq, Hkv, dh = c.n_q_heads, c.n_kv_heads, c.head_dim
    G = Hq // Hkv
    causal = ops.cast(ops.unsqueeze(pos_cols, 0) <= ops.unsqueeze(pos, 1), F32)  # [T(i), T(j)]: j <= i
    heads = []
    for h in range(Hq):
        kv = slice((h // G) * dh, (h // G + 1) * dh)
        logits = ops.matmul(q[:, :, h * dh : (h + 1) * dh], ops.transpose(k[:, :, kv], 1, 2))  # [B, T, T]
        heads.append(ops.matmul(_masked_softmax(logits, causal, K.logit_bound), v[:, :, kv]))
    return ops.concat(heads, axis=2)


def qk_rope_op(q: TensorValue, k: TensorValue, pos: TensorValue, scale: TensorValue, K: _Consts):
    """The projections q [B, T, Hq*dh] and k [B, T, Hkv*dh] at positions pos [T] made ready
    for attention by the Mojo op (mojo/pha_qk_rope.mojo): each head normalised and rotated,
    q times ``scale``, what ``_qkv`` does with plain ops, in one pass -> (q, k)."""
    device = K.device
    q_out, k_out = ops.custom(OP_PHA_QK_ROPE, device=device, values=[q, k, pos, K.inv_freq_const(), scale],
                              out_types=[TensorType(F32, q.shape, device), TensorType(F32, k.shape, device)])
    return q_out.tensor, k_out.tensor


def tiled_attention(q: TensorValue, k: TensorValue, v: TensorValue, lengths: TensorValue, at: TensorValue, c,
                    device) -> TensorValue:
    """Causal attention as the Mojo op over [B, ., heads, dh] views: the queries q [B, R, Hq*dh]
    at the positions ``at`` [B, R] over the keys and values [B, T, Hkv*dh] -> [B, R, Hq*dh]."""
    B, R, T = q.shape[0], q.shape[1], k.shape[1]
    q4 = ops.reshape(q, [B, R, c.n_q_heads, c.head_dim])
    k4, v4 = (ops.reshape(t, [B, T, c.n_kv_heads, c.head_dim]) for t in (k, v))
    (att,) = ops.custom(OP_PHA_PREFILL_ATTENTION, device=device, values=[q4, k4, v4, lengths, at],
                        out_types=[TensorType(F32, q4.shape, device)])
    return ops.reshape(att.tensor, [B, R, c.n_q_heads * c.head_dim])


def attn_step(x: TensorValue, pos: TensorValue, st: TensorValue, a: dict, c, K: _Consts, lay: StateLayout):
    """x [B, E] at pos [B], this layer's state [B, X] -> (out [B, E], (k, v) [B, Hkv*dh]).

    The cache holds positions < pos; the new key and value join the softmax as one more
    column, so the cache is read once (one [G, dh] x [dh, n] matmul per KV head for the
    logits, one [G, n] x [n, dh] for the values) and nothing is written here: the decode
    step writes k, v as row pos afterwards (``decode.row_updates``).
    """
    Hq, Hkv, dh, n = c.n_q_heads, c.n_kv_heads, c.head_dim, c.context_length
    G = Hq // Hkv
    B = x.shape[0]
    q, k, v = _qkv(x, ops.unsqueeze(ops.cast(pos, F32), -1), a, c, K)
    q4 = ops.reshape(q, [B, Hkv, G, dh])

    def per_query(t):  # [B, Hkv*dh] -> [B, Hkv, G, dh], each KV head's row repeated G times
        return ops.broadcast_to(ops.reshape(t, [B, Hkv, 1, dh]), [B, Hkv, G, dh])

    keys = ops.reshape(st[:, lay.keys], [B, Hkv, n, dh])
    values = ops.reshape(st[:, lay.values], [B, Hkv, n, dh])
    cached = ops.matmul(q4, ops.transpose(keys, 2, 3))  # [B, Hkv, G, n]
    fresh = ops.sum(q4 * per_query(k), axis=-1)  # [B, Hkv, G, 1]
    logits = ops.concat([cached, fresh], axis=-1)  # [B, Hkv, G, n + 1]
    seen = ops.cast(ops.unsqueeze(K.iota_n(), 0) < ops.unsqueeze(pos, 1), F32)  # [B, n]
    # the new column: a constant broadcast, not arithmetic on pos (pos * 0 + 1 folds to a
    # constant that MAX casts at compile time in a compiled subgraph of its own)
    seen = ops.concat([seen, ops.broadcast_to(ops.constant(1.0, F32, device=K.device), [B, 1])], axis=1)  # [B, n + 1]
    keep = ops.broadcast_to(ops.reshape(seen, [B, 1, 1, n + 1]), [B, Hkv, G, n + 1])
    p = _masked_softmax(logits, keep, K.logit_bound)
    p_new = ops.broadcast_to(p[:, :, :, n:], [B, Hkv, G, dh])
    att = ops.matmul(p[:, :, :, :n], values) + p_new * per_query(v)  # [B, Hkv, G, dh]
    return linear(ops.reshape(att, [B, Hq * dh]), a["o"]), (k, v)
