"""What counts as an integer or a real number where the package checks an argument, a
config field or a file header: Python counts ``True`` as the integer 1, and a flag passed
where a number belongs is a mistake to name, never a value to use."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np


def is_int(value) -> bool:
    """An integer, Python's or numpy's, and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_plain_int(value) -> bool:
    """A Python int and not a bool: what a JSON file holds and what a config writes back."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number (an integer or a float, Python's or numpy's), and not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def is_plain_real(value) -> bool:
    """A Python int or float and not a bool (a JSON number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def out_of_range(settings, int_minima: Mapping[str, int] | None = None,
                 real_ranges: Mapping[str, tuple[Callable[[float], bool], str]] | None = None
                 ) -> tuple[str, str, object] | None:
    """The first attribute of ``settings`` out of its range, as (name, what it must be, its
    value), or None: ``int_minima`` an integer of at least that much, in order, then
    ``real_ranges`` a finite real number the predicate accepts (worded as given)."""
    for name, smallest in (int_minima or {}).items():
        value = getattr(settings, name)
        if not is_int(value) or value < smallest:
            return name, f"an integer >= {smallest}", value
    for name, (accepts, wording) in (real_ranges or {}).items():
        value = getattr(settings, name)
        if not is_real(value) or not math.isfinite(value) or not accepts(value):
            return name, wording, value
    return None


__all__ = ["is_int", "is_plain_int", "is_plain_real", "is_real", "out_of_range"]
