"""Log-probabilities as users get them: per-token numbers with the tokens' text, and the
lm-eval quantities (``loglikelihood``, ``loglikelihood_rolling``), for ``Generator``.

All of it is computed by the engine's scoring (``serve.scoring``): each token's
log-probability under the model's raw distribution, log_softmax of the logits with no
temperature and no top-k/top-p, whatever parameters sampled it (as vLLM's default
"raw" log-probabilities).

Texts longer than the context (or than ``max_length``) are scored in lm-eval's
``loglikelihood_rolling`` windows (``scoring.rolling_windows``): disjoint windows of
``max_length`` predicted tokens, each read from its start with only the token(s)
before it as context, so no token is scored with more than ``max_length`` tokens of
context and no state passes between windows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ..errors import GenerationError
from .sampling import check_prompts, check_text, is_int, token_ids
from .scoring import Scores, check_top_n, rolling_windows, score_continuations, score_windows

END_OF_TEXT = "<|endoftext|>"  # the document separator `srm-max train` writes (train.corpus.END_OF_TEXT)
REQUESTS_PER_BATCH = 256  # loglikelihood requests handed to the engine together (contexts never split)


@dataclass
class Logprobs:
    """The log-probabilities of a run of tokens.

    ``logprobs[i]`` is token i's, after the tokens before it (``None`` for a text's
    first token, which has no context). ``top_logprobs[i]`` (when top-n alternatives
    were asked for, else ``None``) maps the n most likely tokens at that place to their
    log-probabilities, keyed by token text with a tokenizer (by id without one; two ids
    with the same text keep the likelier), and ``top_ids[i]`` lists their ids, most
    likely first. ``tokens[i]`` is the text token i adds (``""`` for a token holding
    the first bytes of a character that a later token completes, which carries the
    character), so the tokens add up to the decoded text; ``text_offset[i]`` is where
    it starts in that text. Both are ``None`` without a tokenizer.
    """

    ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict | None] | None = None
    top_ids: list[list[int] | None] | None = None
    tokens: list[str] | None = None
    text_offset: list[int] | None = None

    @property
    def total(self) -> float:
        """The sum of the log-probabilities (the first token's ``None`` left out)."""
        return float(sum(v for v in self.logprobs if v is not None))


_WINDOW = 8  # tokens decoded around each one: more than the bytes of any character


def token_pieces(decode: Callable[[list[int]], str], ids: Sequence[int], before: Sequence[int] = (),
                 final: bool = True, single: Callable[[int], str] | None = None) -> list[str]:
    """The text each of ``ids`` adds after the tokens ``before``. A token that ends
    inside a character (a byte-level tokenizer's first bytes of it, decoded as U+FFFD)
    adds ``""`` and the token that completes it adds the character, so the pieces add
    up to the decoded text; with ``final`` the last token also takes whatever is still
    incomplete (unless more tokens will follow, as in a stream).

    Each piece is the difference of two decodes of the same few tokens before it, so
    that a decoder's rule for the start of a text (a leading space dropped) cancels.
    ``single`` (an id -> its text alone, e.g. ``TokenTexts.one``'s cache): where the
    decoder simply joins those texts, they are the pieces (two decodes in all)."""
    tokens = list(before) + [int(t) for t in ids]
    if single is not None and ids:
        pieces = _joined_pieces(decode, single, tokens, len(before))
        if pieces is not None:
            return pieces
    out, text = [], ""
    held = len(before)  # the first token whose text may still be held back
    for i in range(len(before), len(tokens)):
        lo = max(0, min(i + 1, held) - _WINDOW)  # the window starts before any held text
        prev, text = decode(tokens[lo:i]), decode(tokens[lo:i + 1])
        out.append(text.rstrip("\ufffd")[len(prev.rstrip("\ufffd")):])
        if not text.endswith("\ufffd"):
            held = i + 1
    if out and final:
        out[-1] += text[len(text.rstrip("\ufffd")):]
    return out


def _joined_pieces(decode, single, tokens: list[int], first: int) -> list[str] | None:
    """``token_pieces`` of ``tokens[first:]`` as each token's text alone, or None unless the
    decoder simply joins them there: the run decoded after the window of tokens before it
    is that window's text and then theirs, with no U+FFFD (no character split across
    tokens, nor held back at the window's end). Then every window the token-by-token loop
    decodes joins so too."""
    pieces = [single(t) for t in tokens[first:]]
    joined = "".join(pieces)
    window = tokens[max(0, first - _WINDOW):first]
    head = decode(window)
    if "\ufffd" in joined or head.endswith("\ufffd") or decode(window + tokens[first:]) != head + joined:
        return None
    return pieces


class TokenTexts:
    """Token texts for ``Logprobs``, decoding each id alone once (a ``Generator`` keeps one
    for all its calls): the alternatives' texts, and the tokens' where the decoder joins
    them (``token_pieces``)."""

    def __init__(self, decode: Callable[[list[int]], str | None]):
        self.decode = decode
        self.has_text = decode([]) is not None
        self._one: dict[int, str] = {}

    def one(self, token: int) -> str:
        if token not in self._one:
            self._one[token] = self.decode([token])
        return self._one[token]

    def _texts(self, rows: list[list[int]]) -> list[list[str]]:
        """Each id's text, row by row (each new id decoded once)."""
        one = self._one
        new = {t for row in rows for t in row if t not in one}
        for t in new:
            one[t] = self.decode([t])
        return [[one[t] for t in row] for row in rows]

    def logprobs(self, ids: Sequence[int], scores: Scores, top_n: int | None, first_unscored: bool = False,
                 before: Sequence[int] = (), offset: int = 0) -> Logprobs:
        """``Logprobs`` of ``ids``, whose last ``len(scores)`` tokens were scored (the
        first has no score with ``first_unscored``); ``before``: the tokens before
        ``ids`` (for their texts), ``offset``: where ``ids``' text starts."""
        ids = [int(t) for t in ids]
        lead = [None] if first_unscored else []
        values = lead + [float(v) for v in scores.logprobs]
        top = alt = None
        if top_n:  # as lists once: per-row numpy indexing costs more than the rest here
            ids_rows = scores.top_ids[:, :top_n].tolist()
            alt = lead + ids_rows
            top = lead + self.tops(ids_rows, scores.top_logprobs[:, :top_n].tolist())
        tokens = starts = None
        if self.has_text:
            tokens = token_pieces(self.decode, ids, before, single=self.one)
            starts, at = [], offset
            for t in tokens:
                starts.append(at)
                at += len(t)
        return Logprobs(ids, values, top, alt, tokens, starts)

    def top(self, ids, values, n: int) -> dict:
        """{token text (id without a tokenizer): log-probability} of the first n alternatives
        (arrays or lists)."""
        ids, values = (np.asarray(x)[:n].tolist() for x in (ids, values))
        return self.tops([ids], [values])[0]

    def tops(self, ids: list[list[int]], values: list[list[float]]) -> list[dict]:
        """``top`` of many rows (lists), most likely first in each: the texts of all rows
        looked up at once."""
        keys = self._texts(ids) if self.has_text else ids
        out = []
        for k, v in zip(keys, values):
            row = dict(zip(k, v))
            if len(row) < len(k):  # two ids with one text: the first (likelier) keeps it
                row = {}
                for key, value in zip(k, v):
                    row.setdefault(key, value)
            out.append(row)
        return out


# ------------------------------------------------------------------ texts
def check_texts(texts, config, encode) -> tuple[list[list[int]], bool]:
    """As ``sampling.check_prompts`` (text or ids, one or a list), but of any length:
    scoring reads a text longer than the context in rolling windows."""
    unbounded = SimpleNamespace(vocab_size=config.vocab_size, context_length=sys.maxsize)
    return check_prompts(texts, unbounded, encode)


def check_max_length(max_length, config) -> int:
    n = config.context_length
    if max_length is None:
        return n
    if not is_int(max_length) or not 1 <= max_length <= n:
        raise GenerationError(f"max_length must be an integer from 1 to the context length {n}, got {max_length!r}")
    return int(max_length)


def score_ids(engine, texts: list[list[int]], top_n: int, max_length: int, prefix: int | None = None) -> list[Scores]:
    """The scores of every token of each text after the ones before it: all of them after
    ``prefix``, else all but the first; in rolling windows (module docs)."""
    windows, owner = [], []
    for i, ids in enumerate(texts):
        first, rest = (prefix, ids) if prefix is not None else (ids[0], ids[1:])
        for w in rolling_windows(rest, first, max_length):
            windows.append(w)
            owner.append(i)
    scores = score_windows(engine, windows, top_n)
    per_text: list[list[Scores]] = [[] for _ in texts]
    for i, s in zip(owner, scores):
        per_text[i].append(s)
    return [Scores.join(parts, top_n) for parts in per_text]


def score(generator, texts, top_n: int = 0, max_length: int | None = None):
    """``Generator.score`` (see there)."""
    top_n = check_top_n(top_n)
    ids, single = check_texts(texts, generator.config, generator.encode)
    max_length = check_max_length(max_length, generator.config)
    scores = score_ids(generator.engine, ids, top_n, max_length)
    out = [generator.token_texts.logprobs(t, s, top_n, first_unscored=True) for t, s in zip(ids, scores)]
    return out[0] if single else out


# ------------------------------------------------------------------ lm-eval's quantities
def end_of_text_id(tokenizer) -> int | None:
    return None if tokenizer is None else tokenizer.token_to_id(END_OF_TEXT)


def encode_pair(generator, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's causal models make them
    (``TemplateLM.loglikelihood`` and ``_encode_pair``): the context's trailing spaces
    move to the continuation; context + continuation is encoded whole and split after
    the context's own tokens; an empty context is the end-of-text token."""
    check_text(context, "context")
    check_text(continuation, "continuation")
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    if context == "":
        cont = generator.encode(continuation) if continuation else []
        prefix = end_of_text_id(generator.tokenizer)
        if prefix is None:
            raise GenerationError(f"an empty context is read as {END_OF_TEXT}, which this tokenizer does not have")
        return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    whole = generator.encode(context + continuation)
    ctx = generator.encode(context)
    return ctx, whole[len(ctx):]


def check_pairs(generator, requests) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs of text (encoded as lm-eval does) or of token ids."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise GenerationError("requests: expected a list of (context, continuation) pairs")
    V = generator.config.vocab_size
    out = []
    for i, r in enumerate(requests):
        if not isinstance(r, Sequence) or isinstance(r, str) or len(r) != 2:
            raise GenerationError(f"request {i}: expected a (context, continuation) pair, got {type(r).__name__}")
        context, continuation = r
        ids = [None if isinstance(x, str) else token_ids(x) for x in r]  # a 1-D integer array too, as score takes
        if isinstance(context, str) and isinstance(continuation, str):
            ctx, cont = encode_pair(generator, context, continuation)
        elif None not in ids:
            ctx, cont = ids
        else:
            raise GenerationError(f"request {i}: expected two texts or two lists of token ids")
        if not ctx:
            raise GenerationError(f"request {i}: the context has no tokens")
        bad = [t for t in ctx + cont if not 0 <= t < V]
        if bad:
            raise GenerationError(f"request {i}: token id {bad[0]} is outside the vocabulary [0, {V})")
        out.append((ctx, cont))
    return out


def loglikelihood(generator, requests, max_length: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> list[tuple[float, bool]]:
    """``Generator.loglikelihood`` (see there)."""
    pairs = check_pairs(generator, requests)
    n = check_max_length(max_length, generator.config)
    for i, (ctx, cont) in enumerate(pairs):
        if len(cont) > n:
            raise GenerationError(f"request {i}: the continuation has {len(cont)} tokens, more than max_length {n}")
    # as lm-eval: the model reads the last n tokens of context + continuation but its last
    whole = [(ctx + cont)[-(n + 1):] for ctx, cont in pairs]
    contexts = [w[:len(w) - len(cont)] for w, (_, cont) in zip(whole, pairs)]
    # requests with the same context go to the engine together: it reads that context once
    order = sorted(range(len(pairs)), key=lambda i: (contexts[i], i))
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    start = 0
    while start < len(order):
        end = min(len(order), start + REQUESTS_PER_BATCH)
        while end < len(order) and contexts[order[end]] == contexts[order[end - 1]]:
            end += 1
        batch = order[start:end]
        scores = score_continuations(generator.engine, [contexts[i] for i in batch], [pairs[i][1] for i in batch], 1,
                                     generator.prefix_cache)
        for i, s in zip(batch, scores):
            out[i] = (s.total, s.greedy)
        start = end
        if progress:
            progress(start, len(order))
    return out


def rolling_prefix(generator) -> int | None:
    """The token lm-eval's ``loglikelihood_rolling`` reads before a text: the
    end-of-text token (``None`` without one: then a text's first token is not scored)."""
    return end_of_text_id(generator.tokenizer)


def loglikelihood_rolling(generator, texts, max_length: int | None = None) -> list[float]:
    """``Generator.loglikelihood_rolling`` (see there)."""
    ids, single = check_texts(texts, generator.config, generator.encode)
    n = check_max_length(max_length, generator.config)
    totals = [s.total for s in score_ids(generator.engine, ids, 0, n, rolling_prefix(generator))]
    return totals[0] if single else totals


__all__ = ["END_OF_TEXT", "Logprobs", "TokenTexts", "check_max_length", "check_texts", "encode_pair",
           "end_of_text_id", "loglikelihood", "loglikelihood_rolling", "rolling_prefix", "score", "score_ids",
           "token_pieces"]
