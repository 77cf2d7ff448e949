"""A checkpoint's ``tokenizer.json``: read and checked against the model's vocabulary, the
same way wherever a tokenizer comes in (``srm-max convert``, ``srm-max verify``, ``Generator``)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SRMError
from ..files import check_regular_file


def read_tokenizer(path: str | Path, error: type[SRMError]):
    """The ``tokenizers.Tokenizer`` in ``path``, or ``error`` naming the file and why not."""
    from tokenizers import Tokenizer

    check_regular_file(path, error)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise error(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None


def largest_id(tokenizer) -> int:
    """The largest token id ``tokenizer`` can produce (its added tokens included); -1 for none.

    Not ``get_vocab_size()``: that counts the tokens, and ids need not be dense (a WordLevel
    vocabulary may hold the id 5000 among ten tokens)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)


def check_is_tokenizer(tokenizer, error: type[SRMError], where: str = "") -> None:
    """``error`` naming the argument unless ``tokenizer`` is a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise error(f"{where + ': ' if where else ''}tokenizer: expected a tokenizers.Tokenizer or the path of a "
                    f"tokenizer.json, got {type(tokenizer).__name__}")


def check_vocabulary(tokenizer, vocab_size: int, error: type[SRMError], where: str = "") -> None:
    """``error`` when ``tokenizer`` is not a ``tokenizers.Tokenizer``, or can produce an id the
    model's vocabulary lacks (fewer ids is fine: a model may reserve ids no text produces)."""
    check_is_tokenizer(tokenizer, error, where)
    prefix = f"{where}: " if where else ""
    largest = largest_id(tokenizer)
    if largest >= vocab_size:
        raise error(f"{prefix}tokenizer has {tokenizer.get_vocab_size()} tokens with ids up to {largest}, but the "
                    f"model's vocabulary is {vocab_size} (ids 0 to {vocab_size - 1}): mismatched tokenizer")


__all__ = ["check_is_tokenizer", "check_vocabulary", "largest_id", "read_tokenizer"]
