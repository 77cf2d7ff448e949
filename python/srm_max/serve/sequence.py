"""One sample being generated (``Sequence``): its prompt and parameters, the tokens it
takes from the slot pool's decode (serve/scheduler.py), when it finishes (stop token,
stop string, length, context: in that order) and the text its stream may show so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

Decode = Callable[[list[int]], "str | None"]  # token ids -> text (None without a tokenizer)


def settled_end(text: str) -> int:
    """``len(text)`` less a trailing U+FFFD: a byte-level tokenizer decodes the first bytes of a
    character split across tokens as U+FFFD until its last byte arrives."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    return end


def stop_prefix(text: str, end: int, stop: str, start: int = 0) -> int:
    """The length of the longest tail of ``text[:end]`` that begins at ``start`` or later and is
    a proper prefix of ``stop`` (text that could still become ``stop``); 0 for none.

    Only the last ``len(stop) - 1`` characters can be one; the candidates are where ``stop``'s
    first character occurs there, the leftmost (longest) first."""
    i = text.find(stop[0], max(start, end - len(stop) + 1), end)
    while i != -1 and not stop.startswith(text[i:end]):
        i = text.find(stop[0], i + 1, end)
    return 0 if i == -1 else end - i


class StopScan:
    """A running sample's text against its stop strings, each call looking only at what is new.

    A decode of more tokens extends the text of the last one, save for a trailing U+FFFD that
    the split character's last byte replaces (``settled_end``). So a stop string can only be
    found where it ends in new text, and a tail that could begin one (``settled``) can only
    begin where the last such tail began or later. Where a tokenizer's decode rewrites earlier
    text, the scan starts over.
    """

    def __init__(self, strings: Seq[str]):
        self.strings = strings
        self._searched = ""  # the settled part of the text ``first`` saw last: no stop string is in it
        self._shown = ""  # the settled part of the text ``settled`` saw last
        self._held = [0] * len(strings)  # per stop string: the longest tail of ``_shown`` that begins it

    def first(self, text: str) -> int | None:
        """Where the first stop string in ``text`` begins, or None; as ``min(text.find(s))``."""
        kept = len(self._searched) if text.startswith(self._searched) else 0
        self._searched = text[:settled_end(text)]
        hits = [i for s in self.strings if (i := text.find(s, max(0, kept - len(s) + 1))) != -1]
        return min(hits, default=None)

    def settled(self, text: str) -> int:
        """How much of a running sample's ``text`` its stream may show: not a trailing U+FFFD
        (``settled_end``), nor a tail that could be the start of a stop string (the sample's
        text would be cut before it)."""
        end = settled_end(text)
        kept = text.startswith(self._shown)
        self._held = [stop_prefix(text, end, s, len(self._shown) - held if kept else 0)
                      for s, held in zip(self.strings, self._held)]
        self._shown = text[:end]
        return end - max(self._held, default=0)


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
    stops: StopScan = field(init=False, repr=False)

    def __post_init__(self):
        self.stops = StopScan(self.stop_strings)

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
            cut = self.stops.first(decode(self.tokens) or "")
            if cut is not None:
                self.reason, self.cut = "stop", cut
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
            end = self.stops.settled(text)
        start, self.shown = self.shown, max(self.shown, end)
        return text[start:end]


__all__ = ["Decode", "Sequence", "StopScan", "settled_end", "stop_prefix"]
