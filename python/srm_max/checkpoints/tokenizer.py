"""A checkpoint's ``tokenizer.json``: read and checked against the model's vocabulary, the
same way wherever a tokenizer comes in (``srm-max convert``, ``Generator``)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SRMError


def read_tokenizer(path: str | Path, error: type[SRMError]):
    """The ``tokenizers.Tokenizer`` in ``path``, or ``error`` naming the file and why not."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise error(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None


def check_vocabulary(tokenizer, vocab_size: int, error: type[SRMError], where: str = "") -> None:
    """``error`` when ``tokenizer`` has ids the model's vocabulary lacks (fewer is fine: a
    model may reserve ids no text produces)."""
    size = tokenizer.get_vocab_size()
    if size > vocab_size:
        raise error(f"{where + ': ' if where else ''}tokenizer has {size} tokens but the model's vocabulary is "
                    f"{vocab_size}: mismatched tokenizer")


__all__ = ["check_vocabulary", "read_tokenizer"]
