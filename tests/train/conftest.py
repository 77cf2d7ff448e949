"""Fixtures of the trainer's tests: a small tokenizer and texts for the command line."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def corpus_args(tmp_path_factory) -> list[str]:
    """A small byte-level BPE and train/val texts: the trainer's data arguments."""
    from srm_max.train.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("corpus")
    text = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300))
    train_bpe([text], vocab_size=300).save(str(folder / "tokenizer.json"))
    (folder / "train.txt").write_text(text)
    (folder / "val.txt").write_text(text[:2000])
    return ["--tokenizer", str(folder / "tokenizer.json"), "--train-text", str(folder / "train.txt"),
            "--val-text", str(folder / "val.txt")]
