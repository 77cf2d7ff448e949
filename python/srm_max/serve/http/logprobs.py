"""Log-probabilities for ``logprobs`` / ``top_logprobs`` / ``echo`` requests, computed in
the engine loop and carried to the answer in each ``Delta``.

Every number is under the model's raw distribution (log_softmax of the logits: no
temperature, top-k or top-p, whatever sampled the token), as vLLM reports them by default:

- generated tokens: the ones the decode returned with them (every engine's decode
  computes them; the scheduler keeps them per sample), with no second pass;
- ``echo``: the prompt's tokens are scored once from its start by the engine's prefill
  graph (``serve/scoring.py``), the first one ``null`` (no context).

The echo asks the prefill's scored rows for their 20 alternatives, the decode for the most any
sample in its batch asks for; each request keeps its own n.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..logprobs import TokenTexts, token_pieces
from ..scoring import MAX_TOP_N, Scores, decoded_scores, score_runs


@dataclass
class TokenLogprob:
    """One token of an answer's log-probabilities."""

    token: str  # the text it adds (a character split across tokens: the token completing it carries it)
    key: str  # its text alone (the key of the alternatives' dicts)
    logprob: float | None  # None: an echoed prompt's first token
    top: list[tuple[str, float]] | None  # the n likeliest tokens there, likeliest first (None with the logprob)
    offset: int  # where its text starts in prompt + completion


class RequestScoring:
    """The engine loop's scoring of the samples whose requests ask for log-probabilities."""

    def __init__(self, engine, decode):
        self.engine = engine
        self.decode = decode
        self.texts = TokenTexts(decode)

    def update(self, samples) -> None:
        """Score what the next deltas of ``samples`` (a turn's samples with news) will carry."""
        todo, echo = [], {}
        for s in samples:
            r = s.request
            if r.logprobs is None or r.cancelled:
                continue
            ready = r.stream or s.reason is not None  # a non-streamed sample is answered when it ends
            if ready and len(s.tokens) > s.scored:
                todo.append(s)
            if ready and r.echo and s.echo_scores is None:
                echo.setdefault(tuple(s.prompt), []).append(s)
        for s in todo:
            s.scores, s.scored = decoded_scores(s, s.request.logprobs), len(s.tokens)
        if echo:
            prompts = [list(p) for p in echo if len(p) > 1]
            scored = dict(zip(map(tuple, prompts), score_runs(self.engine, [p[:-1] for p in prompts],
                                                               [p[1:] for p in prompts], MAX_TOP_N)[0]))
            for p, members in echo.items():
                for s in members:
                    s.echo_scores = scored.get(p, Scores.empty(MAX_TOP_N))

    def tokens(self, ids, scores: Scores, n: int, before, offset: int, final: bool,
               first_unscored: bool = False) -> list[TokenLogprob]:
        """``TokenLogprob``s of ``ids`` after the tokens ``before``, the text starting at
        ``offset``; ``scores`` holds the log-probabilities of all but a first unscored one."""
        pieces = token_pieces(self.decode, ids, before, final)
        out, k = [], 0
        for i, (t, piece) in enumerate(zip(ids, pieces)):
            if first_unscored and i == 0:
                out.append(TokenLogprob(piece, self.texts.one(t), None, None, offset))
            else:
                top = [(self.texts.one(a), float(v)) for a, v in
                       zip(scores.top_ids[k][:n].tolist(), scores.top_logprobs[k][:n].tolist())]
                out.append(TokenLogprob(piece, self.texts.one(t), float(scores.logprobs[k]), top, offset))
                k += 1
            offset += len(piece)
        return out


def completion_logprobs(tokens: list[TokenLogprob]) -> dict:
    """OpenAI's legacy ``logprobs`` object: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (the n likeliest and, as OpenAI, always the chosen token: up to n + 1; null where the
    log-probability is) and ``text_offset``."""
    def top(t: TokenLogprob):
        if t.top is None:
            return None
        out = {}
        for key, value in t.top:
            out.setdefault(key, value)
        out.setdefault(t.key, t.logprob)
        return out

    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [top(t) for t in tokens], "text_offset": [t.offset for t in tokens]}


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    """OpenAI's chat ``logprobs`` object: ``content``, one entry per token with its text,
    log-probability, UTF-8 bytes and ``top_logprobs`` (the n likeliest)."""
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [entry(t.token, t.logprob) | {"top_logprobs": [entry(k, v) for k, v in t.top or []]}
                        for t in tokens]}


__all__ = ["RequestScoring", "TokenLogprob", "chat_logprobs", "completion_logprobs"]
