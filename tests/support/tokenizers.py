"""Small tokenizers over the TINY vocabulary, for tests that need text."""

from __future__ import annotations

from tests.support.tiny import TINY


def word_tokenizer(size: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    return tok


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map: the alphabet of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def byte_level_tokenizer(size: int = TINY.vocab_size):
    """A byte-level BPE of ``size`` tokens in which most characters are split across tokens:
    every 1-4 byte piece of a short text of 1-4 byte characters (single bytes first)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    data = "ab é€😀中 üx".encode()
    pieces = list(dict.fromkeys(data[i: i + n] for n in (1, 2, 3, 4) for i in range(len(data) - n + 1)))[:size]
    chars = _byte_chars()
    tok = Tokenizer(BPE({"".join(chars[b] for b in piece): i for i, piece in enumerate(pieces)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert tok.get_vocab_size() == size
    return tok


def word_tokenizer_with_eot(size: int = TINY.vocab_size):
    """Words w1..w{size-1} and <|endoftext|> at id 0, as `srm-max train` writes it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({"<|endoftext|>": 0} | {f"w{i}": i for i in range(1, size)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return tok
