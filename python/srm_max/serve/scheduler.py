"""The one scheduler: a pool of state slots that every way of generating runs through.

``generate`` and ``stream`` (every prompt in the pool at once), ``sample_many``
(a fixed pool refilled the moment a sample finishes) and the HTTP server
(requests joining at any turn) all hand ``Sequence``s to a ``SlotPool`` and call
``turn()`` until it is idle. Each turn

1. drops cancelled sequences,
2. moves pending sequences into free slots: their distinct prompts are prefilled
   together in one call (the samples of one prompt fork its state and draw their
   first tokens from its logits; samples of the last call's prompts fork it without
   a new prefill) and their states copied into the batch, next to the running rows,
3. runs one decode call of up to ``steps_per_call`` steps for the whole batch,
4. lets every running sequence take its tokens (serve/sequence.py) and reports what
   happened as a ``Turn``.

A finished sequence's row keeps running (its tokens are dropped) until the batch
is rebuilt: when a pending sequence can take its place, or when half the rows are
finished (then the batch is compacted). A rebuild is the engine's ``regroup`` of the
kept rows and the new samples' prefilled states: a gather on the device, so the
batch's states never go through the host, only token ids, positions and the row
index do (the prefix cache below keeps host copies of prefilled states and hands
cached ones to the prefill). When the starting sequences fill every finished row,
they take those rows' slots and the other rows stay where they are: the pool donates
its states, and an engine whose states live on the host writes just the new rows
into them, instead of the whole batch (a row is megabytes at long context).

A sequence asking for log-probabilities (``logprobs``) gets them with its tokens from the engine's decode (the
first one's from the graph that drew it; ``scoring.decode_top_n``), each keeping its own top-n.

A sequence's tokens depend only on its prompt, sampling parameters, seed and
positions (the in-graph sampler's random counter), never on its batch mates, its
slot or the steps per call, so scheduling never changes what anyone gets.

With a ``PrefixCache`` (``serve/prefix_cache.py``) and an engine that prefills from a
given state (``engine.supports_start_state``), a prompt starts from the state after
its longest cached prefix and prefills only the rest; its prefill stops at the
cache's split points (a prefix it shares with a recent prompt or a batch mate, the
last checkpoint before its end) to keep the states there, and a prefix shared by
prompts of one prefill runs once. A prompt's tokens are the same either way (the
states differ only by a different order of summation).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..runtime.call_types import DecodeResult, SamplingArrays
from .prefix_cache import PrefixCache, prefill_cached, usable_cache
from .scoring import decode_top_n, step_scores
from .sequence import Decode, Sequence


@dataclass
class PoolStats:
    """What the pool did: for checking that no slot idled while work was pending."""

    slots: int = 0
    decode_steps: int = 0
    prefill_calls: int = 0
    prompts_prefilled: int = 0  # distinct prompts run through prefill (samples of one prompt share it)
    prompt_tokens_cached: int = 0  # of those prompts' tokens, the ones taken from the prefix cache
    busy_slot_steps: int = 0
    idle_slot_steps_while_pending: int = 0
    seconds: float = 0.0
    samples: int = 0
    tokens: int = 0
    active_per_step: list[int] = field(default_factory=list)


class Taken(NamedTuple):
    """One token a sequence took at one step."""

    token: int
    joined: bool  # whether it joined the output (a stop token does not)
    text: str | None  # with ``stream_text``: what the sequence's stream adds at this step
    finished: str | None  # the reason, when the sequence finished at this step
    # where the engine's decode returned it: (log-probability, top ids, top log-probabilities)
    score: tuple | None = None


@dataclass
class Turn:
    """What one ``SlotPool.turn`` did."""

    # per step (the prefill of starting sequences first, then each decode step): the
    # sequences that took a token -> what they took
    ticks: list[dict[Sequence, Taken]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # in the order they finished
    prefill_seconds: float = 0.0
    prompt_tokens: int = 0  # of the sequences started
    prompts_prefilled: int = 0  # distinct prompts run through prefill
    cache_hits: int = 0  # of those, the ones that started from a cached prefix
    cached_tokens: int = 0  # the tokens those prefixes saved
    decode_seconds: float = 0.0
    steps: int = 0  # decode steps run


class SlotPool:
    """Up to ``max_slots`` sequences decoding together on one engine (see module docs)."""

    def __init__(self, engine, decode: Decode, max_slots: int, steps_per_call: int = 1,
                 stats: PoolStats | None = None, stream_text: bool = False, prefix_cache: PrefixCache | None = None):
        """``stream_text``: record each step's ``Sequence.stream_piece`` in the turn's ticks.
        ``prefix_cache``: prompts start from cached prefix states (shared with other pools);
        unused when it is off or the engine cannot prefill from a state."""
        if max_slots < 1 or steps_per_call < 1:
            raise ValueError("max_slots and steps_per_call must be >= 1")
        self.engine = engine
        self.prefix_cache = usable_cache(engine, prefix_cache)
        self.decode = decode
        self.n_ctx = engine.config.context_length
        self.max_slots = max_slots
        self.steps_per_call = steps_per_call
        self.stream_text = stream_text
        self.stats = stats if stats is not None else PoolStats()
        self.stats.slots = max_slots
        self.pending: deque[Sequence] = deque()
        self.reset()

    def reset(self) -> None:
        """Forget every row (after a failed engine call); pending sequences stay."""
        self.rows: list[Sequence] = []  # the batch's rows, finished ones included
        self._states = self._sampling = self._device_inputs = None
        self._last_prefill = None  # (prompt -> row, states, logits, cached tokens) of the last prefill call
        self._ids = self._positions = np.zeros(0, np.int64)

    def submit(self, sequences: Iterable[Sequence]) -> None:
        self.pending.extend(sequences)

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.rows if s.reason is None]

    @property
    def free_slots(self) -> int:
        return self.max_slots - len(self.live)

    @property
    def idle(self) -> bool:
        return not self.pending and not self.live

    def run(self) -> Iterable[Turn]:
        """Turns until every submitted sequence has finished."""
        start = time.perf_counter()
        while not self.idle:
            yield self.turn()
        self.stats.seconds += time.perf_counter() - start

    def turn(self) -> Turn:
        turn = Turn()
        for s in [*self.pending, *self.live]:
            if s.cancelled:
                self._finish(s, "cancelled", turn)
        self.pending = deque(s for s in self.pending if s.reason is None)
        rows = list(self.rows)  # a Sequence equals only itself: a refill in place changes this list
        while self.pending and self.free_slots > 0:
            self._start(turn)
        if self.rows == rows and len(self.rows) > 1 and 2 * len(self.live) <= len(self.rows):
            self._rebuild(self.live, [])  # compact: half the rows are finished
        if self.live:
            self._decode(turn)
        return turn

    # ------------------------------------------------------------ the engine calls
    def _start(self, turn: Turn) -> None:
        """Prefill as many pending sequences as there are free slots; those still running
        after their first token join the batch."""
        starting, free = [], self.free_slots  # rows do not change until the rebuild below
        while self.pending and len(starting) < free:
            s = self.pending.popleft()
            if s.finish_without_running(self.n_ctx):
                self._finish(s, s.reason, turn)
            else:
                starting.append(s)
        if not starting:
            return
        t0 = time.perf_counter()
        try:
            states, row_of, first = self._prefill(starting, turn)
        except BaseException:
            self.pending.extendleft(reversed(starting))  # still the caller's to finish or retry
            raise
        turn.prefill_seconds += time.perf_counter() - t0
        turn.prompt_tokens += sum(len(s.prompt) for s in starting)
        first, scores = first.tokens[:, 0], step_scores(first, 0)
        turn.ticks.append(self._take(zip(starting, first.tolist(), scores), turn))
        go_on = [i for i, s in enumerate(starting) if s.reason is None]
        joining = [starting[i] for i in go_on]
        self._rebuild(self._placed(joining), joining, (states, [row_of[i] for i in go_on], first[go_on]))

    def _placed(self, joining: list[Sequence]) -> list[Sequence]:
        """The next batch's rows: the ``joining`` sequences take the finished rows' slots when
        they fill every one (the rest stay in place, so the engine writes just their rows),
        else the running rows, then the joining ones."""
        finished = [r for r, s in enumerate(self.rows) if s.reason is not None]
        if not finished or len(finished) != len(joining):
            return self.live + joining
        rows = list(self.rows)
        for r, s in zip(finished, joining):
            rows[r] = s
        return rows

    def _first(self, logits, row_of: list[int], starting: list[Sequence]) -> DecodeResult:
        """Forked samples' first tokens from the sample graph (one-step, scored where ``decode_top_n``)."""
        top_n = decode_top_n(starting)
        args = (logits, row_of, _sampling_of(starting), [len(s.prompt) for s in starting])
        if top_n is not None:
            return self.engine.draw_scored(*args, top_n)
        return DecodeResult(np.asarray(self.engine.draw(*args), np.int64)[:, None], None, None, None)

    def _prefill(self, starting: list[Sequence], turn: Turn) -> tuple[object, list[int], DecodeResult]:
        """Each distinct prompt is prefilled once and its state forked into its samples;
        -> the prefilled states (device, one row per distinct prompt), each sample's row
        among them, and each sample's first token (``_first``): drawn from its prompt's logits
        with its own parameters and seed, the same token as a prefill of its own would draw.

        The last prefill is kept: when every starting sample's prompt is in it (the next
        samples of a prompt, started as slots free up), they fork it without a prefill."""
        keys = [tuple(s.prompt) for s in starting]
        kept = self._last_prefill
        if kept is not None and all(k in kept[0] for k in keys):
            rows, states, logits, cached = kept
            row_of = [rows[k] for k in keys]
            for s, r in zip(starting, row_of):
                s.cached_tokens = cached[r]
            return states, row_of, self._first(logits, row_of, starting)
        rows: dict[tuple[int, ...], int] = {}
        row_of = [rows.setdefault(k, len(rows)) for k in keys]
        self.stats.prefill_calls += 1
        self.stats.prompts_prefilled += len(rows)
        turn.prompts_prefilled += len(rows)
        prompts = [list(p) for p in rows]
        own = len(rows) == len(starting)  # every sample has a prompt of its own: it draws (and scores) in the prefill
        pre, cached = self._prefill_prompts(prompts, _sampling_of(starting) if own else None,
                                            decode_top_n(starting) if own else None)
        for s, r in zip(starting, row_of):
            s.cached_tokens = cached[r]
        turn.cache_hits += sum(c > 0 for c in cached)
        turn.cached_tokens += sum(cached)
        self.stats.prompt_tokens_cached += sum(cached)
        self._last_prefill = (rows, pre.states, pre.logits, cached)
        first = pre.scores if own else self._first(pre.logits, row_of, starting)
        return pre.states, row_of, first or DecodeResult(pre.next_ids[:, None], None, None, None)

    def _prefill_prompts(self, prompts: list[list[int]], sampling: SamplingArrays | None, top_n: int | None):
        """-> the prefill of the distinct ``prompts`` (``top_n``: scored) and the tokens of each the cache gave."""
        asked = {} if top_n is None else {"logprobs": top_n}  # engines without them take no such argument
        if self.prefix_cache is None:
            return self.engine.prefill(prompts, sampling, **asked), [0] * len(prompts)
        return prefill_cached(self.engine, self.prefix_cache, prompts, sampling, **asked)

    def _rebuild(self, rows: list[Sequence], starting: list[Sequence], prefilled=None) -> None:
        """The batch ``rows``: rows of the current batch and the ``starting`` sequences
        (``prefilled``: (their prefill's states on the device, each one's row there, their
        first tokens)), regrouped on the device."""
        at = {id(s): i for i, s in enumerate(self.rows)}
        fresh, fresh_rows, first = prefilled or (None, [], np.zeros(0, np.int64))
        joins = {id(s): j for j, s in enumerate(starting)}
        pool = self._states if any(id(s) in at for s in rows) else None
        offset = len(at) if pool is not None else 0
        # each row's source: (its row in the regrouped states, its current id, its position),
        # a kept row's or a starting sequence's
        sources = [(at[id(s)], self._ids[at[id(s)]], self._positions[at[id(s)]]) if id(s) in at
                   else (offset + fresh_rows[joins[id(s)]], first[joins[id(s)]], len(s.prompt)) for s in rows]
        index, ids, positions = (list(column) for column in zip(*sources)) if sources else ([], [], [])
        self._ids, self._positions = np.array(ids, np.int64), np.array(positions, np.int64)
        self.rows = rows
        self._device_inputs = None
        if not self.rows:
            self.reset()
            return
        if not starting and index == list(range(len(at))):
            return  # the same rows: nothing to move
        # donated: the pool's states are its own (made by a regroup or the last decode)
        self._states = self.engine.regroup(pool, fresh, index, donate_pool=True)
        self._sampling = self.engine.sampling_buffers(_sampling_of(self.rows))

    def _decode(self, turn: Turn) -> None:
        live = self.live
        budgets = [s.budget(self.n_ctx) for s in live]
        # with sequences waiting, end the call when the first row frees up; else run the
        # steps the longest needs (past a sequence's end its tokens are dropped)
        S = max(1, min(self.steps_per_call, min(budgets) if self.pending else max(budgets)))
        ids, positions = self._device_inputs or (self._ids, self._positions)
        t0, top_n = time.perf_counter(), decode_top_n(live)
        asked = {} if top_n is None else {"logprobs": top_n}  # engines without them take no such argument
        # donated: the pool's states are its own (made by a regroup or the last decode; reset drops them)
        res = self.engine.decode(ids, positions, self._states, self._sampling, S, donate_states=True, **asked)
        turn.decode_seconds += time.perf_counter() - t0
        turn.steps += S
        self._states = res.states
        self._device_inputs = (res.ids, res.positions)
        self._ids = res.tokens[:, -1].copy()
        self._positions = self._positions + S
        columns = res.tokens.T.tolist()
        for step in range(S):
            running = [(r, s) for r, s in enumerate(self.rows) if s.reason is None]
            if not running:
                break
            self.stats.decode_steps += 1
            self.stats.active_per_step.append(len(running))
            self.stats.busy_slot_steps += len(running)
            if self.pending:
                self.stats.idle_slot_steps_while_pending += self.max_slots - len(running)
            scores = step_scores(res, step)
            turn.ticks.append(self._take(((s, columns[step][r], scores[r]) for r, s in running), turn))

    def _take(self, tokens, turn: Turn) -> dict[Sequence, Taken]:
        """Let each (sequence, token, score or None) take its token: one tick."""
        tick = {}
        for s, token, score in tokens:
            joined = s.accept(int(token), self.decode, self.n_ctx)
            score = None if s.logprobs is None else score  # rows of the batch's widest top-n: cut when read
            if joined and score is not None:
                s.token_scores.append(score)
            tick[s] = Taken(int(token), joined, s.stream_piece(self.decode) if self.stream_text else None, s.reason,
                            score)
            if s.reason is not None:
                self._finish(s, s.reason, turn)
        return tick

    def _finish(self, s: Sequence, reason: str, turn: Turn) -> None:
        s.reason = reason
        turn.finished.append(s)
        if reason != "cancelled":
            self.stats.samples += 1
            self.stats.tokens += len(s.tokens)


def _sampling_of(sequences: list[Sequence]) -> SamplingArrays:
    return SamplingArrays(np.array([s.temperature for s in sequences], np.float32),
                          np.array([s.top_k for s in sequences], np.int64),
                          np.array([s.top_p for s in sequences], np.float32),
                          np.array([s.seed for s in sequences], np.uint64))


__all__ = ["PoolStats", "SlotPool", "Taken", "Turn"]
