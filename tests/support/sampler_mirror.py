"""The in-graph sampler (graphs/sampler.py, mojo/row_sampler.mojo) written again in numpy,
as the tests' statement of what a draw is: ``filtered_probs`` is the distribution a
sample is drawn from (temperature, then top-k, then top-p), ``uniform_np`` the
counter-based uniforms (Squares with the graph's keys), ``draw_np`` the inverse CDF in
token-id order at the sample's one uniform. The engine tests hold the graphs' tokens
equal to these."""

from __future__ import annotations

import numpy as np

from srm_max.graphs.sampler import SQUARES_KEYS

_K0, _K1 = (np.uint64(k) for k in SQUARES_KEYS)
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
