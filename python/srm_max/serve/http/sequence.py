"""What the engine loop keeps per request and per sample, and how a sample takes its tokens.

A ``ServedRequest`` is one HTTP completion request: its prompts times ``n`` samples,
each a ``ServedSample`` with its own sampling parameters and seed. Samples run in the
same scheduler as ``Generator`` (``serve.scheduler``), so a served sample equals
``Generator.generate`` with the same prompt, parameters and seed.

The engine loop hands each request its news as ``Delta``s, at most one per
sample per engine call, through the request's ``sink`` (thread-safe: the loop
runs in its own thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..sequence import Sequence

CANCELLED = "cancelled"  # a sample's reason when its client went away
ERROR = "error"  # a Delta with this reason (and index -1) ends the whole request: the loop died


@dataclass
class Delta:
    """What one sample adds to its response: streamed, the newly settled text and the
    new token ids; not streamed, its whole text and ids once it has finished."""

    index: int
    text: str
    ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "context" | "cancelled"
    # with logprobs: those of the echoed prompt (in the sample's first delta) and of ``ids``
    # (``http.logprobs.TokenLogprob``s)
    logprobs: list | None = None


@dataclass(eq=False)
class ServedRequest:
    id: str
    stream: bool
    stop_strings: list[str]
    sink: Callable[[list[Delta]], None]
    samples: list["ServedSample"] = field(default_factory=list)
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    started: bool = False  # a sample has entered a slot
    first_token: float | None = None
    logprobs: int | None = None  # the alternatives per token asked for; None: no log-probabilities
    echo: bool = False  # the answer starts with the prompt

    @property
    def done(self) -> bool:
        return all(s.reason is not None for s in self.samples)


@dataclass(eq=False)
class ServedSample(Sequence):
    """One sample of a request: a scheduler ``Sequence`` (which takes its tokens exactly
    as ``Generator`` does) plus what its response has been sent."""

    request: ServedRequest | None = None
    index: int = 0  # the choice index in the response
    admitted: bool = False  # it has left the engine loop's waiting queue for the scheduler
    sent: int = 0  # tokens the stream has sent
    counted_tokens: int = 0  # tokens counted in the metrics
    last_delivery: float | None = None  # for the inter-token latency
    counted: bool = False  # in the finished-samples metric
    # log-probabilities (``http.logprobs.RequestScoring`` fills them in the engine loop)
    scored: int = 0  # tokens scored
    scores: object = None  # ``Scores`` of the first ``scored`` tokens
    echo_scores: object = None  # ``Scores`` of the prompt (its first token has none)
    echoed: bool = False  # its first delta has gone out (with the prompt when echoing)
    offset: int = 0  # where the next token's text starts in prompt + completion

    @property
    def cancelled(self) -> bool:
        return self.request.cancelled

    def delta(self, decode: Callable[[list[int]], str | None], scoring=None) -> Delta | None:
        """Its news since the last delta, or None when there is none to send (``scoring``:
        the loop's ``RequestScoring``, for the log-probabilities). A request whose client
        went away gets nothing more, also when it left during the engine call that brought
        the news: its scoring was skipped, and nobody reads the answer."""
        if self.reason == CANCELLED or self.request.cancelled:
            return None
        if not self.request.stream:
            if self.reason is None:
                return None
            whole = Delta(self.index, self.text(decode) or "", list(self.tokens), self.reason)
            return self._with_logprobs(whole, decode, scoring, 0)
        start, new_ids = self.sent, self.tokens[self.sent:]
        self.sent = len(self.tokens)
        piece = self.stream_piece(decode)  # only settled text: the pieces add up to the final text
        if not new_ids and not piece and self.reason is None and (self.echoed or not self.request.echo):
            return None
        return self._with_logprobs(Delta(self.index, piece, new_ids, self.reason), decode, scoring, start)

    def _with_logprobs(self, delta: Delta, decode, scoring, start: int) -> Delta:
        """``delta`` with the echoed prompt before its first one, and the log-probabilities
        of what it carries (its ids are the tokens from ``start`` on)."""
        r, first, self.echoed = self.request, not self.echoed, True
        if first and (r.echo or r.logprobs is not None):
            prompt_text = decode(self.prompt) or ""
            self.offset = len(prompt_text)  # text offsets count in prompt + completion, as OpenAI's
            if r.echo:
                delta.text = prompt_text + delta.text
        if r.logprobs is None or scoring is None:
            return delta
        out = []
        if first:
            if r.echo:
                out += scoring.tokens(self.prompt, self.echo_scores, r.logprobs, (), 0, True, first_unscored=True)
        if delta.ids:
            end = start + len(delta.ids)
            scores = self.scores.slice(start, end)
            out += scoring.tokens(delta.ids, scores, r.logprobs, self.prompt + self.tokens[:start], self.offset,
                                  self.reason is not None and end == len(self.tokens))
            self.offset = out[-1].offset + len(out[-1].token)
        delta.logprobs = out
        return delta
