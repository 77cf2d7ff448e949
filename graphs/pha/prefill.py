"""The PHA prefill graph: whole prompts at once (GSS as a causal Toeplitz convolution)."""

from __future__ import annotations

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from .. import ops as gops
from ..ops import F32, I64, U64, linear
from ..sampler import sample
from .model import (StateLayout, PHAWeights, _Consts, _block, _embed, _ffn, _masked_softmax, _qkv, _state_row)


def _gss_prefill(x, pos, pos_cols, lengths, g: dict, c):
    """x [B, T, E] -> (out [B, T, E], state [B, 2*H*N] after each sample's last real token).

    y = causal_conv(LN(v), K) + D LN(v) with the kernel K[t, h] = Re(sum_n Ct Abar**t),
    as a Toeplitz matmul per channel ([H, T, T]: the same order of work as attention).
    """
    H, N = c.gss_hidden_dim, c.dss_state_size
    B, T = x.shape[0], x.shape[1]
    u = ops.gelu(linear(x, g["to_u"]))  # [B, T, F]
    xn = ops.layer_norm(ops.gelu(linear(x, g["to_v"], g["to_v_b"])), g["norm_w"], g["norm_b"],
                        epsilon=c.norm_eps)  # [B, T, H]

    # toeplitz[h, t, s] = Re(sum_n Ct[h, n] Abar_n**(t-s)) for s <= t, else 0, with
    # Abar**k = exp(k a) (cos k w + i sin k w): powers laid out [N, T*T], then a 2-D
    # matmul with Ct.
    gap = ops.unsqueeze(pos, 1) - ops.unsqueeze(pos_cols, 0)  # [T(t), T(s)] = t - s
    causal = ops.unsqueeze(ops.cast(gap >= 0, F32), 0)  # [1, T, T]
    k = ops.unsqueeze(ops.cast(gap, F32), 0) * causal  # [1, T, T], >= 0
    a, w = ops.reshape(g["a"], [N, 1, 1]), ops.reshape(g["w"], [N, 1, 1])
    mag = ops.exp(k * a) * causal  # [N, T, T]
    p_re = ops.reshape(mag * ops.cos(k * w), [N, -1])
    p_im = ops.reshape(mag * ops.sin(k * w), [N, -1])
    toeplitz = ops.reshape(ops.matmul(g["ct_re"], p_re) - ops.matmul(g["ct_im"], p_im), [H, T, T])
    y = ops.matmul(toeplitz, ops.permute(xn, [2, 1, 0]))  # [H, T, B]
    y = ops.permute(y, [2, 1, 0]) + xn * g["D"]
    out = linear(linear(y, g["to_gate"]) * u, g["to_out"], g["to_out_b"])

    # State after token e-1 (e = the sample's length): sum_{j < e} Abar**(e-1-j) LN(v)_j.
    back = ops.unsqueeze(lengths, 1) - 1 - ops.unsqueeze(pos, 0)  # [B, T]
    valid = ops.cast(back >= 0, F32)
    back_f = ops.unsqueeze(ops.cast(back, F32) * valid, -1)  # [B, T, 1]
    mag = ops.exp(back_f * g["a"]) * ops.unsqueeze(valid, -1)  # [B, T, N]
    ang = back_f * g["w"]
    xt = ops.permute(xn, [0, 2, 1])  # [B, H, T]
    s_re = ops.matmul(xt, mag * ops.cos(ang))  # [B, H, N]
    s_im = ops.matmul(xt, mag * ops.sin(ang))
    state = ops.concat([ops.reshape(s_re, [B, H * N]), ops.reshape(s_im, [B, H * N])], axis=1)
    return out, state


def _attn_prefill(x, pos, pos_cols, pos_f, a: dict, c, K: _Consts):
    """x [B, T, E] at positions 0..T-1 -> (out [B, T, E], (keys, values) [B, Hkv*n*dh]).

    One rank-3 attention per query head (head h reads KV head h // G) on channel
    slices; no head axis, so nothing broadcasts across heads.
    """
    Hq, Hkv, dh, n = c.n_q_heads, c.n_kv_heads, c.head_dim, c.context_length
    G = Hq // Hkv
    T = x.shape[1]
    q, k, v = _qkv(x, ops.unsqueeze(pos_f, -1), a, c, K)
    causal = ops.cast(ops.unsqueeze(pos_cols, 0) <= ops.unsqueeze(pos, 1), F32)  # [T(i), T(j)]: j <= i
    heads = []
    for h in range(Hq):
        kv = slice((h // G) * dh, (h // G + 1) * dh)
        logits = ops.matmul(q[:, :, h * dh : (h + 1) * dh], ops.transpose(k[:, :, kv], 1, 2))  # [B, T, T]
        heads.append(ops.matmul(_masked_softmax(logits, causal, K.logit_bound), v[:, :, kv]))
    out = linear(ops.concat(heads, axis=2), a["o"])

    # The caches: token t goes to row t of n (a one-hot [n, T] matmul; rows >= T stay 0).
    place = ops.cast(ops.equal(ops.unsqueeze(K.iota_n(), 1), ops.unsqueeze(pos, 0)), F32)  # [n, T]
    B = x.shape[0]

    def cache(t):  # [B, T, Hkv*dh] -> [B, Hkv*n*dh]
        full = ops.matmul(place, ops.reshape(ops.permute(t, [1, 0, 2]), [T, -1]))  # [n, B*Hkv*dh]
        return ops.reshape(ops.permute(ops.reshape(full, [n, B, Hkv, dh]), [1, 2, 0, 3]), [B, -1])

    return out, (cache(k), cache(v))


def build_pha_prefill_graph(config, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                            name: str | None = None) -> Graph:
    """Prefill of right-padded prompts (B and T symbolic).

    Inputs:  ids [B, T] int64, pos [T] and pos_cols [T] int64 (both 0 .. T-1), lengths [B] int64 (also the
             random counter of the first new token), temperature [B] f32, top_k [B] int64,
             top_p [B] f32, seed [B] uint64, mode [] int64 on the host (``sampler.MODE_*``).
    Outputs: logits [B, V] at each prompt's last token, next_ids [B], states [L, B, X].
    """
    device = device or DeviceRef.CPU()
    c = config
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    input_types = [
        TensorType(I64, ["batch", "seq"], device),  # ids
        TensorType(I64, ["seq"], device),  # pos
        TensorType(I64, ["seq"], device),  # pos_cols: pos again (see the module docs)
        TensorType(I64, ["batch"], device),  # lengths
        TensorType(F32, ["batch"], device),  # temperature
        TensorType(I64, ["batch"], device),  # top_k
        TensorType(F32, ["batch"], device),  # top_p
        TensorType(U64, ["batch"], device),  # seed
        TensorType(I64, [], DeviceRef.CPU()),  # sampling mode, on the host
    ]
    with Graph(name or f"pha_prefill_{dt}", input_types=input_types) as g:
        ids, pos, pos_cols, lengths, temperature, top_k, top_p, seed, mode = (v.tensor for v in g.inputs)
        W = PHAWeights(c, wdtype, device)
        K = _Consts(c, device)
        pos_f = ops.cast(pos, F32)
        zero_col = ops.unsqueeze(ops.cast(lengths * 0, F32), -1)  # [B, 1]
        x = _embed(W, ids)  # [B, T, E]
        states = []
        for l in range(c.n_layers):
            found: dict = {}

            def run(name, h, l=l, found=found):
                if name == "gss":
                    out, found["gss"] = _gss_prefill(h, pos, pos_cols, lengths, W.gss(l), c)
                elif name == "attn":
                    out, found["attn"] = _attn_prefill(h, pos, pos_cols, pos_f, W.attn(l), c, K)
                else:
                    out = _ffn(h, W.ffn(l, int(name.removeprefix("ffn_"))))
                return out

            x = _block(x, l, W, run)
            states.append(_state_row(found, zero_col))
        last = ops.gather_nd(x, ops.unsqueeze(lengths - 1, -1), batch_dims=1)  # [B, E]
        logits = linear(last, W.output())
        nxt = sample(logits, temperature, top_k, top_p, seed, lengths, mode, device)
        g.output(logits, nxt, ops.stack(states, axis=0))
    return g
