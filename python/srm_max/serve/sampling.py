"""Sampling parameters: validation, per-sample arrays, and a numpy mirror of
the in-graph sampler (for tests and for anyone checking a distribution).

Every parameter may be a scalar (same for all prompts) or a sequence with one
value per prompt. ``temperature=0`` is greedy; ``top_k=0`` (or -1) and
``top_p=1`` switch those filters off. ``seed=None`` draws a fresh random seed;
a scalar seed s gives prompt i the seed s + i (mod 2**64); a list gives each
prompt its own seed. A sample's tokens depend only on its prompt, its
parameters and its seed, never on the rest of the batch.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from ..errors import GenerationError

_U64_MAX = (1 << 64) - 1


def _per_sample(name: str, value, batch: int) -> list:
    if isinstance(value, (list, tuple, np.ndarray)):
        values = list(np.asarray(value).tolist()) if isinstance(value, np.ndarray) else list(value)
        if len(values) != batch:
            raise GenerationError(
                f"{name}: expected one value or a list of {batch} (one per prompt), got a list of {len(values)}")
        return values
    return [value] * batch


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def check_seed(seed, name: str = "seed") -> int:
    """A seed as an int, or a GenerationError naming ``name``."""
    if not _is_int(seed) or not 0 <= int(seed) <= _U64_MAX:
        raise GenerationError(f"{name} must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def fresh_seed() -> int:
    # 63 bits: the seed also fits a signed int64 (numpy, JSON readers), so reporting it loses nothing.
    return secrets.randbits(63)


def resolve_seed(seed, name: str = "seed") -> int:
    """``seed`` checked, or a fresh random one for ``None``."""
    return fresh_seed() if seed is None else check_seed(seed, name)


@dataclass
class SamplingParams:
    """Validated per-sample parameters (lists of length B)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seed: list[int]

    @classmethod
    def build(cls, batch: int, temperature=0.0, top_k=0, top_p=1.0, seed=None) -> "SamplingParams":
        temps = _per_sample("temperature", temperature, batch)
        for t in temps:
            if not _is_real(t) or not math.isfinite(float(t)) or float(t) < 0:
                raise GenerationError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        ks = _per_sample("top_k", top_k, batch)
        for k in ks:
            if not _is_int(k) or int(k) < -1:
                raise GenerationError(f"top_k must be an integer >= 0, or -1 (0 and -1 = off), got {k!r}")
        ks = [max(int(k), 0) for k in ks]
        ps = _per_sample("top_p", top_p, batch)
        for p in ps:
            if not _is_real(p) or not math.isfinite(float(p)) or not (0 < float(p) <= 1):
                raise GenerationError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if isinstance(seed, (list, tuple, np.ndarray)):
            seeds = [check_seed(s, f"seed[{i}]") for i, s in enumerate(_per_sample("seed", seed, batch))]
        else:
            base = resolve_seed(seed)
            seeds = [(base + i) & _U64_MAX for i in range(batch)]
        return cls([float(t) for t in temps], ks, [float(p) for p in ps], seeds)

    def arrays(self):
        from ..runtime.compiled import SamplingArrays

        return SamplingArrays(np.array(self.temperature, np.float32), np.array(self.top_k, np.int64),
                              np.array(self.top_p, np.float32), np.array(self.seed, np.uint64))


def check_max_new_tokens(max_new_tokens) -> int:
    if not _is_int(max_new_tokens) or int(max_new_tokens) < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    return int(max_new_tokens)


def check_steps_per_call(steps_per_call) -> int:
    if not isinstance(steps_per_call, int) or steps_per_call < 1:
        raise GenerationError(f"steps_per_call must be an integer >= 1, got {steps_per_call!r}")
    return steps_per_call


# ------------------------------------------------------------ numpy mirror
_K0 = np.uint64(0xC8E4FD154CE32F6D)
_K1 = np.uint64(0x9B2D67A3E8F15C47)
_2_32 = np.uint64(1 << 32)


def _rot32(x):
    return x // _2_32 + x * _2_32


def _squares(ctr, key):
    with np.errstate(over="ignore"):
        x = ctr * key
        y = x
        z = y + key
        x = _rot32(x * x + y)
        x = _rot32(x * x + z)
        x = _rot32(x * x + y)
        return (x * x + z) // _2_32


def uniform_np(seed: np.ndarray, counter: np.ndarray, n: int) -> np.ndarray:
    """The graph's uniforms: [B] seeds, [B] counters -> [B, n] float32 in (0, 1)."""
    seed = np.asarray(seed, np.uint64)
    with np.errstate(over="ignore"):
        key = _squares(seed, _K0) * _2_32 + _squares(seed, _K1)
        key = (key // np.uint64(2)) * np.uint64(2) + np.uint64(1)
        ctr = (np.asarray(counter).astype(np.uint64) * np.uint64(n))[:, None] + np.arange(n, dtype=np.uint64)[None]
        bits = _squares(ctr, key[:, None])
    return ((bits // np.uint64(256)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 24))


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution the sampler draws from: [V] logits -> [V] probabilities.

    Temperature, then top-k, then top-p on the renormalised rest, as a threshold
    on the scaled logits: every token tied with the last kept one is kept too. The
    top-p total is the weight of the top-k set summed in token-id order (of the tokens
    tied with the k-th value, the first ones), as graphs/sampler.py sums it.
    """
    logits = np.asarray(logits, np.float64)
    V = logits.shape[-1]
    if temperature <= 0:
        p = np.zeros(V)
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits / max(temperature, 1e-6)
    weight = np.exp(z - z.max())
    if top_k > 0 or top_p < 1:
        vals = np.sort(z)[::-1]
        k = top_k if 0 < top_k <= V else V
        w = np.exp(vals - vals[0]) * (np.arange(V) < k)
        before = np.cumsum(w) - w
        kth = vals[k - 1]
        tie = z == kth
        member = (z > kth) | (tie & (np.cumsum(tie) <= k - (z > kth).sum()))
        total = np.cumsum(weight * member)[-1]
        kept = int(((w > 0) & (before < top_p * total)).sum())
        weight = weight * (z >= vals[kept - 1])
    return weight / weight.sum()


def draw_np(probs: np.ndarray, seed: int, counter: int) -> int:
    """The graph's draw from ``filtered_probs``: the inverse CDF in token-id order
    at the sample's one uniform (``uniform_np(seed, counter, 1)``)."""
    u = float(uniform_np(np.array([seed], np.uint64), np.array([counter]), 1)[0, 0])
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), np.flatnonzero(probs > 0)[-1]))


__all__ = ["SamplingParams", "check_max_new_tokens", "check_steps_per_call", "check_seed", "fresh_seed", "resolve_seed", "uniform_np",
           "filtered_probs", "draw_np"]
