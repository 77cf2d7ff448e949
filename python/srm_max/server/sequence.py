"""What the engine loop keeps per request and per sample, and how a sample takes its tokens.

A ``Work`` is one HTTP completion request: its prompts times ``n`` samples,
each a ``Sample`` with its own sampling parameters and seed. A sample takes
tokens exactly as ``Generator`` does (a stop string ends it once the decoded
text contains it, then ``max_tokens``, then the context), so a served sample
equals ``Generator.generate`` with the same prompt, parameters and seed.

The engine loop hands each request its news as ``Delta``s, at most one per
sample per engine call, through the request's ``sink`` (thread-safe: the loop
runs in its own thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..generator import _settled

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


@dataclass(eq=False)
class Work:
    id: str
    stream: bool
    stop_strings: list[str]
    sink: Callable[[list[Delta]], None]
    samples: list["Sample"] = field(default_factory=list)
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    started: bool = False  # a sample has entered a slot
    first_token: float | None = None

    @property
    def done(self) -> bool:
        return all(s.reason is not None for s in self.samples)


@dataclass(eq=False)
class Sample:
    request: Work
    index: int  # the choice index in the response
    prompt: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new: int
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    cut: int | None = None  # where a stop string cuts the text
    shown: int = 0  # characters of the text the stream has sent
    sent: int = 0  # tokens the stream has sent
    last_delivery: float | None = None  # for the inter-token latency
    counted: bool = False  # in the finished-samples metric

    def budget(self, n_ctx: int) -> int:
        """Tokens it may still take: ``max_tokens`` and the context both bound it."""
        return min(self.max_new - len(self.tokens), n_ctx - len(self.prompt) - len(self.tokens))

    def finish_without_running(self, n_ctx: int) -> bool:
        """Nothing to generate (``max_tokens`` 0, or a prompt that fills the context):
        finished before any engine call, with Generator's reason."""
        if self.budget(n_ctx) > 0:
            return False
        self.reason = "length" if self.max_new == 0 else "context"
        return True

    def accept(self, token: int, decode: Callable[[list[int]], str | None], n_ctx: int) -> None:
        """Take one new token (the order of Generator's checks: stop string, length, context)."""
        if self.reason is not None:
            return
        self.tokens.append(int(token))
        stops = self.request.stop_strings
        if stops:
            text = decode(self.tokens) or ""
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                self.reason, self.cut = "stop", min(hits)
                return
        if len(self.tokens) >= self.max_new:
            self.reason = "length"
        elif len(self.prompt) + len(self.tokens) >= n_ctx:
            self.reason = "context"

    def text(self, decode: Callable[[list[int]], str | None]) -> str:
        text = decode(self.tokens)
        if text is None:  # no tokenizer: the ids are the answer
            return ""
        return text if self.cut is None else text[: self.cut]

    def delta(self, decode: Callable[[list[int]], str | None]) -> Delta | None:
        """Its news since the last delta, or None when there is none to send."""
        if self.reason == CANCELLED:
            return None
        if not self.request.stream:
            if self.reason is None:
                return None
            return Delta(self.index, self.text(decode), list(self.tokens), self.reason)
        new_ids = self.tokens[self.sent:]
        self.sent = len(self.tokens)
        text = decode(self.tokens)
        piece = ""
        if text is not None:
            # the stream shows only settled text (Generator's rule), so its pieces add up
            # to the final text: a character split across tokens or a possible stop string waits
            if self.reason is not None:
                end = len(text) if self.cut is None else self.cut
            else:
                end = _settled(text, self.request.stop_strings)
            piece = text[self.shown:end]
            self.shown = max(self.shown, end)
        if not new_ids and not piece and self.reason is None:
            return None
        return Delta(self.index, piece, new_ids, self.reason)
