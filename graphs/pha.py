"""PHA hybrid graphs: prefill (whole prompts) and decode (S steps in one ``execute``).

The math is ``reference/pha.py`` (GSS, GQA, FFN branches, RMSNorm per branch,
softplus mixing, DeepNorm post-LN), written with plain MAX ops.

Per-sample state, one float32 tensor ``[L, B, X]`` (so a sample is a column
block the host can copy, as for the SRM). Per layer and sample, X holds, flat
and in this order (a branch that is off takes no room):

    gss    [2, H, N]          the DSS state as real pairs: real parts, then imaginary
    keys   [Hkv, n, dh]       normalised, rotated keys, preallocated to the context n
    values [Hkv, n, dh]

(one unused column if the model has neither GSS nor attention). ``StateLayout``
splits it; ``PHAEngine.split_states`` gives the reference's ``PHACache`` layout.

MAX 26.7 CPU workarounds (see graphs/decode.py, docs/avx2_crash.md): nothing
broadcasts a size-1 head axis against a reshaped matmul result, and no small
one-hot or outer-product matmul runs (inside the decode loop they crash MAX's
AVX2 code). Per-head quantities are spread per channel by a gather
(``layers.per_channel``) and summed per head by a reshape and a sum, attention
runs one rank-3 matmul pair per head on channel slices, the KV-cache write
selects the new row with explicitly broadcast 0/1 factors, and the causal mask
is applied by multiplication in a written-out softmax (``_masked_softmax``).

The prefill takes the positions twice (``pos``, ``pos_cols``): with one vector on
both sides, ``pos[:, None] - pos[None, :]`` and ``pos[None, :] > pos[:, None]``
came out of the compiled graph as all zeros / all False (the Toeplitz matrix was
constant, the causal mask had no effect), although a small graph of just those
ops computes them right: it depends on what they fuse with. Built from two
distinct inputs, both are right (tests/test_pha_engine.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops

from . import layers
from .layers import F32, I64, U64, linear

@dataclass(frozen=True)
class StateLayout:
    """Column ranges of one layer's state in the flat ``[L, B, X]`` tensor."""

    gss: int  # 2 * H * N (0 without GSS)
    kv: int  # Hkv * n * dh per cache (0 without attention)

    @classmethod
    def of(cls, config) -> "StateLayout":
        c = config
        gss = 2 * c.gss_hidden_dim * c.dss_state_size if "gss" in c.branches else 0
        kv = c.n_kv_heads * c.context_length * c.head_dim if "attn" in c.branches else 0
        return cls(gss, kv)

    @property
    def width(self) -> int:
        return max(1, self.gss + 2 * self.kv)

    @property
    def keys(self) -> slice:
        return slice(self.gss, self.gss + self.kv)

    @property
    def values(self) -> slice:
        return slice(self.gss + self.kv, self.gss + 2 * self.kv)


# ----------------------------------------------------------------------- weights
def _block_prefix(l: int) -> str:
    return f"blocks.{l}."


def derived_name(l: int, what: str) -> str:
    return f"pha_derived.{l}.{what}"


def matrix_names(config) -> list[str]:
    """Checkpoint keys of the big matrices (stored in the weight dtype)."""
    c = config
    names = ["embed.weight"] + ([] if c.tie_embeddings else ["lm_head.weight"])
    for l in range(c.n_layers):
        b = _block_prefix(l) + "branches."
        if "gss" in c.branches:
            names += [b + f"gss.{m}.weight" for m in ("to_u", "to_v", "to_gate", "to_out")]
        if "attn" in c.branches:
            names += [b + f"attn.{m}_proj.weight" for m in "qkvo"]
        for i in range(len(c.ffn_dims)):
            names += [b + f"ffn_{i}.fc.weight", b + f"ffn_{i}.proj.weight"]
    return names


def graph_weight_names(config) -> list[str]:
    """Checkpoint keys the graphs read as they are (the rest enter only derived)."""
    c = config
    names = matrix_names(c)
    for l in range(c.n_layers):
        p = _block_prefix(l)
        b = p + "branches."
        if "gss" in c.branches:
            names += [b + "gss.to_v.bias", b + "gss.dss.norm.weight", b + "gss.dss.norm.bias",
                      b + "gss.dss.param_D", b + "gss.to_out.bias"]
        for i in range(len(c.ffn_dims)):
            names += [b + f"ffn_{i}.fc.bias", b + f"ffn_{i}.proj.bias"]
        if c.mode == "parallel":
            names += [p + "post_norm.weight", p + "post_norm.bias"]
        else:
            for name in c.branch_names:
                names += [p + f"branch_norms.{name}.weight", p + f"post_norms.{name}.weight",
                          p + f"post_norms.{name}.bias"]
    return names


def derived_weights(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host-side tensors computed from the checkpoint at load time (float64 math, float32 out).

    gss: a, w [N] (Abar = exp(a + i w): a = -exp(Lambda_real), w = exp(Lambda_imag));
         ct_re, ct_im [H, N] (Ct = C (Abar - 1) / Lambda); and per flat (h, n) channel
         [H*N]: abar_re, abar_im, ct_re_flat, ct_im_flat (for the decode step).
    attn: scale [Hq*dh], exp(min(logit_scale, log max)) repeated over each head's channels.
    parallel mode: branch_norm.{name} [E] = w_i * RMSNorm_i.weight, the mixing weight
         w = softplus(p) / sum(softplus(p)) folded into the branch's norm.
    """
    c = config
    out: dict[str, np.ndarray] = {}
    for l in range(c.n_layers):
        p = _block_prefix(l)
        b = p + "branches."
        if "gss" in c.branches:
            d = b + "gss.dss."
            a = -np.exp(weights[d + "Lambda_real"].astype(np.float64))
            w = np.exp(weights[d + "Lambda_imag"].astype(np.float64))
            lam = a + 1j * w
            ct = (weights[d + "C_real"].astype(np.float64) + 1j * weights[d + "C_imag"]) * (np.exp(lam) - 1) / lam
            abar = np.exp(lam)
            H = c.gss_hidden_dim
            out |= {
                derived_name(l, "gss.a"): a, derived_name(l, "gss.w"): w,
                derived_name(l, "gss.ct_re"): ct.real, derived_name(l, "gss.ct_im"): ct.imag,
                derived_name(l, "gss.abar_re"): np.tile(abar.real, H),
                derived_name(l, "gss.abar_im"): np.tile(abar.imag, H),
                derived_name(l, "gss.ct_re_flat"): ct.real.reshape(-1),
                derived_name(l, "gss.ct_im_flat"): ct.imag.reshape(-1),
            }
        if "attn" in c.branches:
            s = weights[b + "attn.logit_scale"].astype(np.float64)
            scale = np.exp(np.minimum(s, math.log(c.logit_scale_max)))
            out[derived_name(l, "attn.scale")] = np.repeat(scale, c.head_dim)
        if c.mode == "parallel":
            m = weights[p + "mixing"].astype(np.float64)
            soft = np.logaddexp(0.0, m)  # softplus
            mix = soft / soft.sum()
            for i, name in enumerate(c.branch_names):
                out[derived_name(l, f"branch_norm.{name}")] = mix[i] * weights[p + f"branch_norms.{name}.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


class PHAWeights(layers.NamedWeights):
    """The PHA graph's named weights."""

    def embedding(self) -> Weight:
        c = self.config
        return self.matrix("embed.weight", [c.vocab_size, c.d_model])

    def output(self) -> Weight:
        c = self.config
        return self.embedding() if c.tie_embeddings else self.matrix("lm_head.weight", [c.vocab_size, c.d_model])

    def gss(self, l: int) -> dict:
        c = self.config
        E, F, H, N = c.d_model, c.gss_expansion_dim, c.gss_hidden_dim, c.dss_state_size
        b = _block_prefix(l) + "branches.gss."
        g = {
            "to_u": self.matrix(b + "to_u.weight", [F, E]),
            "to_v": self.matrix(b + "to_v.weight", [H, E]),
            "to_v_b": self.get(b + "to_v.bias", [H]),
            "norm_w": self.get(b + "dss.norm.weight", [H]),
            "norm_b": self.get(b + "dss.norm.bias", [H]),
            "D": self.get(b + "dss.param_D", [H]),
            "to_gate": self.matrix(b + "to_gate.weight", [F, H]),
            "to_out": self.matrix(b + "to_out.weight", [E, F]),
            "to_out_b": self.get(b + "to_out.bias", [E]),
        }
        for k, shape in (("a", [N]), ("w", [N]), ("ct_re", [H, N]), ("ct_im", [H, N]), ("abar_re", [H * N]),
                         ("abar_im", [H * N]), ("ct_re_flat", [H * N]), ("ct_im_flat", [H * N])):
            g[k] = self.get(derived_name(l, "gss." + k), shape)
        return g

    def attn(self, l: int) -> dict:
        c = self.config
        E, dq, dk = c.d_model, c.n_q_heads * c.head_dim, c.n_kv_heads * c.head_dim
        b = _block_prefix(l) + "branches.attn."
        return {
            "q": self.matrix(b + "q_proj.weight", [dq, E]),
            "k": self.matrix(b + "k_proj.weight", [dk, E]),
            "v": self.matrix(b + "v_proj.weight", [dk, E]),
            "o": self.matrix(b + "o_proj.weight", [E, dq]),
            "scale": self.get(derived_name(l, "attn.scale"), [dq]),
        }

    def ffn(self, l: int, i: int) -> dict:
        c = self.config
        E, f = c.d_model, c.ffn_dims[i]
        b = _block_prefix(l) + f"branches.ffn_{i}."
        return {"fc": self.matrix(b + "fc.weight", [f, E]), "fc_b": self.get(b + "fc.bias", [f]),
                "proj": self.matrix(b + "proj.weight", [E, f]), "proj_b": self.get(b + "proj.bias", [E])}

    def branch_norm(self, l: int, name: str) -> Weight:
        E = self.config.d_model
        if self.config.mode == "parallel":
            return self.get(derived_name(l, f"branch_norm.{name}"), [E])
        return self.get(_block_prefix(l) + f"branch_norms.{name}.weight", [E])

    def post_norm(self, l: int, name: str) -> tuple[Weight, Weight]:
        E, p = self.config.d_model, _block_prefix(l)
        key = "post_norm" if self.config.mode == "parallel" else f"post_norms.{name}"
        return self.get(p + key + ".weight", [E]), self.get(p + key + ".bias", [E])


# ------------------------------------------------------------- shared pieces
class _Consts:
    """Graph constants that depend only on the config (RoPE tables, iotas), and the
    per-head spread and sum built on them."""

    def __init__(self, config, device: DeviceRef):
        c = self.config = config
        self.device = device
        dh, half = c.head_dim, c.head_dim // 2
        self._memo: dict = {}
        # inv_freq as the reference computes it (float32), per channel of a head.
        self.inv_freq = (c.rope_base ** (-np.arange(half, dtype=np.float32) / half)).astype(np.float32)
        self.dh, self.half = dh, half

    def _once(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def spread(self, x: TensorValue, groups: int, width: int) -> TensorValue:
        """x [..., groups] -> [..., groups*width]: each value repeated width times."""
        index = self._once(("spread", groups, width), lambda: layers.const(
            np.repeat(np.arange(groups, dtype=np.int64), width), I64, self.device))
        return ops.gather(x, index, axis=x.rank - 1)

    @staticmethod
    def group_sum(x: TensorValue, groups: int, width: int) -> TensorValue:
        """x [..., groups*width] -> [..., groups]: the sum of each group of width channels."""
        lead = list(x.shape[:-1])
        return ops.reshape(ops.sum(ops.reshape(x, lead + [groups, width]), axis=-1), lead + [groups])

    def rope_freq(self, heads: int) -> TensorValue:
        """[1, heads*dh]: the rotation frequency of every channel (pairs (i, i + dh/2))."""
        f = np.tile(np.concatenate([self.inv_freq, self.inv_freq]), heads).reshape(1, -1)
        return self._once(("freq", heads), lambda: layers.const(f, F32, self.device))

    def rope_rotate(self, heads: int) -> TensorValue:
        """[D, D]: x @ R = (-x2, x1) within every head (x1, x2 its two halves)."""
        def make():
            dh, half = self.dh, self.half
            D = heads * dh
            R = np.zeros((D, D), np.float32)
            for h in range(heads):
                for i in range(half):
                    lo, hi = h * dh + i, h * dh + half + i
                    R[hi, lo] = -1.0  # out[lo] = -x[hi]
                    R[lo, hi] = 1.0  # out[hi] = x[lo]
            return layers.const(R, F32, self.device)
        return self._once(("rot", heads), make)

    @property
    def logit_bound(self) -> float:
        """Above every |attention logit|: q, k unit vectors, scale <= logit_scale_max."""
        return float(self.config.logit_scale_max) + 1.0

    def iota_n(self) -> TensorValue:
        """[n] int64: the cache positions 0 .. n-1."""
        n = self.config.context_length
        return self._once("iota", lambda: layers.const(np.arange(n, dtype=np.int64), I64, self.device))



def _l2_normalize(x: TensorValue, heads: int, K: _Consts) -> TensorValue:
    """x [..., heads*dh] -> each head scaled to unit length (F.normalize, eps 1e-12)."""
    sq = K.group_sum(x * x, heads, K.dh)  # [..., heads]
    inv = 1.0 / layers.floor_at(ops.sqrt(sq), 1e-12)
    return x * K.spread(inv, heads, K.dh)


def _rope(x: TensorValue, angle: TensorValue, heads: int, K: _Consts) -> TensorValue:
    """Rotate x [..., heads*dh] by angle (per channel): (x1 cos - x2 sin, x1 sin + x2 cos) per head."""
    return x * ops.cos(angle) + ops.matmul(x, K.rope_rotate(heads)) * ops.sin(angle)


def _qkv(x: TensorValue, pos_f: TensorValue, a: dict, c, K: _Consts):
    """Normalised, rotated q (times the logit scale) and k, and v; flat channels.

    pos_f [..., 1] float32 broadcasts against the rows of x [..., E].
    """
    def rotated(w, heads):
        h = _l2_normalize(linear(x, w), heads, K)
        return _rope(h, pos_f * K.rope_freq(heads), heads, K)

    # logits = scale_h * q.k: the scale rides on q's channels.
    return rotated(a["q"], c.n_q_heads) * a["scale"], rotated(a["k"], c.n_kv_heads), linear(x, a["v"])


def _ffn(x: TensorValue, f: dict) -> TensorValue:
    return linear(ops.gelu(linear(x, f["fc"], f["fc_b"])), f["proj"], f["proj_b"])


def _masked_softmax(logits: TensorValue, keep: TensorValue, bound: float) -> TensorValue:
    """Softmax over the last axis of the entries where ``keep`` (0/1) is 1.

    The mask is applied by multiplication, so a masked entry is exactly 0 whatever
    the logits; ``bound`` >= |logits| puts masked entries below every kept one, so
    the shift is the kept maximum.
    """
    z = logits * keep + (keep - 1.0) * bound
    e = ops.exp(z - ops.max(z, axis=-1)) * keep
    return e / ops.sum(e, axis=-1)


def _block(x: TensorValue, l: int, W: PHAWeights, run) -> TensorValue:
    """The block around ``run(name, h) -> branch output`` (reference ``PHABlock._combine``)."""
    c = W.config
    alpha, eps = c.deepnorm_alpha, c.norm_eps
    if c.mode == "parallel":
        mixed = None
        for name in c.branch_names:  # the mixing weight is folded into the norm's weight
            b = ops.rms_norm(run(name, x), W.branch_norm(l, name), epsilon=eps)
            mixed = b if mixed is None else mixed + b
        w, bias = W.post_norm(l, "")
        return ops.layer_norm(alpha * x + mixed, w, bias, epsilon=eps)
    for name in c.branch_names:
        b = ops.rms_norm(run(name, x), W.branch_norm(l, name), epsilon=eps)
        w, bias = W.post_norm(l, name)
        x = ops.layer_norm(alpha * x + b, w, bias, epsilon=eps)
    return x


def _state_row(found: dict, zero_col: TensorValue) -> TensorValue:
    """One layer's state [B, X] in ``StateLayout`` order."""
    parts = ([found["gss"]] if "gss" in found else []) + (list(found["attn"]) if "attn" in found else [])
    if not parts:
        return zero_col
    return parts[0] if len(parts) == 1 else ops.concat(parts, axis=1)


def _embed(W: PHAWeights, ids: TensorValue) -> TensorValue:
    x = ops.gather(W.embedding(), ids, axis=0)
    return x if x.dtype == F32 else ops.cast(x, F32)


# ------------------------------------------------------------------- prefill
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
             top_p [B] f32, seed [B] uint64, mode [] int64 on the host (``layers.MODE_*``).
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
        nxt = layers.sample(logits, temperature, top_k, top_p, seed, lengths, mode, device)
        g.output(logits, nxt, ops.stack(states, axis=0))
    return g


# -------------------------------------------------------------------- decode
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

    return layers.build_multistep_decode_graph(name or f"pha_decode_{dt}", state_type, make_step, device)
