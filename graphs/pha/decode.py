"""The PHA decode graph: S steps in one ``execute`` (``graphs.loop``), states [L, B, X]."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from ..loop import build_multistep_decode_graph
from ..ops import F32, linear
from .model import (StateLayout, PHAWeights, _Consts, _block, _embed, _ffn, _masked_softmax, _qkv, _state_row)


def _gss_step(x, st, g: dict, c, K: _Consts):
    """x [B, E], this layer's state [B, X] -> (out [B, E], new GSS state [B, 2*H*N]).

    s = Abar s + LN(v) (complex, as real pairs over flat (h, n) channels);
    y = Re(Ct . s) + D LN(v), the sum over n by ``group_sum``.
    """
    H, N = c.gss_hidden_dim, c.dss_state_size
    HN = H * N
    u = ops.gelu(linear(x, g["to_u"]))
    xn = ops.layer_norm(ops.gelu(linear(x, g["to_v"], g["to_v_b"])), g["norm_w"], g["norm_b"],
                        epsilon=c.norm_eps)  # [B, H]
    xe = K.spread(xn, H, N)  # [B, H*N]
    re, im = st[:, :HN], st[:, HN : 2 * HN]
    ar, ai = g["abar_re"], g["abar_im"]
    re2 = ar * re - ai * im + xe
    im2 = ar * im + ai * re
    y = K.group_sum(re2 * g["ct_re_flat"] - im2 * g["ct_im_flat"], H, N) + xn * g["D"]
    out = linear(linear(y, g["to_gate"]) * u, g["to_out"], g["to_out_b"])
    return out, ops.concat([re2, im2], axis=1)


def _attn_step(x, pos, pos_f, st, a: dict, c, K: _Consts, lay: StateLayout):
    """x [B, E] at pos [B]: writes k, v at pos into the caches, attends over 0..pos.

    -> (out [B, E], (keys, values) [B, Hkv*n*dh]). Rank-3 ops per KV head on its
    contiguous columns [n, dh] of the state. A position >= n writes nothing (the
    host discards such tokens).
    """
    Hq, Hkv, dh, n = c.n_q_heads, c.n_kv_heads, c.head_dim, c.context_length
    G = Hq // Hkv
    B = x.shape[0]
    q, k, v = _qkv(x, ops.unsqueeze(pos_f, -1), a, c, K)
    # cache * (1 - hit) + hit * new, every factor broadcast to [B, n, dh] explicitly
    # (exact: the factors are 0 or 1).
    hit = ops.reshape(ops.cast(ops.equal(ops.unsqueeze(pos, 1), ops.unsqueeze(K.iota_n(), 0)), F32), [B, n, 1])
    keep = ops.broadcast_to(1.0 - hit, [B, n, dh])
    hit = ops.broadcast_to(hit, [B, n, dh])
    seen = ops.reshape(ops.cast(ops.unsqueeze(K.iota_n(), 0) <= ops.unsqueeze(pos, 1), F32), [B, 1, n])
    keys, values, heads = [], [], []
    for kv in range(Hkv):
        ch = slice(kv * dh, (kv + 1) * dh)

        def write(section: slice, new):
            start = section.start + kv * n * dh
            old = ops.reshape(st[:, start : start + n * dh], [B, n, dh])
            return old * keep + hit * ops.broadcast_to(ops.reshape(new[:, ch], [B, 1, dh]), [B, n, dh])

        kh, vh = write(lay.keys, k), write(lay.values, v)
        keys.append(ops.reshape(kh, [B, n * dh]))
        values.append(ops.reshape(vh, [B, n * dh]))
        for h in range(kv * G, (kv + 1) * G):
            qh = ops.reshape(q[:, h * dh : (h + 1) * dh], [B, 1, dh])
            logits = ops.matmul(qh, ops.transpose(kh, 1, 2))  # [B, 1, n]
            att = ops.matmul(_masked_softmax(logits, seen, K.logit_bound), vh)  # [B, 1, dh]
            heads.append(ops.reshape(att, [B, dh]))
    out = linear(ops.concat(heads, axis=1), a["o"])
    return out, (_cat(keys), _cat(values))


def _cat(parts: list) -> TensorValue:
    return parts[0] if len(parts) == 1 else ops.concat(parts, axis=1)


def step(W: PHAWeights, ids: TensorValue, pos: TensorValue, states: TensorValue, device: DeviceRef):
    """One token for the whole batch: -> (logits [B, V], new states [L, B, X])."""
    c = W.config
    K = _Consts(c, device)
    lay = StateLayout.of(c)
    pos_f = ops.cast(pos, F32)
    zero_col = ops.unsqueeze(ops.cast(pos * 0, F32), -1)  # [B, 1]
    x = _embed(W, ids)  # [B, E]
    new_states = []
    for l in range(c.n_layers):
        st = states[l]  # [B, X]
        found: dict = {}

        def run(name, h, l=l, st=st, found=found):
            if name == "gss":
                out, found["gss"] = _gss_step(h, st, W.gss(l), c, K)
            elif name == "attn":
                out, found["attn"] = _attn_step(h, pos, pos_f, st, W.attn(l), c, K, lay)
            else:
                out = _ffn(h, W.ffn(l, int(name.removeprefix("ffn_"))))
            return out

        x = _block(x, l, W, run)
        new_states.append(_state_row(found, zero_col))
    return linear(x, W.output()), ops.stack(new_states, axis=0)


def build_pha_decode_graph(config, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                           name: str | None = None) -> Graph:
    """S decode steps for a batch in one ``execute`` (B and S symbolic).

    Inputs and outputs as ``graphs/decode.py`` (ids, positions, states, sampling, mode,
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
