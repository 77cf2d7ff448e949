"""``TokenTexts`` and ``token_pieces`` (serve/logprobs.py): the texts of a run of tokens
decoded in one batch call equal token-by-token decoding, for byte-level tokens that split
characters (broken UTF-8 included) and the embedded model's tokenizer; the top-n rows built
all at once equal row by row, two ids of one text keeping the likelier. No graphs."""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.serve.logprobs import TokenTexts, token_pieces
from srm_max.serve.scoring import Scores
from tests.support.tiny import TINY
from tests.support.tokenizers import byte_level_tokenizer


def embedded_tokenizer():
    from srm_max.checkpoints.format import TOKENIZER_FILE
    from srm_max.checkpoints.tokenizer import read_tokenizer
    from srm_max.embedded import EMBEDDED_MODEL_DIR

    return read_tokenizer(EMBEDDED_MODEL_DIR / TOKENIZER_FILE, ValueError)


@pytest.fixture(scope="module", params=["byte_level", "embedded"])
def tokenizer(request):
    return byte_level_tokenizer() if request.param == "byte_level" else embedded_tokenizer()


def test_pieces_from_single_texts_equal_token_by_token(tokenizer):
    """With each id's text alone (``single``) the pieces are those texts where the decoder
    joins them (two decodes for the run), else the token-by-token loop's: the same
    either way."""
    decodes = []

    def decode(ids):
        decodes.append(len(ids))
        return tokenizer.decode(ids)

    texts = TokenTexts(tokenizer.decode)
    rng = np.random.default_rng(31)
    V = tokenizer.get_vocab_size()
    joined = 0
    for _ in range(200):
        ids = rng.integers(0, V, rng.integers(1, 40)).tolist()  # valid and broken UTF-8 alike
        k = int(rng.integers(0, len(ids)))
        for before, run, final in ((ids[:k], ids[k:], True), ([], ids, True), ([], ids[:k + 1], False)):
            want = token_pieces(tokenizer.decode, run, before, final)
            decodes.clear()
            assert token_pieces(decode, run, before, final, single=texts.one) == want
            joined += len(decodes) == 2 and len(run) > 1
        assert "".join(token_pieces(decode, ids, single=texts.one)) == tokenizer.decode(ids)
    assert joined  # some runs took the two decodes, the others the loop (a character split across tokens)


def test_tops_at_once_equal_row_by_row():
    tok = byte_level_tokenizer()
    texts = TokenTexts(tok.decode)
    # the first bytes of a multi-byte character alone decode to U+FFFD: several ids share that text
    same = [t for t in range(TINY.vocab_size) if tok.decode([t]) == "\ufffd"]
    assert len(same) >= 2
    rng = np.random.default_rng(32)
    ids = [list(rng.permutation(TINY.vocab_size)[:5]) for _ in range(30)] + [same[:2] + [1, 2, 3]]
    values = [sorted(rng.normal(size=5).tolist(), reverse=True) for _ in ids]
    ids = [[int(t) for t in row] for row in ids]
    rows = texts.tops(ids, values)
    for row, i, v in zip(rows, ids, values):
        want: dict = {}
        for t, x in zip(i, v):
            want.setdefault(tok.decode([t]), x)
        assert row == want and list(row) == list(want)
    assert rows[-1]["\ufffd"] == values[-1][0]  # the likelier of the two ids with one text
    no_text = TokenTexts(lambda ids: None)
    assert no_text.tops(ids[:1], values[:1]) == [dict(zip(ids[0], values[0]))]
    assert texts.top(np.array(ids[0]), np.array(values[0]), 3) == dict(list(rows[0].items())[:3])


def test_logprobs_of_a_shared_token_texts_equal_a_fresh_ones_token_by_token(monkeypatch):
    """``TokenTexts.logprobs`` (the pieces from single texts, the alternatives' texts kept
    across calls) equals the token-by-token pieces and a fresh TokenTexts, call after call."""
    import srm_max.serve.logprobs as logprobs_module

    tok = embedded_tokenizer()
    rng = np.random.default_rng(33)
    V = tok.get_vocab_size()
    shared = TokenTexts(tok.decode)
    for _ in range(3):
        prompt, ids = rng.integers(0, V, 12).tolist(), rng.integers(0, V, 30).tolist()
        scores = Scores(np.array(ids), rng.normal(size=30).astype(np.float32), rng.integers(0, V, (30, 4)),
                        -np.sort(rng.random((30, 4)), -1).astype(np.float32))
        got = shared.logprobs(ids, scores, 3, before=prompt, offset=5)
        assert got.tokens == token_pieces(tok.decode, ids, prompt)
        assert got.text_offset[0] == 5 and len(got.top_logprobs) == 30
        with monkeypatch.context() as m:
            m.setattr(logprobs_module, "_joined_pieces", lambda *args: None)  # the loop only
            assert TokenTexts(tok.decode).logprobs(ids, scores, 3, before=prompt, offset=5) == got
