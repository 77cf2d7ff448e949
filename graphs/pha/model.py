"""The PHA's weights, state layout and the pieces its prefill and decode graphs share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from max.graph import DeviceRef, TensorType, TensorValue, Weight, ops

from .. import ops as gops
from ..op_names import OP_PHA_PREFILL_STATE
from ..ops import F32, I64, Dense, Rows, linear
from .gss import gss_table_shapes, gss_tables


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

    gss: ``gss.gss_tables`` (Lambda = -exp(Lambda_real) + i exp(Lambda_imag),
         Ct = C (Abar - 1) / Lambda): every power of Abar the graphs use.
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
            lam = -np.exp(weights[d + "Lambda_real"].astype(np.float64)) + 1j * np.exp(
                weights[d + "Lambda_imag"].astype(np.float64))
            ct = (weights[d + "C_real"].astype(np.float64) + 1j * weights[d + "C_imag"]) * (np.exp(lam) - 1) / lam
            out |= {derived_name(l, "gss." + k): v for k, v in gss_tables(c, lam, ct).items()}
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


class PHAWeights(gops.NamedWeights):
    """The PHA graph's named weights."""

    def embedding(self) -> Weight:
        c = self.config
        return self.matrix("embed.weight", [c.vocab_size, c.d_model])

    def output(self) -> Weight:
        c = self.config
        return self.embedding() if c.tie_embeddings else self.matrix("lm_head.weight", [c.vocab_size, c.d_model])

    def gss(self, l: int) -> dict:
        c = self.config
        E, F, H = c.d_model, c.gss_expansion_dim, c.gss_hidden_dim
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
        for k, shape in gss_table_shapes(c).items():
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
        index = self._once(("spread", groups, width), lambda: gops.const(
            np.repeat(np.arange(groups, dtype=np.int64), width), I64, self.device))
        return ops.gather(x, index, axis=x.rank - 1)

    @staticmethod
    def group_sum(x: TensorValue, groups: int, width: int) -> TensorValue:
        """x [..., groups*width] -> [..., groups]: the sum of each group of width channels."""
        lead = list(x.shape[:-1])
        return ops.reshape(ops.sum(ops.reshape(x, lead + [groups, width]), axis=-1), lead + [groups])

    def inv_freq_const(self) -> TensorValue:
        """[dh/2]: the RoPE inverse frequencies (the Mojo op's table, ``attention.qk_rope_op``)."""
        return self._once("inv_freq", lambda: gops.const(self.inv_freq, F32, self.device))

    def rope_freq(self, heads: int) -> TensorValue:
        """[1, heads*dh]: the rotation frequency of every channel (pairs (i, i + dh/2))."""
        f = np.tile(np.concatenate([self.inv_freq, self.inv_freq]), heads).reshape(1, -1)
        return self._once(("freq", heads), lambda: gops.const(f, F32, self.device))

    def rotate_half(self, x: TensorValue, heads: int) -> TensorValue:
        """x [..., heads*dh] -> (-x2, x1) within every head (x1, x2 its two halves): each
        channel's partner gathered, times a sign; exact, and no matmul kernel to compile."""
        def make():
            dh, half = self.dh, self.half
            within = np.arange(dh)
            partner = np.where(within < half, within + half, within - half)
            index = (np.arange(heads)[:, None] * dh + partner[None, :]).reshape(-1)
            sign = np.tile(np.where(within < half, -1.0, 1.0), heads).astype(np.float32)
            return gops.const(index, I64, self.device), gops.const(sign, F32, self.device)
        index, sign = self._once(("rotate_half", heads), make)
        return ops.gather(x, index, axis=x.rank - 1) * sign

    @property
    def logit_bound(self) -> float:
        """Above every |attention logit|: q, k unit vectors, scale <= logit_scale_max."""
        return float(self.config.logit_scale_max) + 1.0

    def iota_n(self) -> TensorValue:
        """[n] int64: the cache positions 0 .. n-1."""
        n = self.config.context_length
        return self._once("iota", lambda: gops.const(np.arange(n, dtype=np.int64), I64, self.device))



def _l2_normalize(x: TensorValue, heads: int, K: _Consts) -> TensorValue:
    """x [..., heads*dh] -> each head scaled to unit length (F.normalize, eps 1e-12)."""
    sq = K.group_sum(x * x, heads, K.dh)  # [..., heads]
    inv = 1.0 / gops.floor_at(ops.sqrt(sq), 1e-12)
    return x * K.spread(inv, heads, K.dh)


def _rope(x: TensorValue, angle: TensorValue, heads: int, K: _Consts) -> TensorValue:
    """Rotate x [..., heads*dh] by angle (per channel): (x1 cos - x2 sin, x1 sin + x2 cos) per head."""
    return x * ops.cos(angle) + K.rotate_half(x, heads) * ops.sin(angle)


def _qkv(x: TensorValue, pos_f: TensorValue, a: dict, c, K: _Consts, dense_op: Dense = None):
    """Normalised, rotated q (times the logit scale) and k, and v; flat channels; with
    plain ops (the prefill with the Mojo ops: ``attention.qk_rope_op``).

    pos_f [..., 1] float32 broadcasts against the rows of x [..., E]; ``dense_op``: the
    products through the linear op (``graphs.ops.linear``).
    """
    def rotated(w, heads):
        h = _l2_normalize(linear(x, w, op_device=dense_op), heads, K)
        return _rope(h, pos_f * K.rope_freq(heads), heads, K)

    # logits = scale_h * q.k: the scale rides on q's channels.
    return (rotated(a["q"], c.n_q_heads) * a["scale"], rotated(a["k"], c.n_kv_heads),
            linear(x, a["v"], op_device=dense_op))


def _ffn(x: TensorValue, f: dict, dense_op: Dense = None) -> TensorValue:
    return linear(linear(x, f["fc"], f["fc_b"], dense_op, activation="gelu"), f["proj"], f["proj_b"], dense_op)


def _masked_softmax(logits: TensorValue, keep: TensorValue, bound: float) -> TensorValue:
    """Softmax over the last axis of the entries where ``keep`` (0/1) is 1.

    The mask is applied by multiplication, so a masked entry is exactly 0 whatever
    the logits; ``bound`` >= |logits| puts masked entries below every kept one, so
    the shift is the kept maximum.
    """
    z = logits * keep + (keep - 1.0) * bound
    e = ops.exp(z - ops.max(z, axis=-1)) * keep
    return e / ops.sum(e, axis=-1)


# the branches that carry state out of a prefill (so read every row of it); config order
# puts them before the FFNs
STATE_BRANCHES = ("gss", "attn")


def _block(x: TensorValue, l: int, W: PHAWeights, run, kept: Rows = None) -> TensorValue:
    """The block around ``run(name, h, kept) -> branch output`` (reference ``PHABlock._combine``).

    ``kept`` (a prefill's last block): the block's output only at the rows it keeps. The
    branches that carry state (the GSS and attention, first in block order) still read every
    row, and in parallel mode return their output at the kept rows (``kept`` passed on); the
    rest, and the combine, run on the kept rows alone. Every step is row by row, so those
    rows come out as they would with every row computed.
    """
    c = W.config
    alpha, eps = c.deepnorm_alpha, c.norm_eps
    if c.mode == "parallel":
        at_kept = kept(x) if kept else x
        mixed = None
        for name in c.branch_names:  # the mixing weight is folded into the norm's weight
            out = run(name, x, kept) if name in STATE_BRANCHES else run(name, at_kept, None)
            b = ops.rms_norm(out, W.branch_norm(l, name), epsilon=eps)
            mixed = b if mixed is None else mixed + b
        w, bias = W.post_norm(l, "")
        return ops.layer_norm(alpha * at_kept + mixed, w, bias, epsilon=eps)
    for name in c.branch_names:
        if kept and name not in STATE_BRANCHES:  # each later branch reads this one's output
            x, kept = kept(x), None
        b = ops.rms_norm(run(name, x, None), W.branch_norm(l, name), epsilon=eps)
        w, bias = W.post_norm(l, name)
        x = ops.layer_norm(alpha * x + b, w, bias, epsilon=eps)
    return kept(x) if kept else x


class PrefillStates:
    """Each layer's state [B, X] in ``StateLayout`` order from what a prefill's branches
    found: the GSS state [B, 2HN] and the keys and values at the T prompt positions
    [B, T, Hkv*dh]. Cache row i holds position i for i < T (past a prompt's length, the
    padding's rows, which no decode step reads) and zeros after.

    ``stacked`` gives every layer's state [L, B, X]. With ``by_op`` (a CPU graph with the
    Mojo ops) that is one op (mojo/pha_prefill_state.mojo), which reads every input once and
    writes the states once. Else (``layer`` per layer, then the layers stacked: the GPU path,
    and the op's reference) one gather per layer of whole rows of ``w`` floats from a small
    source: the keys and values transposed head-major, concatenated with the GSS state and
    one zero row. Building each context-long cache first and concatenating the parts is what
    a prefill at a long context spent most of a short prompt's time on: MAX's CPU concat
    copies an inner axis element by element. The row index depends on T alone, so it is
    built once per graph.
    """

    def __init__(self, config, flat_pos: TensorValue, batch, device: DeviceRef, by_op: bool = False):
        c = self.config = config
        self.layout = lay = StateLayout.of(c)
        self.batch, self.device, self.by_op = batch, device, by_op
        dh, n, Hkv = c.head_dim, c.context_length, c.n_kv_heads
        # rows of w floats: whole rows of a cache when w = dh; w divides the GSS state too
        self.w = w = math.gcd(lay.gss, dh) if lay.gss else dh
        self.per_row = s = dh // w  # pieces of w floats per cache row
        self.gss_rows = lay.gss // w
        if not lay.kv or by_op:
            return
        T = ops.max(flat_pos, axis=-1) + 1  # [1]: the prompt positions of this call
        # each piece of the two caches (keys, then values; head-major, then row i, then
        # piece) comes from row (cache * Hkv + head) * T + i of the keys' and values' rows
        piece = np.arange(2 * Hkv * n * s, dtype=np.int64)
        within, row = piece % s, piece // s
        i, cache_head = row % n, row // n
        i_t, cache_head_t = gops.const(i, I64, device), gops.const(cache_head, I64, device)
        source = self.gss_rows + (cache_head_t * T + i_t) * s + gops.const(within, I64, device)
        zero_row = self.gss_rows + 2 * Hkv * T * s  # after every row of keys and values
        inside = ops.cast(i_t < T, I64)
        kv_index = inside * source + (1 - inside) * zero_row
        gss_index = gops.const(np.arange(self.gss_rows, dtype=np.int64), I64, device)
        self.index = ops.concat([gss_index, kv_index], axis=0) if self.gss_rows else kv_index

    def layer(self, found: dict) -> TensorValue:
        """One layer's state [B, X] from ``found`` (``"gss"``: [B, 2HN]; ``"attn"``: the
        keys and values at the prompt positions)."""
        B, w, c = self.batch, self.w, self.config
        if "attn" not in found:
            return found["gss"] if "gss" in found else ops.broadcast_to(
                gops.const(np.zeros((1, 1), np.float32), F32, self.device), [B, 1])
        parts = [ops.reshape(found["gss"], [B, self.gss_rows, w])] if "gss" in found else []
        for t in found["attn"]:  # [B, T, Hkv*dh] -> [B, Hkv*T*per_row, w], head-major
            heads = ops.permute(ops.reshape(t, [B, -1, c.n_kv_heads, c.head_dim]), [0, 2, 1, 3])
            parts.append(ops.reshape(heads, [B, -1, w]))
        parts.append(ops.broadcast_to(gops.const(np.zeros((1, 1, w), np.float32), F32, self.device), [B, 1, w]))
        return ops.reshape(ops.gather(ops.concat(parts, axis=1), self.index, axis=1), [B, -1])

    def stacked(self, found: list[dict]) -> TensorValue:
        """Every layer's state [L, B, X] from what each layer found (``layer``'s ``found``)."""
        if not self.by_op or not (self.layout.gss or self.layout.kv):
            return ops.stack([self.layer(f) for f in found], axis=0)
        B, c = self.batch, self.config
        parts = []
        for f in found:
            parts += [ops.reshape(f["gss"], [B, 1, 1, -1])] if "gss" in f else []
            parts += [ops.reshape(t, [B, -1, c.n_kv_heads, c.head_dim]) for t in f.get("attn", ())]
        (states,) = ops.custom(OP_PHA_PREFILL_STATE, device=self.device, values=parts,
                               out_types=[TensorType(F32, [len(found), B, self.layout.width], self.device)])
        return states.tensor


def _embed(W: PHAWeights, ids: TensorValue) -> TensorValue:
    x = ops.gather(W.embedding(), ids, axis=0)
    return x if x.dtype == F32 else ops.cast(x, F32)
