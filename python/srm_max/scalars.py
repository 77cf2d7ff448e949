"""What counts as an integer or a real number where the package checks an argument, a
config field or a file header: Python counts ``True`` as the integer 1, and a flag passed
where a number belongs is a mistake to name, never a value to use."""

from __future__ import annotations

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


__all__ = ["is_int", "is_plain_int", "is_plain_real", "is_real"]
