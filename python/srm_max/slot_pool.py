"""Massive sampling with slot refill (continuous batching).

A fixed pool of B state slots runs every decode step. When a sample finishes
(stop, length or context), its slot is refilled at once with the next pending
sample: that sample's prompt is prefilled (several refills share one prefill
call), its state is written into the slot, and it continues from its own
position. No padding to the longest sequence, no idle slot while work remains.

Each sample's randomness depends only on its own seed, ``sample_seed(seed,
prompt_index, sample_index)``, and its positions, so a sample is the same
whether it ran in a pool, in any slot, or alone with ``generate(..., seed=that)``.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .engine import SamplingArrays
from .errors import GenerationError
from .sampling import SamplingParams, check_max_new_tokens, resolve_seed

# Per-sample memory the decode step needs besides its state: logits, sorted
# logits and probabilities for top-k/top-p, and the activations of one layer.
_SAMPLER_COPIES = 4
_ACTIVATION_COPIES = 8


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one sample: a hash, so nearby (prompt, sample) pairs are unrelated."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def plan_max_batch(config, memory_budget_bytes: int = 4 << 30, weight_bytes_per_param: int = 4,
                   max_batch: int = 65536) -> int:
    """The largest slot pool whose weights, states and step activations fit the budget."""
    weights = config.num_parameters() * weight_bytes_per_param
    if config.architecture == "pha":
        from .graphs.pha import StateLayout

        # GSS state + KV caches; the widest activation: an FFN, the GSS gate, or attention scores.
        state = config.n_layers * StateLayout.of(config).width * 4 + 8
        hidden = max(*config.ffn_dims, config.gss_expansion_dim, config.n_q_heads * config.context_length)
    else:
        state = config.n_layers * config.d_model * 4 + 8  # float32 state + position
        hidden = config.ffn_dim
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


@dataclass
class PoolStats:
    """What the pool did: for checking that no slot idled while work was pending."""

    slots: int = 0
    decode_steps: int = 0
    prefill_calls: int = 0
    busy_slot_steps: int = 0
    idle_slot_steps_while_pending: int = 0
    seconds: float = 0.0
    samples: int = 0
    tokens: int = 0
    active_per_step: list[int] = field(default_factory=list)


def sample_many(generator, prompts, n: int, verifier: Callable | None = None, max_batch="auto",
                max_new_tokens: int = 64, temperature=1.0, top_k=0, top_p=1.0, seed: int | None = None, stop=None,
                memory_budget_bytes: int = 4 << 30, stats: PoolStats | None = None) -> Iterator[Sample]:
    """Yield ``n`` samples of every prompt, in order of completion (see module docs).

    ``verifier(text)`` (or ``verifier(ids)`` without a tokenizer) scores each sample.
    ``seed=None`` draws a fresh seed (``Generator.sample_many`` reports it).
    """
    seed = resolve_seed(seed)
    ids, _ = generator._normalize_prompts(prompts if isinstance(prompts, list) else [prompts])
    if not isinstance(n, int) or n < 1:
        raise GenerationError(f"n must be an integer >= 1, got {n!r}")
    max_new = check_max_new_tokens(max_new_tokens)
    stop_ids, stop_strings = generator._normalize_stop(stop)
    SamplingParams.build(1, temperature, top_k, top_p, 0)  # validates the scalars
    if max_batch == "auto":
        max_batch = plan_max_batch(generator.config, memory_budget_bytes)
    if not isinstance(max_batch, int) or max_batch < 1:
        raise GenerationError(f"max_batch must be 'auto' or an integer >= 1, got {max_batch!r}")
    pending = deque((p, s) for p in range(len(ids)) for s in range(n))
    return _run(generator, ids, pending, min(max_batch, len(pending)), verifier, max_new,
                float(temperature), int(top_k), float(top_p), seed, stop_ids, stop_strings,
                stats if stats is not None else PoolStats())


def _run(gen, prompts, pending, B, verifier, max_new, temperature, top_k, top_p, seed, stop_ids,
         stop_strings, stats) -> Iterator[Sample]:
    engine, n_ctx = gen.engine, gen.config.context_length
    stats.slots = B
    start = time.perf_counter()
    slot_job: list[tuple[int, int] | None] = [None] * B
    slot_tokens: list[list[int]] = [[] for _ in range(B)]
    sampling = SamplingArrays(np.full(B, temperature, np.float32), np.full(B, top_k, np.int64),
                              np.full(B, top_p, np.float32), np.zeros(B, np.uint64))
    positions = np.zeros(B, np.int64)  # position of the token in ``next_ids``
    next_ids = np.zeros(B, np.int64)
    states = engine.empty_states(B)
    finished: list[Sample] = []

    def finish(slot: int, reason: str, cut: int | None = None) -> None:
        p, s = slot_job[slot]
        tokens = slot_tokens[slot]
        text = gen.decode(tokens)
        if text is not None and cut is not None:
            text = text[:cut]
        score = None if verifier is None else float(verifier(text if text is not None else tokens))
        finished.append(Sample(p, s, tokens, text, reason, int(sampling.seed[slot]), score))
        stats.samples += 1
        stats.tokens += len(tokens)
        slot_job[slot] = None

    def accept(slot: int, token: int) -> None:
        """Take one new token for a running slot; finish the sample if it is done."""
        p, _ = slot_job[slot]
        if token in stop_ids:
            return finish(slot, "stop")
        slot_tokens[slot].append(token)
        if stop_strings:
            text = gen.decode(slot_tokens[slot]) or ""
            hits = [text.find(x) for x in stop_strings if x in text]
            if hits:
                return finish(slot, "stop", min(hits))
        if len(slot_tokens[slot]) >= max_new:
            return finish(slot, "length")
        if len(prompts[p]) + len(slot_tokens[slot]) >= n_ctx:
            return finish(slot, "context")

    def refill() -> None:
        nonlocal states
        free = [b for b in range(B) if slot_job[b] is None]
        while free and pending:
            starting = []
            for b in free:
                if not pending:
                    break
                p, s = pending.popleft()
                if max_new == 0 or len(prompts[p]) >= n_ctx:  # nothing to generate
                    slot_job[b], slot_tokens[b] = (p, s), []
                    sampling.seed[b] = sample_seed(seed, p, s)
                    finish(b, "length" if max_new == 0 else "context")
                    continue
                slot_job[b], slot_tokens[b] = (p, s), []
                sampling.seed[b] = sample_seed(seed, p, s)
                starting.append(b)
            if starting:
                rows = np.array(starting)
                result = engine.prefill([prompts[slot_job[b][0]] for b in starting], sampling.take(rows))
                stats.prefill_calls += 1
                host_states = engine.host(states)
                host_states[:, rows] = engine.host(result.states)
                states = engine._dev(host_states)
                for b, token in zip(starting, result.next_ids.tolist()):
                    positions[b] = len(prompts[slot_job[b][0]])
                    next_ids[b] = token
                    accept(b, int(token))
            free = [b for b in range(B) if slot_job[b] is None]

    refill()
    yield from _drain(finished)
    while any(job is not None for job in slot_job):
        active = [b for b in range(B) if slot_job[b] is not None]
        stats.active_per_step.append(len(active))
        stats.busy_slot_steps += len(active)
        if pending:
            stats.idle_slot_steps_while_pending += B - len(active)
        # Idle slots still run (a fixed pool); park them at position 0 so they stay in range.
        idle = np.array([slot_job[b] is None for b in range(B)])
        step_positions = np.where(idle, 0, positions)
        result = engine.decode(next_ids, step_positions, states, sampling, 1)
        stats.decode_steps += 1
        states = result.states
        tokens = result.tokens[:, 0]
        for b in active:
            positions[b] += 1
            next_ids[b] = tokens[b]
            accept(b, int(tokens[b]))
        refill()
        yield from _drain(finished)
    stats.seconds = time.perf_counter() - start


def _drain(finished: list) -> Iterator[Sample]:
    while finished:
        yield finished.pop(0)
