"""What the engine calls take and return (``runtime/compiled.py``): per-sample sampling
parameters and the results of prefill, score and decode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from max.driver import Buffer

from ..graphs.sampler import MODE_FILTERED, MODE_GREEDY, MODE_PLAIN


@dataclass
class SamplingArrays:
    """Per-sample sampling parameters, as the graphs take them."""

    temperature: np.ndarray  # [B] float32, 0 = greedy
    top_k: np.ndarray  # [B] int64, 0 = off
    top_p: np.ndarray  # [B] float32, 1 = off
    seed: np.ndarray  # [B] uint64

    @classmethod
    def greedy(cls, batch: int) -> "SamplingArrays":
        return cls(np.zeros(batch, np.float32), np.zeros(batch, np.int64),
                   np.ones(batch, np.float32), np.zeros(batch, np.uint64))

    def take(self, index) -> "SamplingArrays":
        return SamplingArrays(self.temperature[index], self.top_k[index], self.top_p[index], self.seed[index])

    def mode(self) -> int:
        """The cheapest in-graph sampler that serves every sample (``graphs.sampler.MODE_*``)."""
        drawn = self.temperature > 0
        if not drawn.any():
            return MODE_GREEDY
        filtered = (self.top_k[drawn] > 0) | (self.top_p[drawn] < 1)
        return MODE_FILTERED if filtered.any() else MODE_PLAIN


@dataclass
class PrefillResult:
    logits: Buffer  # [B, V] float32 at each prompt's last token (on the device)
    next_ids: np.ndarray  # [B] int64 the first new token
    states: Buffer  # [L, B, H, hd] float32 (on the device)
    scores: "DecodeResult | None" = None  # prefill(..., logprobs=n): the first tokens' (runtime/drawn.py)


@dataclass
class ScoreResult:
    """Per sample b, at each position t < T_b: the log-probability of targets[b][t] after
    reading inputs[b][:t+1], and the n most likely tokens there (descending, ties by
    lower id) with their log-probabilities."""

    logprobs: list[np.ndarray]  # [T_b] float32 each
    top_ids: list[np.ndarray]  # [T_b, n] int64
    top_logprobs: list[np.ndarray]  # [T_b, n] float32
    states: Buffer  # the state after each sample's last input, as PrefillResult.states (on the device)


@dataclass
class DecodeResult:
    tokens: np.ndarray  # [B, S] int64
    states: Buffer  # ready to take ids
    ids: Buffer  # [B] = tokens[:, -1]
    positions: Buffer  # [B] = their positions
    # with decode(..., logprobs=n): each token's raw log-probability and the n likeliest at each step
    logprobs: np.ndarray | None = None  # [B, S] float32
    top_ids: np.ndarray | None = None  # [B, S, n] int64
    top_logprobs: np.ndarray | None = None  # [B, S, n] float32


__all__ = ["DecodeResult", "PrefillResult", "SamplingArrays", "ScoreResult"]
