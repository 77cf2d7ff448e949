"""Scoring through the engine: the log-probabilities of given tokens, batched into
``engine.score`` calls, and the same for tokens that keep coming after a prompt.

Every number comes from the engine's prefill graph, which scores given positions
(``runtime.compiled`` ``score``): the
log-probability of each target token under the model's raw distribution
(log_softmax of the logits: no temperature, no top-k/top-p) and the top-n
alternatives, computed on the device; no [T, V] logits reach the host.

- ``score_runs``: texts scored from their first token (no state before them).
- ``ContinuationScorer``: tokens that follow a prompt, scored from the state after
  the prompt. A prompt's state is computed once by a prefill and forked into each
  of its continuations (the engine's ``regroup``), so a context shared by several
  continuations is read once; a continuation scored in pieces (a stream) picks up
  the state its last piece left. Given the generator's prefix cache
  (``serve/prefix_cache.py``), that prefill starts from the longest cached prefix of
  the prompt and leaves its states in the cache: the few-shot examples every lm-eval
  document shares, or a prompt just generated from, are read once. An engine whose
  ``score`` does not take start states rescores prompt and continuation from the
  start instead (same numbers, more work).
- ``rolling_windows``: lm-eval's ``loglikelihood_rolling`` windows for texts
  longer than the context.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import GenerationError
from ..graphs.scoring import TOP_N
from .prefix_cache import PrefixCache, prefill_cached, usable_cache
from .sampling import brief_repr, is_int

MAX_TOP_N = TOP_N  # the most alternatives per position: the scored rows' width (OpenAI's limit too)

# Scoring with plain ops (a GPU, or a CPU engine without the packed output layer) holds
# [B, T, V] float32 logits at once: a batch is cut into calls of at most this many bytes
# of logits (and at least one whole text), on every engine alike.
LOGITS_BYTES_PER_CALL = 256 << 20


def check_top_n(value, name: str = "top_n", allow_none: bool = False) -> int | None:
    """An integer in [0, 20] (None too with ``allow_none``), else GenerationError naming ``name``."""
    if value is None and allow_none:
        return None
    if not is_int(value) or not 0 <= value <= MAX_TOP_N:
        raise GenerationError(f"{name} must be an integer from 0 to {MAX_TOP_N}, got {brief_repr(value)}")
    return int(value)


def tokens_per_call(config) -> int:
    return max(config.context_length, LOGITS_BYTES_PER_CALL // (4 * config.vocab_size))


@dataclass
class Scores:
    """The log-probabilities of a run of target tokens, each after the text before it."""

    targets: np.ndarray  # [T] int64
    logprobs: np.ndarray  # [T] float32
    top_ids: np.ndarray  # [T, n] int64, most likely first
    top_logprobs: np.ndarray  # [T, n] float32

    @classmethod
    def empty(cls, top_n: int) -> "Scores":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros((0, top_n), np.int64),
                   np.zeros((0, top_n), np.float32))

    @classmethod
    def join(cls, parts: Sequence["Scores"], top_n: int) -> "Scores":
        if not parts:
            return cls.empty(top_n)
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                     ("targets", "logprobs", "top_ids", "top_logprobs")))

    def __len__(self) -> int:
        return len(self.targets)

    def slice(self, start: int, end: int) -> "Scores":
        return Scores(self.targets[start:end], self.logprobs[start:end], self.top_ids[start:end],
                      self.top_logprobs[start:end])

    def tail(self, k: int) -> "Scores":
        return self.slice(len(self) - k, len(self))

    @property
    def total(self) -> float:
        """The sum of the log-probabilities (in float64)."""
        return float(self.logprobs.astype(np.float64).sum())

    @property
    def greedy(self) -> bool:
        """Whether every target is the most likely token (lm-eval's ``is_greedy``); needs top-n >= 1."""
        if self.top_ids.shape[1] < 1:
            raise ValueError("greedy needs the top-1 token: score with top_n >= 1")
        return bool((self.top_ids[:, 0] == self.targets).all())


def rolling_windows(ids: list[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's ``loglikelihood_rolling`` windows of ``ids``: (context, targets) pairs,
    ``utils.make_disjoint_window`` of ``utils.get_rolling_token_windows(ids, prefix,
    max_length, context_len=1)``. The first window predicts ``ids[:max_length]`` after
    ``prefix``; each later one predicts the next ``max_length`` tokens (the last one what
    is left) after the tokens before them that fill its input to ``max_length``: the one
    token before a full window, more before a short last one. No state passes between
    windows: every token is scored once, with at most ``max_length`` tokens read."""
    windows, done = [], 0
    while done < len(ids):
        end = min(len(ids), done + max_length)
        context = [prefix] if done == 0 else ids[end - max_length - 1: done]
        windows.append((context, ids[done:end]))
        done = end
    return windows


def score_windows(engine, windows: list[tuple[list[int], list[int]]], top_n: int) -> list[Scores]:
    """The log-probabilities of each window's targets after its context (each window read
    from its start: nothing shared between windows)."""
    texts = [c + t for c, t in windows]
    scores, _ = score_runs(engine, [x[:-1] for x in texts], [x[1:] for x in texts], top_n)
    return [s.tail(len(t)) for s, (_, t) in zip(scores, windows)]


def _calls(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Batches of indices, longest first, each at most ``budget`` padded tokens (but at
    least one text): similar lengths share a call, so little of it is padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    calls: list[list[int]] = []
    for i in order:
        if calls and (len(calls[-1]) + 1) * lengths[calls[-1][0]] <= budget:
            calls[-1].append(i)
        else:
            calls.append([i])
    return calls


def rows_of(states) -> int:
    return int(states.shape[1])


def gather(engine, parts: Sequence, picks: Sequence[tuple[int, int]]):
    """A batch of states on the device whose row b is row ``picks[b][1]`` of
    ``parts[picks[b][0]]`` (engine ``regroup`` calls; states never visit the host)."""
    used = sorted({p for p, _ in picks})
    if len(used) == 1:
        p = used[0]
        index = [r for _, r in picks]
        if index == list(range(rows_of(parts[p]))):
            return parts[p]
        return engine.regroup(parts[p], None, index)
    merged, offsets = None, {}
    for p in used:  # side by side, two at a time
        offsets[p] = 0 if merged is None else rows_of(merged)
        if merged is None:
            merged = parts[p]
        else:
            merged = engine.regroup(merged, parts[p], list(range(rows_of(merged) + rows_of(parts[p]))))
    return engine.regroup(merged, None, [offsets[p] + r for p, r in picks])


def score_runs(engine, inputs: list[list[int]], targets: list[list[int]], top_n: int, start=None,
               positions: Sequence[int] | None = None) -> tuple[list[Scores], object]:
    """``engine.score`` over any number of texts, cut into calls of bounded size; -> the
    scores in order and the states after each text (a device batch in the same order).
    ``start``: the states to start from (a device batch, row b for text b), with the
    ``positions`` (tokens already read) of each."""
    budget = tokens_per_call(engine.config)
    out: list[Scores | None] = [None] * len(inputs)
    parts, picks = [], [(0, 0)] * len(inputs)
    for call in _calls([len(t) for t in targets], budget):
        kwargs = {}
        if start is not None:
            kwargs = dict(start_states=gather(engine, [start], [(0, i) for i in call]),
                          start_positions=np.asarray([positions[i] for i in call], np.int64))
        res = engine.score([inputs[i] for i in call], [targets[i] for i in call], top_n=top_n, **kwargs)
        for row, i in enumerate(call):
            out[i] = Scores(np.asarray(targets[i], np.int64), np.asarray(res.logprobs[row], np.float32),
                            np.asarray(res.top_ids[row], np.int64), np.asarray(res.top_logprobs[row], np.float32))
            picks[i] = (len(parts), row)
        parts.append(res.states)
    states = gather(engine, parts, picks) if parts else None
    return out, states


def prompt_states(engine, prompts: list[list[int]], prefix_cache: PrefixCache | None = None):
    """The states after each prompt but its last token, for distinct prompts: one prefill
    per batch of those of two tokens or more (through ``prefix_cache`` when the engine can
    use it), empty states for one-token prompts; -> (a device batch, the row of each
    prompt in it)."""
    cache = usable_cache(engine, prefix_cache)
    longer = [i for i, p in enumerate(prompts) if len(p) > 1]
    parts, picks = [], [(0, 0)] * len(prompts)
    for call in _calls([len(prompts[i]) - 1 for i in longer], tokens_per_call(engine.config)):
        members = [longer[j] for j in call]
        heads = [prompts[i][:-1] for i in members]
        pre = engine.prefill(heads) if cache is None else prefill_cached(engine, cache, heads)[0]
        for row, i in enumerate(members):
            picks[i] = (len(parts), row)
        parts.append(pre.states)
    single = [i for i, p in enumerate(prompts) if len(p) == 1]
    if single:
        for row, i in enumerate(single):
            picks[i] = (len(parts), row)
        parts.append(engine.empty_states(len(single)))
    return gather(engine, parts, picks), list(range(len(prompts)))


# Engines whose score refused start states (the PHA's: its attention would need each
# sample's cached keys and values of the earlier tokens): asked once per engine.
_REFUSED_STATES: "weakref.WeakSet" = weakref.WeakSet()


def continues_from_states(engine) -> bool:
    """Whether ``engine.score`` starts from given states: as the engine says
    (``supports_start_state``), else until it has refused them once (a GenerationError
    on a first call with start states)."""
    said = getattr(engine, "supports_start_state", None)
    return bool(said) if said is not None else engine not in _REFUSED_STATES


class ContinuationScorer:
    """Scores tokens that follow a prompt, call after call (see the module docs).

    ``score([(key, prompt, new_tokens), ...])``: the log-probabilities of each key's new
    tokens, after its prompt and the tokens its earlier calls scored. A key's first call
    starts from its prompt's state; later calls continue where it stopped. ``forget``
    drops keys that are done. ``prefix_cache``: the prompts' prefills go through it
    (``prompt_states``).
    """

    def __init__(self, engine, top_n: int, prefix_cache: PrefixCache | None = None):
        self.engine, self.top_n, self.prefix_cache = engine, top_n, prefix_cache
        self.from_states = continues_from_states(engine)
        self._states = None  # [L, R, ...]: each key's state before its last token (from_states)
        self._row: dict[Hashable, int] = {}
        self._last: dict[Hashable, int] = {}  # each key's last token: its next call reads it first
        self._read: dict[Hashable, int] = {}  # tokens each key's state has read
        self._texts: dict[Hashable, list[int]] = {}  # without start states: each key's whole text

    def forget(self, keys) -> None:
        for k in keys:
            for d in (self._row, self._last, self._read, self._texts):
                d.pop(k, None)

    def score(self, items: Sequence[tuple[Hashable, list[int], list[int]]]) -> list[Scores]:
        out = [Scores.empty(self.top_n)] * len(items)
        work = [(i, k, p, list(t)) for i, (k, p, t) in enumerate(items) if len(t)]
        if not work:
            return out
        keys = [k for _, k, _, _ in work]
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice in one call")
        for k, p in ((k, p) for _, k, p, _ in work if k not in self._last):
            if not p:
                raise GenerationError("a continuation needs a prompt of at least one token")
            self._last[k], self._read[k], self._texts[k] = p[-1], len(p) - 1, list(p)
        scores = self._with_states(work) if self.from_states else self._from_start(work)
        for (i, k, _, t), s in zip(work, scores):
            out[i] = s
            self._last[k] = t[-1]
            self._read[k] += len(t)
            if not self.from_states:
                self._texts[k].extend(t)
        return out

    def _from_start(self, work) -> list[Scores]:
        texts = [self._texts[k] + t for _, k, _, t in work]
        scores, _ = score_runs(self.engine, [x[:-1] for x in texts], [x[1:] for x in texts], self.top_n)
        return [s.tail(len(t)) for s, (_, _, _, t) in zip(scores, work)]

    def _with_states(self, work) -> list[Scores]:
        eng = self.engine
        fresh = [(k, p) for _, k, p, _ in work if k not in self._row]
        parts, picks = [], []
        if self._states is not None:
            parts.append(self._states)
        if fresh:
            distinct = list(dict.fromkeys(tuple(p) for _, p in fresh))
            states, rows = prompt_states(eng, [list(p) for p in distinct], self.prefix_cache)
            prompt_row = {p: rows[j] for j, p in enumerate(distinct)}
            parts.append(states)
        for _, k, p, _ in work:
            picks.append((0, self._row[k]) if k in self._row else (len(parts) - 1, prompt_row[tuple(p)]))
        start = gather(eng, parts, picks)
        inputs = [[self._last[k]] + t[:-1] for _, k, _, t in work]
        targets = [t for _, _, _, t in work]
        try:
            scores, after = score_runs(eng, inputs, targets, self.top_n, start, [self._read[k] for _, k, _, _ in work])
        except GenerationError:
            if self._row:  # the engine took start states before: a real error
                raise
            scores = self._from_start(work)  # a real error comes back from here too
            self.from_states = False  # this engine does not continue from a state
            _REFUSED_STATES.add(eng)
            return scores
        # the new pool: the scored keys' states, then the waiting keys' old rows
        scored = {k for _, k, _, _ in work}
        waiting = [k for k in self._row if k not in scored and k in self._last]
        parts = [after] + ([self._states] if waiting else [])
        picks = [(0, j) for j in range(len(work))] + [(1, self._row[k]) for k in waiting]
        self._states = gather(eng, parts, picks)
        self._row = {k: j for j, k in enumerate([k for _, k, _, _ in work] + waiting)}
        return scores


# ------------------------------------------------------------------ scored in the decode
def decode_top_n(sequences) -> int | None:
    """The alternatives per token that an engine call for ``sequences`` (the scheduler's)
    returns with their tokens' log-probabilities: the most any asks for (``logprobs``),
    or None where none asks. Every engine's decode computes them (the decode ops and the
    plain decode graphs alike)."""
    asked = [s.logprobs for s in sequences if s.logprobs is not None]
    return max(asked) if asked else None


def step_scores(res, step: int) -> list:
    """Per row of an engine call's ``DecodeResult``: (log-probability, top ids, top
    log-probabilities) of its token at ``step``, or None where the call returned none."""
    if res.logprobs is None:
        return [None] * len(res.tokens)
    return list(zip(res.logprobs[:, step].tolist(), res.top_ids[:, step], res.top_logprobs[:, step]))


def decoded_scores(sequence, top_n: int) -> Scores:
    """A finished sequence's tokens' log-probabilities as its decode returned them."""
    if len(sequence.token_scores) != len(sequence.tokens):
        raise ValueError("the sequence's decode did not return a log-probability for every token")
    if not sequence.token_scores:
        return Scores.empty(top_n)
    lp, ids, values = zip(*sequence.token_scores)  # rows at least top_n wide (each call's widest)
    return Scores(np.asarray(sequence.tokens, np.int64), np.asarray(lp, np.float32),
                  np.stack([r[:top_n] for r in ids]).astype(np.int64),
                  np.stack([r[:top_n] for r in values]).astype(np.float32))


def completion_scores(sequences, top_n: int) -> list[Scores]:
    """The log-probabilities of finished sequences' tokens after their prompts, as their
    decode returned them (``decoded_scores``): no second pass over the tokens."""
    return [decoded_scores(s, top_n) for s in sequences]


def score_continuations(engine, prompts: list[list[int]], continuations: list[list[int]], top_n: int,
                        prefix_cache: PrefixCache | None = None) -> list[Scores]:
    """The log-probabilities of each continuation after its prompt (prompts shared by
    several continuations read once: see ``ContinuationScorer``)."""
    return ContinuationScorer(engine, top_n, prefix_cache).score(
        [(i, list(p), list(c)) for i, (p, c) in enumerate(zip(prompts, continuations))])


__all__ = ["ContinuationScorer", "MAX_TOP_N", "Scores", "check_top_n", "completion_scores", "continues_from_states",
           "decode_top_n", "decoded_scores", "gather", "step_scores",
           "prompt_states", "rolling_windows", "score_continuations", "score_windows", "score_runs", "tokens_per_call"]
