"""bfloat16, which numpy lacks, as uint16 bit patterns: the conversions the checkpoint
files and the engines' bfloat16 weights share, so both round the same way."""

from __future__ import annotations

import numpy as np

_QUIET_NAN = 0x7FC0


def to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch does;
    NaN stays NaN."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    out = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = _QUIET_NAN
    return out


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def bfloat16_round(a: np.ndarray) -> np.ndarray:
    """What a float32 array looks like after a trip through bfloat16."""
    return from_bfloat16_bits(to_bfloat16_bits(a))


__all__ = ["bfloat16_round", "from_bfloat16_bits", "to_bfloat16_bits"]
