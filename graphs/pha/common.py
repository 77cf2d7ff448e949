"""Pieces of the PHA graphs that prefill and decode share: constants, RoPE, the
q/k/v projections, the FFN branch, a masked softmax and the block around the branches.

MAX 26.7 CPU workarounds (docs/avx2_crash.md): nothing broadcasts a size-1 head axis
against a reshaped matmul result (operands are broadcast explicitly), no small one-hot
matmul runs inside the decode loop (per-head values are spread by a gather and summed
by a reshape and a sum), and masks apply by multiplication (``masked_softmax``).
"""

from __future__ import annotations

import numpy as np
from max.graph import DeviceRef, TensorValue, ops

from ..ops import F32, I64, const, floor_at, linear
from .weights import PHAWeights


class Consts:
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

    def once(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def spread(self, x: TensorValue, groups: int, width: int) -> TensorValue:
        """x [..., groups] -> [..., groups*width]: each value repeated width times."""
        index = self.once(("spread", groups, width), lambda: const(
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
        return self.once(("freq", heads), lambda: const(f, F32, self.device))

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
            return const(R, F32, self.device)
        return self.once(("rot", heads), make)

    @property
    def logit_bound(self) -> float:
        """Above every |attention logit|: q, k unit vectors, scale <= logit_scale_max."""
        return float(self.config.logit_scale_max) + 1.0

    def iota_n(self) -> TensorValue:
        """[n] int64: the cache positions 0 .. n-1."""
        n = self.config.context_length
        return self.once("iota", lambda: const(np.arange(n, dtype=np.int64), I64, self.device))


def l2_normalize(x: TensorValue, heads: int, K: Consts) -> TensorValue:
    """x [..., heads*dh] -> each head scaled to unit length (F.normalize, eps 1e-12)."""
    sq = K.group_sum(x * x, heads, K.dh)  # [..., heads]
    inv = 1.0 / floor_at(ops.sqrt(sq), 1e-12)
    return x * K.spread(inv, heads, K.dh)


def rope(x: TensorValue, angle: TensorValue, heads: int, K: Consts) -> TensorValue:
    """Rotate x [..., heads*dh] by angle (per channel): (x1 cos - x2 sin, x1 sin + x2 cos) per head."""
    return x * ops.cos(angle) + ops.matmul(x, K.rope_rotate(heads)) * ops.sin(angle)


def qkv(x: TensorValue, pos_f: TensorValue, a: dict, c, K: Consts):
    """Normalised, rotated q (times the logit scale) and k, and v; flat channels.

    pos_f [..., 1] float32 broadcasts against the rows of x [..., E].
    """
    def rotated(w, heads):
        h = l2_normalize(linear(x, w), heads, K)
        return rope(h, pos_f * K.rope_freq(heads), heads, K)

    # logits = scale_h * q.k: the scale rides on q's channels.
    return rotated(a["q"], c.n_q_heads) * a["scale"], rotated(a["k"], c.n_kv_heads), linear(x, a["v"])


def ffn(x: TensorValue, f: dict) -> TensorValue:
    return linear(ops.gelu(linear(x, f["fc"], f["fc_b"])), f["proj"], f["proj_b"])


def masked_softmax(logits: TensorValue, keep: TensorValue, bound: float) -> TensorValue:
    """Softmax over the last axis of the entries where ``keep`` (0/1, logits' shape) is 1.

    The mask is applied by multiplication, so a masked entry is exactly 0 whatever
    the logits; ``bound`` >= |logits| puts masked entries below every kept one, so
    the shift is the kept maximum.
    """
    z = logits * keep + (keep - 1.0) * bound
    e = ops.exp(z - ops.max(z, axis=-1)) * keep
    return e / ops.sum(e, axis=-1)


def block(x: TensorValue, l: int, W: PHAWeights, run) -> TensorValue:
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


def embed(W: PHAWeights, ids: TensorValue) -> TensorValue:
    x = ops.gather(W.embedding(), ids, axis=0)
    return x if x.dtype == F32 else ops.cast(x, F32)


def ffn_index(name: str) -> int:
    return int(name.removeprefix("ffn_"))
