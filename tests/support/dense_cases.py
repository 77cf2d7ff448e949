"""Inputs shared by the tests of the dense layer ops (tests/models/srm/test_linear_op.py,
tests/models/pha/test_linear_packed_op.py): exact small values, and a case with many rows."""

from __future__ import annotations

import numpy as np


def eighths(rng, shape, spread: int = 3) -> np.ndarray:
    """Values k / 8 for integers |k| <= spread: products and sums of them are exact in float32."""
    return (rng.integers(-spread, spread + 1, shape) / 8).astype(np.float32)


def many_rows() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x [4003, 96], w [130, 96], b [130], x @ w^T + b in float64): random (inexact) values,
    enough blocks of rows that every core takes some."""
    rng = np.random.default_rng(5)
    R, K, N = 4003, 96, 130
    x = rng.standard_normal((R, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / 8).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    return x, w, b, x.astype(np.float64) @ w.astype(np.float64).T + b
