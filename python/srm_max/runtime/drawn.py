"""The log-probabilities of the tokens a graph draws (the prefill graphs' first new
token, the sample graph's, the plain decode graphs' at each step; ``graphs/sampler.py``
``drawn_logprobs``): the graphs' ``scored`` input, and their outputs on the host as the
fields of a ``DecodeResult``.

Asked for at run time, so one compiled graph serves calls with and without them."""

from __future__ import annotations

import numpy as np
from max.driver import Buffer

from ..errors import GenerationError
from ..graphs.scoring import TOP_N
from ..scalars import is_int


def check_logprobs(logprobs: int | None) -> None:
    """Refuse a ``logprobs`` that is neither None nor 0 .. TOP_N (alternatives per token)."""
    if logprobs is not None and not (is_int(logprobs) and 0 <= logprobs <= TOP_N):
        raise GenerationError(f"logprobs must be None or an integer from 0 to {TOP_N}, got logprobs={logprobs!r}")


def scored_input(logprobs: int | None) -> Buffer:
    """The ``scored`` input [] int64 (host): 1 with ``logprobs`` (0 .. TOP_N alternatives,
    checked), 0 without (None)."""
    check_logprobs(logprobs)
    return Buffer.from_numpy(np.array(int(logprobs is not None), np.int64))


def one_step_scores(lp: np.ndarray, values: np.ndarray, top: np.ndarray, top_n: int) -> tuple[np.ndarray, ...]:
    """A drawing graph's log-probabilities [N] and top values and ids [N, K] -> a one-step
    ``DecodeResult``'s (logprobs [N, 1], top_ids [N, 1, top_n], top_logprobs [N, 1, top_n])."""
    return steps_scores(lp[:, None], values[:, None], top[:, None], top_n)


def steps_scores(lp: np.ndarray, values: np.ndarray, top: np.ndarray, top_n: int) -> tuple[np.ndarray, ...]:
    """A drawing graph's log-probabilities [B, S] and the K likeliest tokens' values and ids
    [B, S, K] (K >= top_n) -> a ``DecodeResult``'s (logprobs [B, S], top_ids [B, S, top_n],
    top_logprobs [B, S, top_n]): the first ``top_n`` alternatives, descending, ties by
    lower id (as ``score`` and the decode ops)."""
    order = np.lexsort((top, -values), axis=-1)[..., :top_n]
    return lp, np.take_along_axis(top, order, -1), np.take_along_axis(values, order, -1)


__all__ = ["check_logprobs", "one_step_scores", "scored_input", "steps_scores"]
