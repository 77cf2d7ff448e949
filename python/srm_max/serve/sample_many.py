"""Massive sampling: ``n`` samples of every prompt through a refilled pool of slots.

A fixed pool of B slots (``scheduler.SlotPool``) runs every decode step. When a
sample finishes (stop, length or context), its slot is refilled with the next
pending sample at the end of that engine call: no padding to the longest
sequence. ``steps_per_call`` (default ``DEFAULT_STEPS_PER_CALL``, as ``generate``) trades the slot-steps a
finished sample idles until its call ends for fewer engine calls; with 1 no slot
idles while work remains. Samples are made as slots free up, prompt by prompt in
order: the pool, not ``n``, bounds what a run holds.

Each sample's randomness depends only on its own seed, ``sample_seed(seed,
prompt_index, sample_index)``, and its positions, so a sample is the same
whether it ran in a pool, in any slot, or alone with ``generate(..., seed=that)``.

``logprobs=n`` (0-20): each Sample carries its tokens' raw log-probabilities (and the
n likeliest tokens at each place), as ``generate(..., logprobs=n)``: computed in the
decode (and the first token in the graph that drew it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice

from ..errors import GenerationError
from ..models import registry
from .sampling import DEFAULT_STEPS_PER_CALL, MAX_SLOTS, brief_repr, check_max_new_tokens, check_prompts, \
    check_scalar_sampling, check_steps_per_call, check_stop, is_int, resolve_seed
from .logprobs import Logprobs, TokenTexts
from .scheduler import PoolStats, SlotPool
from .sequence import Sequence
from .scoring import check_top_n, completion_scores

# Per-sample memory the decode step needs besides its state: logits, sorted
# logits and probabilities for top-k/top-p, and the activations of one layer.
_SAMPLER_COPIES = 4
_ACTIVATION_COPIES = 8


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample: a hash, so nearby (prompt, sample) pairs are unrelated."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def plan_max_batch(config, memory_budget_bytes: int = 4 << 30, weight_bytes_per_param: int = 4,
                   max_batch: int = MAX_SLOTS) -> int:
    """The largest slot pool whose weights, states and step activations fit the budget."""
    weights = config.num_parameters() * weight_bytes_per_param
    state, hidden = registry.of(config).sample_footprint(config)
    activations = 4 * (_SAMPLER_COPIES * config.vocab_size + _ACTIVATION_COPIES * hidden)
    free = memory_budget_bytes - weights
    if free < state + activations:
        raise GenerationError(
            f"memory budget of {memory_budget_bytes / 2**20:.0f} MiB does not hold the weights "
            f"({weights / 2**20:.0f} MiB) and one sample")
    return int(max(1, min(max_batch, free // (state + activations))))


@dataclass
class Sample:
    prompt_index: int
    sample_index: int
    ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length" | "context"
    seed: int
    score: float | None = None
    logprobs: Logprobs | None = None  # with logprobs=n (see the module docs)


@dataclass(frozen=True)
class SamplingPlan:
    """A checked ``sample_many`` call: what every (prompt, sample) pair of it shares."""

    prompts: list[list[int]]
    max_batch: int
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    logprobs: int | None = None  # top-n of each sample's log-probabilities; None: none


def plan(generator, prompts, n: int, max_batch="auto", max_new_tokens: int = 64, temperature=1.0, top_k=0,
         top_p=1.0, seed: int | None = None, stop=None, memory_budget_bytes: int = 4 << 30,
         logprobs: int | None = None) -> SamplingPlan:
    """Check a ``sample_many`` call (its errors, its defaults) without running anything."""
    seed = resolve_seed(seed)
    ids, _ = check_prompts(prompts, generator.config, generator.encode)  # a single prompt is a list of one
    if not is_int(n) or n < 1:
        raise GenerationError(f"n must be an integer >= 1, got {brief_repr(n)}")
    max_new = check_max_new_tokens(max_new_tokens)
    stop_ids, stop_strings = check_stop(stop, generator.config.vocab_size, generator.tokenizer is not None)
    temperature, top_k, top_p = check_scalar_sampling(temperature, top_k, top_p)
    logprobs = check_top_n(logprobs, "logprobs", allow_none=True)
    if isinstance(max_batch, str) and max_batch == "auto":
        max_batch = plan_max_batch(generator.config, memory_budget_bytes)
    if not is_int(max_batch) or max_batch < 1:
        raise GenerationError(f"max_batch must be 'auto' or an integer >= 1, got {brief_repr(max_batch)}")
    return SamplingPlan(ids, int(max_batch), max_new, temperature, top_k, top_p, seed,
                     tuple(int(t) for t in stop_ids), tuple(stop_strings), logprobs)


def sample_many(generator, prompts, n: int, verifier: Callable | None = None, max_batch="auto",
                max_new_tokens: int = 64, temperature=1.0, top_k=0, top_p=1.0, seed: int | None = None, stop=None,
                memory_budget_bytes: int = 4 << 30, stats: PoolStats | None = None,
                steps_per_call: int = DEFAULT_STEPS_PER_CALL, logprobs: int | None = None) -> Iterator[Sample]:
    """Yield ``n`` samples of every prompt, in order of completion (see module docs).

    ``verifier(text)`` (or ``verifier(ids)`` without a tokenizer) scores each sample.
    ``seed=None`` draws a fresh seed (``Generator.sample_many`` reports it).
    """
    job = plan(generator, prompts, n, max_batch, max_new_tokens, temperature, top_k, top_p, seed, stop,
               memory_budget_bytes, logprobs)
    check_steps_per_call(steps_per_call)
    if verifier is not None and not callable(verifier):
        raise GenerationError(f"verifier must be callable (a sample's text or ids -> a number), "
                              f"got {brief_repr(verifier)}")
    pairs = ((p, s) for p in range(len(job.prompts)) for s in range(n))
    return run_pairs(generator, job, pairs, verifier, stats, steps_per_call)


def run_pairs(generator, job: SamplingPlan, pairs: Iterable[tuple[int, int]], verifier: Callable | None = None,
              stats: PoolStats | None = None, steps_per_call: int = DEFAULT_STEPS_PER_CALL) -> Iterator[Sample]:
    """The samples ``pairs`` (prompt index, sample index) of ``job``, as they finish; ``pairs``
    is read as slots free up, so it may be a lazy iterable of any length."""
    pairs = iter(pairs)
    first = list(islice(pairs, job.max_batch))  # a pool of no more slots than samples
    pool = SlotPool(generator.engine, generator.decode, max(1, len(first)), steps_per_call, stats=stats,
                    prefix_cache=generator.prefix_cache)
    stop_ids = frozenset(job.stop_ids)
    sequences = (Sequence(job.prompts[p], job.temperature, job.top_k, job.top_p, sample_seed(job.seed, p, s),
                          job.max_new_tokens, stop_ids, job.stop_strings, tag=(p, s), logprobs=job.logprobs)
                 for p, s in chain(first, pairs))
    return _samples(pool, sequences, generator.decode, verifier, job.logprobs)


def _top_up(pool: SlotPool, sequences: Iterator[Sequence]) -> None:
    """Submit the next samples: enough for the pool's free slots and a pool's worth more. The
    pool keeps seeing work waiting, so its engine calls end when a slot frees up, as if every
    sample were submitted at once (unless a pool's worth end at their first token in one turn),
    while at most that many samples exist before they start."""
    pool.submit(islice(sequences, max(0, pool.free_slots + pool.max_slots - len(pool.pending))))


def _samples(pool: SlotPool, sequences: Iterator[Sequence], decode, verifier, top_n: int | None = None
             ) -> Iterator[Sample]:
    texts = TokenTexts(decode)
    _top_up(pool, sequences)
    for turn in pool.run():
        scores = [None] * len(turn.finished)
        if top_n is not None and turn.finished:  # the samples of this engine call, together
            scores = completion_scores(turn.finished, top_n)
        for s, scored in zip(turn.finished, scores):
            text = s.text(decode)
            score = None if verifier is None else _verified(verifier, text if text is not None else s.tokens)
            lp = None if scored is None else texts.logprobs(s.tokens, scored, top_n, before=s.prompt)
            yield Sample(*s.tag, list(s.tokens), text, s.reason, s.seed, score, lp)
        _top_up(pool, sequences)  # before the pool's next turn


def _verified(verifier: Callable, sample) -> float:
    """The verifier's score of a sample (its text, or its ids), as a float."""
    score = verifier(sample)
    if not isinstance(score, (str, bytes)):  # float() would read a text of digits as a number
        try:
            return float(score)
        except (TypeError, ValueError):
            pass
    raise GenerationError(f"verifier returned {brief_repr(score)}: it must return a number (or a bool)")


__all__ = ["Sample", "SamplingPlan", "plan", "plan_max_batch", "run_pairs", "sample_many", "sample_seed"]
