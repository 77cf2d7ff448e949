"""One sample being generated (``Sequence``): its prompt and parameters, the tokens it
takes from the slot pool's decode (serve/scheduler.py), when it finishes (stop token,
stop string, length, context: in that order) and the text its stream may show so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

Decode = Callable[[list[int]], "str | None"]  # token ids -> text (None without a tokenizer)


def settled(text: str, stop_strings: Seq[str]) -> int:
    """How much of a running sample's ``text`` its stream may show.

    Not a trailing U+FFFD: a byte-level tokenizer decodes the first bytes of a
    character split across tokens as U+FFFD until its last byte arrives. Not a
    tail that could be the start of a stop string: the sample's text would be
    cut before it.
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    held = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, end), held, -1):
            if text.startswith(s[:k], end - k):
                held = k
                break
    return end - held


@dataclass(eq=False)
class Sequence:
    """One sample being generated: its prompt, parameters, and what it has produced."""

    prompt: list[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new: int
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tag: object = None  # the caller's name for it
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None  # "stop" | "length" | "context" | "cancelled" once finished
    cut: int | None = None  # where a stop string cuts the text
    shown: int = 0  # characters of the text its stream has shown
    cancel_requested: bool = False
    cached_tokens: int = 0  # prompt tokens its prefill took from the prefix cache
    # alternatives per token of the log-probabilities asked for (None: none); ``token_scores``: each
    # token's (log-probability, top ids, top log-probabilities: at least that many) from the decode
    logprobs: int | None = None
    token_scores: list[tuple] = field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        return self.cancel_requested

    def budget(self, n_ctx: int) -> int:
        """Tokens it may still take: ``max_new`` and the context both bound it."""
        return min(self.max_new - len(self.tokens), n_ctx - len(self.prompt) - len(self.tokens))

    def finish_without_running(self, n_ctx: int) -> bool:
        """Nothing to generate (``max_new`` 0, or a prompt that fills the context)."""
        if self.budget(n_ctx) > 0:
            return False
        self.reason = "length" if self.max_new == 0 else "context"
        return True

    def accept(self, token: int, decode: Decode, n_ctx: int) -> bool:
        """Take one new token; -> whether it joined the output (a stop token does not)."""
        if token in self.stop_ids:
            self.reason = "stop"
            return False
        self.tokens.append(int(token))
        if self.stop_strings:
            text = decode(self.tokens) or ""
            hits = [text.find(s) for s in self.stop_strings if s in text]
            if hits:
                self.reason, self.cut = "stop", min(hits)
                return True
        if len(self.tokens) >= self.max_new:
            self.reason = "length"
        elif len(self.prompt) + len(self.tokens) >= n_ctx:
            self.reason = "context"
        return True

    def text(self, decode: Decode) -> str | None:
        text = decode(self.tokens)
        return text if text is None or self.cut is None else text[: self.cut]

    def stream_piece(self, decode: Decode) -> str:
        """The text its stream adds now: the newly settled part while it runs, the rest of
        its final text once it has finished; the pieces add up to ``text``."""
        text = decode(self.tokens)
        if text is None:
            return ""
        if self.reason is not None:
            end = len(text) if self.cut is None else self.cut
        else:
            end = settled(text, self.stop_strings)
        start, self.shown = self.shown, max(self.shown, end)
        return text[start:end]


__all__ = ["Decode", "Sequence", "settled"]
