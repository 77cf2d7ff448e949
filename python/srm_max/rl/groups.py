"""Scoring many samples of a verifiable task: pass@k and balanced GRPO groups.

``pass_at_k`` is the unbiased estimator of Chen et al. (2021): from n samples of
which c are correct, the probability that at least one of k drawn without
replacement is correct, 1 - C(n-c, k) / C(n, k), computed as a stable product.

``balanced_group`` is the paper's balanced resampling: from many scored
completions build a training group of fixed size G that mixes correct and
incorrect ones (up to G/2 correct, filled with incorrect, and with more
correct when incorrect ones run short), so group-normalised advantages are
rarely all zero.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from ..scalars import is_int, is_real


def _finite_rewards(rewards: Sequence[float], who: str) -> list[float]:
    """``rewards`` as floats (a verifier's bool too), or a ValueError naming the first that is
    not a finite number (a NaN would count as neither correct nor incorrect, and would make
    every advantage NaN)."""
    out = []
    for i, r in enumerate(rewards):
        if not (is_real(r) or isinstance(r, (bool, np.bool_))) or not math.isfinite(r):
            raise ValueError(f"{who}: reward {i} is {r!r}, not a finite number")
        out.append(float(r))
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not is_int(value):
            raise ValueError(f"pass_at_k: {name} must be an integer, got {value!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over problems, each sampled n times with ``correct_counts[i]`` correct."""
    return float(np.mean([pass_at_k(n, c, k) for c in correct_counts]))


def balanced_group(rewards: Sequence[float], group_size: int, rng: random.Random | None = None) -> list[int]:
    """Indices of a balanced group drawn from completions scored ``rewards`` (1 = correct).

    Takes up to G/2 correct ones, fills with incorrect ones, and if incorrect
    ones run short fills the rest with more correct ones. With fewer than G
    completions in all, every one is used (the group is smaller than G).
    """
    if not is_int(group_size) or group_size < 1:
        raise ValueError(f"balanced_group: group_size must be an integer >= 1, got {group_size!r}")
    rewards = _finite_rewards(rewards, "balanced_group")
    rng = rng or random.Random(0)
    correct = [i for i, r in enumerate(rewards) if r > 0]
    wrong = [i for i, r in enumerate(rewards) if r <= 0]
    rng.shuffle(correct)
    rng.shuffle(wrong)
    take_correct = min(len(correct), group_size // 2)
    take_wrong = min(len(wrong), group_size - take_correct)
    take_correct = min(len(correct), group_size - take_wrong)  # refill with correct if wrong ran short
    group = correct[:take_correct] + wrong[:take_wrong]
    rng.shuffle(group)
    return group


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> np.ndarray:
    """GRPO's group-normalised advantages (r - mean) / (std + eps).

    ``std`` is the unbiased one (ddof=1), torch's default, as in the reference
    GRPO code. A group of identical rewards, or of one sample, has zero advantages.
    """
    r = np.asarray(_finite_rewards(rewards, "group_advantages"), dtype=np.float64)
    if r.size < 2:
        return np.zeros_like(r)  # the unbiased std of one sample is undefined; it is its own mean
    return (r - r.mean()) / (r.std(ddof=1) + eps)
