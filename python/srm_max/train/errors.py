"""The trainer's error type: a bad argument, input file or output directory, named with its cause."""

from __future__ import annotations

from ..errors import SRMError


class TrainError(SRMError, ValueError):
    """A training argument, tokenizer, text file, output directory or checkpoint is unusable;
    ``srm-max train`` prints it as one line and exits 2."""


__all__ = ["TrainError"]
