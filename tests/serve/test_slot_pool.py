"""Massive sampling with slot refill: same samples as alone, no idle slots, finish reasons."""

from __future__ import annotations

import re
from collections import Counter
from itertools import islice

import numpy as np
import pytest

from srm_max import GenerationError, Generator
from srm_max.serve.sample_many import plan_max_batch, sample_many, sample_seed
from srm_max.serve.scheduler import PoolStats
from tests.support.graphs import graphs
from tests.support.tiny import TINY

pytestmark = graphs(TINY)


def rnd_prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, n).tolist()


def decode_steps(sample) -> int:
    """Decode steps a sample occupied its slot: every token after the prefill's first one."""
    produced = len(sample.ids) + (sample.finish_reason == "stop")
    return max(0, produced - 1)


def check_no_idle(stats: PoolStats, samples) -> None:
    B = stats.slots
    assert stats.idle_slot_steps_while_pending == 0
    steps = stats.active_per_step
    # full while work is pending, then only draining (never refilled below B)
    first_short = next((i for i, a in enumerate(steps) if a < B), len(steps))
    assert all(a == B for a in steps[:first_short])
    assert all(x >= y for x, y in zip(steps[first_short:], steps[first_short + 1:]))
    # every slot-step ran a live sample: no wasted work at all
    assert stats.busy_slot_steps == sum(steps) == sum(decode_steps(s) for s in samples)
    assert stats.samples == len(samples) and stats.tokens == sum(len(s.ids) for s in samples)


def test_same_samples_as_alone_and_no_idle_slot(generator):
    prompts = [rnd_prompt(3, 1), rnd_prompt(17, 2), rnd_prompt(40, 3)]
    n, seed = 4, 99
    kw = dict(max_new_tokens=14, temperature=1.0, top_k=0, top_p=0.9, stop=[7, 11])
    stats = PoolStats()
    samples = list(sample_many(generator, prompts, n, max_batch=5, seed=seed, stats=stats, steps_per_call=1, **kw))
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [
        (p, i) for p in range(len(prompts)) for i in range(n)]
    for s in samples:
        assert s.seed == sample_seed(seed, s.prompt_index, s.sample_index)
        alone = generator.generate(prompts[s.prompt_index], seed=s.seed, **kw)
        assert (s.ids, s.finish_reason) == (alone.ids, alone.finish_reason), (s.prompt_index, s.sample_index)
    assert len({tuple(s.ids) for s in samples}) > len(prompts)  # the seeds really differ
    assert {s.finish_reason for s in samples} <= {"stop", "length"}
    assert stats.slots == 5 and stats.prefill_calls >= 2  # refilled
    check_no_idle(stats, samples)
    assert stats.seconds > 0


def test_samples_do_not_depend_on_pool_size(generator):
    prompts = [rnd_prompt(5, 4), rnd_prompt(9, 5)]
    kw = dict(max_new_tokens=10, temperature=1.0, seed=3, stop=[2])
    key = lambda s: (s.prompt_index, s.sample_index)  # noqa: E731
    a = sorted(sample_many(generator, prompts, 3, max_batch=1, **kw), key=key)
    b = sorted(sample_many(generator, prompts, 3, max_batch=4, **kw), key=key)
    assert [(x.ids, x.finish_reason) for x in a] == [(x.ids, x.finish_reason) for x in b]


def _stop_case(generator):
    """A short prompt whose greedy path meets token X, one that does not, and X."""
    cands = [rnd_prompt(6, 100 + i) for i in range(12)]
    outs = generator.generate(cands, max_new_tokens=8)
    for i, o in enumerate(outs):
        for k in range(1, 8):
            x = o.ids[k]
            if x in o.ids[:k]:
                continue
            other = next((j for j, q in enumerate(outs) if j != i and x not in q.ids), None)
            if other is not None:
                return cands[i], cands[other], x, k
    pytest.skip("no greedy path separates a stop token")


def test_finish_reasons_stop_length_context(generator):
    stopping, running, x, k = _stop_case(generator)
    long = rnd_prompt(TINY.context_length - 3, 9)
    prompts = [stopping, running, long]
    stats = PoolStats()
    samples = list(sample_many(generator, prompts, 2, max_batch=2, max_new_tokens=8, temperature=0.0,
                               stop=[x], stats=stats, steps_per_call=1))
    by_prompt = {p: [s for s in samples if s.prompt_index == p] for p in range(3)}
    assert all(s.finish_reason == "stop" and len(s.ids) == k for s in by_prompt[0])
    assert all(s.finish_reason == "length" and len(s.ids) == 8 for s in by_prompt[1])
    assert all(s.finish_reason == "context" and len(s.ids) == 3 for s in by_prompt[2])
    for s in samples:
        alone = generator.generate(prompts[s.prompt_index], max_new_tokens=8, stop=[x])
        assert (s.ids, s.finish_reason) == (alone.ids, alone.finish_reason)
    check_no_idle(stats, samples)
    # completion order: the early stops come out before the long runs of the same pool
    assert samples[0].finish_reason in ("stop", "context")


def test_nothing_to_generate(generator):
    full = rnd_prompt(TINY.context_length, 1)
    out = list(sample_many(generator, [full, [1, 2]], 2, max_batch=3, max_new_tokens=0))
    assert Counter(s.finish_reason for s in out) == {"length": 4}
    out = list(sample_many(generator, [full], 2, max_batch=3, max_new_tokens=5))
    assert [(s.ids, s.finish_reason) for s in out] == [([], "context")] * 2


def test_verifier_scores_every_sample(generator):
    prompts = [rnd_prompt(4, 1), rnd_prompt(4, 2)]
    samples = list(sample_many(generator, prompts, 3, max_batch=4, max_new_tokens=6, temperature=1.0,
                               verifier=lambda ids: float(3 in ids)))
    assert all(s.score == float(3 in s.ids) for s in samples) and all(s.text is None for s in samples)


def test_auto_max_batch_uses_plan(generator):
    weights = TINY.num_parameters() * 4
    one = (1 << 30) - weights
    per = one // plan_max_batch(TINY, 1 << 30, max_batch=1 << 40)  # bytes per sample
    budget = weights + 3 * per + per // 2
    assert plan_max_batch(TINY, budget) == 3
    stats = PoolStats()
    out = list(sample_many(generator, [rnd_prompt(4, 1)], 7, max_batch="auto", memory_budget_bytes=budget,
                           max_new_tokens=4, temperature=1.0, stats=stats))
    assert len(out) == 7 and stats.slots == 3
    stats = PoolStats()
    list(sample_many(generator, [rnd_prompt(4, 1)], 2, max_new_tokens=2, stats=stats))
    assert stats.slots == 2  # the default plan is large; never more slots than samples


BAD = [
    ("n = 0", dict(n=0), "n must be"),
    ("n float", dict(n=2.0), "n must be"),
    ("max_batch 0", dict(max_batch=0), "max_batch"),
    ("max_batch text", dict(max_batch="big"), "max_batch"),
    ("temperature < 0", dict(temperature=-1.0), "temperature"),
    ("top_p 0", dict(top_p=0.0), "top_p"),
    ("max_new_tokens < 0", dict(max_new_tokens=-1), "max_new_tokens"),
    ("empty prompt", dict(prompts=[[1], []]), "prompt 1 is empty"),
    ("token outside vocab", dict(prompts=[[1, 64]]), "token id 64"),
    ("stop id outside vocab", dict(stop=[99]), "stop token id 99"),
    ("budget holds no sample", dict(memory_budget_bytes=1000), "memory budget"),
    ("steps_per_call 0", dict(steps_per_call=0), "steps_per_call"),
]


@pytest.mark.parametrize("what,kwargs,message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_before_any_work(generator, what, kwargs, message):
    args = dict(prompts=[[1, 2, 3]], n=2, max_batch="auto", max_new_tokens=4) | kwargs
    with pytest.raises(GenerationError, match=message):
        sample_many(generator, args.pop("prompts"), args.pop("n"), **args)  # raises eagerly


def test_samples_are_made_as_slots_free_up(generator, monkeypatch):
    """The (prompt, sample) pairs are made as the pool takes them, in order, each with its own
    seed: what a run holds is bounded by its pool, not by n."""
    from srm_max.serve import sample_many as module

    made, plain = [], module.Sequence

    def counted(*args, **kwargs):
        made.append(kwargs["tag"])
        return plain(*args, **kwargs)

    monkeypatch.setattr(module, "Sequence", counted)
    prompts = [rnd_prompt(3, 1), rnd_prompt(5, 2)]
    kw = dict(max_new_tokens=1, temperature=1.0)
    run = sample_many(generator, prompts, 10**5, max_batch=3, seed=7, **kw)
    first = list(islice(run, 20))
    run.close()
    assert len(made) <= 20 + 2 * 3  # the pool's free slots and a pool's worth more, ahead of the samples
    assert made[:20] == [(s.prompt_index, s.sample_index) for s in first] == [(0, i) for i in range(20)]
    for s in first[:4]:
        assert s.seed == sample_seed(7, 0, s.sample_index)
        assert s.ids == generator.generate(prompts[0], seed=s.seed, **kw).ids
    monkeypatch.undo()
    run = generator.sample_many(prompts, 10**12, max_batch=3, seed=7, **kw)
    assert [(s.ids, s.seed) for s in islice(run, 4)] == [(s.ids, s.seed) for s in first[:4]]
    run.close()


def test_a_verifier_must_return_a_number(generator):
    for value in ("yes", None, [1.0]):
        run = sample_many(generator, [rnd_prompt(4, 1)], 2, max_batch=2, max_new_tokens=2,
                          verifier=lambda ids: value)
        with pytest.raises(GenerationError, match=rf"verifier returned {re.escape(repr(value))}: it must return"):
            next(run)
    for value, score in ((True, 1.0), (np.float32(0.5), 0.5), (3, 3.0)):
        [s] = sample_many(generator, [rnd_prompt(4, 1)], 1, max_new_tokens=2, verifier=lambda ids: value)
        assert s.score == score


def test_each_prompt_is_prefilled_once_and_its_state_forked(generator):
    """n samples of a prompt share one prefill (its state and logits); each still draws its
    own first token from its own seed: the same tokens as that sample alone."""
    prompts = [rnd_prompt(7, 8), rnd_prompt(40, 9)]
    n = 6
    kw = dict(max_new_tokens=8, temperature=1.0, top_k=0, top_p=0.9)
    stats = PoolStats()
    samples = list(sample_many(generator, prompts, n, max_batch=len(prompts) * n, seed=5, stats=stats, **kw))
    assert stats.prefill_calls == 1 and stats.prompts_prefilled == len(prompts)
    for s in samples:
        alone = generator.generate(prompts[s.prompt_index], seed=s.seed, **kw)
        assert (s.ids, s.finish_reason) == (alone.ids, alone.finish_reason), (s.prompt_index, s.sample_index)
    assert all(len({tuple(s.ids[:1]) for s in samples if s.prompt_index == p}) > 1 for p in range(len(prompts)))


def test_refill_regroups_states_on_the_device(generator, monkeypatch):
    """Refills, forks and compactions move states only through the engine's regroup graph
    (no state comes back to the host), and that graph is the gather it promises. The prefix
    cache is off here: it keeps host copies of prefilled states by design."""
    eng = generator.engine
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((TINY.n_layers, 3, TINY.n_heads, TINY.head_dim)).astype(np.float32)
    fresh = rng.standard_normal((TINY.n_layers, 2, TINY.n_heads, TINY.head_dim)).astype(np.float32)
    index = [4, 0, 2, 3, 3]
    got = eng.host(eng.regroup(eng.to_device(pool), eng.to_device(fresh), index))
    np.testing.assert_array_equal(got, np.concatenate([pool, fresh], axis=1)[:, index])
    np.testing.assert_array_equal(eng.host(eng.regroup(None, eng.to_device(fresh), [1, 1])), fresh[:, [1, 1]])
    # a donated pool whose rows keep their slots takes the fresh rows in place; any other
    # index, or a pool not donated, gets new states from the graph and leaves the pool alone
    kept = eng.to_device(pool)
    for index, donate in (([0, 4, 2], False), ([1, 4, 2], True), ([0, 4, 2, 3], True)):
        got = eng.regroup(kept, eng.to_device(fresh), index, donate_pool=donate)
        assert got is not kept
        np.testing.assert_array_equal(eng.host(got), np.concatenate([pool, fresh], axis=1)[:, index])
        np.testing.assert_array_equal(eng.host(kept), pool)
    got = eng.regroup(kept, eng.to_device(fresh), [0, 4, 3], donate_pool=True)
    assert got is kept
    np.testing.assert_array_equal(eng.host(got), np.concatenate([pool, fresh], axis=1)[:, [0, 4, 3]])

    host = type(eng).host
    state_rank = pool.ndim

    def host_without_states(buf):
        assert len(buf.shape) != state_rank, "a state went through the host"
        return host(buf)

    monkeypatch.setattr(eng, "host", host_without_states)
    prompts = [rnd_prompt(5, 1), rnd_prompt(9, 2)]
    kw = dict(max_new_tokens=10, temperature=1.0, stop=[7, 11])
    stats = PoolStats()
    uncached = Generator.from_engine(eng, prefix_cache_mb=0)
    samples = list(sample_many(uncached, prompts, 5, max_batch=4, seed=3, stats=stats, **kw))
    monkeypatch.undo()
    # the later samples of a prompt fork the last prefill; only a refill that mixes the kept
    # prompt's samples with a new prompt's prefills both (without the reuse: one per refill)
    assert len(samples) == 10 and stats.prompts_prefilled <= len(prompts) + 1
    for s in samples:
        alone = generator.generate(prompts[s.prompt_index], seed=s.seed, **kw)
        assert (s.ids, s.finish_reason) == (alone.ids, alone.finish_reason), (s.prompt_index, s.sample_index)


def test_a_refill_that_fills_every_finished_row_writes_only_the_new_rows(generator, monkeypatch):
    """Samples of staggered lengths through 3 slots: each one finishing alone frees a slot that
    the next pending one takes, every other row staying where it is, so the engine writes the
    new row into the pool's states (a CPU's states are on the host) rather than regrouping
    the batch. Each sample's tokens are still those it gets alone."""
    from srm_max.serve.scheduler import SlotPool
    from srm_max.serve.sequence import Sequence

    eng = generator.engine
    in_place, regroup = [], eng.regroup

    def recorded(pool, fresh, index, donate_pool=False):
        got = regroup(pool, fresh, index, donate_pool=donate_pool)
        in_place.append(got is pool)
        return got

    monkeypatch.setattr(eng, "regroup", recorded)
    prompts = [rnd_prompt(4 + i, 10 + i) for i in range(6)]
    seqs = [Sequence(p, 0.0, 0, 1.0, 0, max_new) for p, max_new in zip(prompts, [3, 6, 9, 4, 7, 5])]
    pool = SlotPool(eng, generator.decode, 3, steps_per_call=4)
    pool.submit(seqs)
    for _ in pool.run():
        pass
    monkeypatch.undo()
    assert in_place[0] is False and sum(in_place) >= 2, in_place  # the first batch is gathered from fresh states
    for s in seqs:
        assert s.tokens == generator.generate(s.prompt, max_new_tokens=s.max_new).ids
