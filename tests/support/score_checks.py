"""The score ops' outputs against numpy's float64 log_softmax (tests/models/srm/test_score_rows.py,
test_score_head.py): the targets' log-probabilities and the K largest values within 1e-4, the
ids exactly as a stable argsort orders them (of equal logits the lower id first)."""

from __future__ import annotations

import numpy as np

ATOL = 1e-4


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_scores(lp: np.ndarray, values: np.ndarray, ids: np.ndarray, logits: np.ndarray, targets: np.ndarray,
                 K: int):
    """An op's (logprobs [R], top_values [R, K], top_ids [R, K]) for ``logits`` [R, V] and ``targets`` [R]."""
    ref = log_softmax64(logits)
    np.testing.assert_allclose(lp, ref[np.arange(len(ref)), targets], rtol=0, atol=ATOL)
    expected = np.argsort(-logits, axis=-1, kind="stable")[:, :K]  # ties: the lower id first
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_allclose(values, np.take_along_axis(ref, expected, -1), rtol=0, atol=ATOL)
