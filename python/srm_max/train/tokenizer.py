"""Train the default model's tokenizer: a byte-level BPE with ``tokenizers``.

Byte-level (GPT-2 style) so that every string round-trips exactly and no text
is ever out of vocabulary; one special token, ``<|endoftext|>`` (id 0), that
separates documents. Trained on the training split of the corpus only, so the
validation plays never shape the vocabulary.

    python -m srm_max.train.tokenizer --out tokenizer.json [--vocab-size 4096]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from ..files import atomic_file
from .corpus import END_OF_TEXT, load_plays

DEFAULT_VOCAB_SIZE = 4096


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must be at least 258 (256 bytes + special), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_default_tokenizer(out: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train on the corpus's training split and save ``tokenizer.json`` at ``out``."""
    tok = train_bpe(load_plays("train").values(), vocab_size=vocab_size)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp:
        tok.save(str(tmp))
    return tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m srm_max.train.tokenizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tokenizer.json", help="where to write tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = p.parse_args(argv)
    tok = train_default_tokenizer(args.out, args.vocab_size)
    print(f"wrote {args.out}: vocab {tok.get_vocab_size()}, "
          f"{END_OF_TEXT} = {tok.token_to_id(END_OF_TEXT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
