"""Numeric comparisons of MAX results with the references."""

from __future__ import annotations

import numpy as np


def assert_close_rel(actual, expected, rel=1e-4):
    """max |actual - expected| <= rel * max |expected|."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = np.abs(expected).max()
    err = np.abs(actual - expected).max()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"
