"""Weights held to their schema (checkpoint key -> shape): what is missing, unexpected or
the wrong shape, worded once for the checkpoint reader and for the engines."""

from __future__ import annotations

from collections.abc import Mapping


def shape_problem(expected: Mapping[str, tuple], shapes: Mapping[str, tuple], allow_unexpected: bool = False
                  ) -> str | None:
    """None when ``shapes`` (key -> shape) has every key of ``expected`` with its shape (and,
    unless ``allow_unexpected``, no other key); else what is wrong, the first case named."""
    missing = [k for k in expected if k not in shapes]
    if missing:
        return f"missing key {missing[0]!r}{_and_more(missing)}"
    unexpected = [] if allow_unexpected else [k for k in shapes if k not in expected]
    if unexpected:
        return f"unexpected key {unexpected[0]!r}{_and_more(unexpected)}"
    for key, shape in expected.items():
        if tuple(shapes[key]) != tuple(shape):
            return (f"{key!r} has shape {list(shapes[key])} but the config implies {list(shape)} "
                    "(config and tensors disagree)")
    return None


def _and_more(keys: list) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


__all__ = ["shape_problem"]
