"""The prefix-state cache (serve/prefix_cache.py) and the scheduler's use of it.

Three parts: the cache alone (pure Python); the scheduler on a toy recurrent engine in
numpy (its states are the same however a prompt is split, so tokens must be exactly
equal with and without the cache, and the calls it received show what was prefilled);
and the SRM engine on the suite's TINY config, where a state reached in pieces differs
from one reached in one go only by the order of the scan's sums: tokens must be equal,
final logits within 1e-4 of their scale.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from srm_max import GenerationError
from srm_max.runtime.call_types import DecodeResult, PrefillResult
from srm_max.serve.prefix_cache import PrefixCache, cache_of, common_prefix, prefix_hashes
from srm_max.graphs.slots import slots_taken
from srm_max.serve.scheduler import SlotPool
from srm_max.serve.sequence import Sequence
from tests.support.graphs import ENGINE_KINDS, graphs
from tests.support.prefix_cache import generators
from tests.support.prompts import random_prompts
from tests.support.tiny import TINY


def state(value: float, size: int = 4) -> np.ndarray:
    return np.full(size, value, np.float32)


# ------------------------------------------------------------ the cache alone
def test_prefix_hashes_are_the_rolling_hash():
    tokens = np.random.default_rng(0).integers(0, 50_000, 300)
    h, expected = 0, [0]
    for t in tokens:
        h = (h * 0x9E3779B97F4A7C15 + int(t) + 1) % (1 << 64)
        expected.append(h)
    assert [int(x) for x in prefix_hashes(tokens)] == expected
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 4])) == 2


def test_longest_prefix_leaves_a_token_to_prefill():
    cache = PrefixCache(1 << 20)
    for n in (2, 4, 6):
        cache.insert([1, 2, 3, 4, 5, 6][:n], state(n))
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7]).length == 6
    hit = cache.lookup([1, 2, 3, 4, 5, 6])  # the whole prompt is cached: its last token still runs
    assert hit.length == 4 and hit.state[0] == 4
    assert cache.lookup([1, 2, 3, 9]).length == 2
    assert cache.lookup([1, 2]) is None and cache.lookup([1]) is None and cache.lookup([2, 1, 3]) is None
    assert (cache.stats.hits, cache.stats.tokens_saved, cache.stats.lookups) == (3, 12, 5)


def test_colliding_hashes_are_told_apart_by_their_tokens():
    cache = PrefixCache(1 << 20, hash_mask=0)  # every prefix hashes to 0
    cache.insert([1, 2, 3], state(1))
    cache.insert([4, 5, 6], state(2))
    cache.insert([7, 8], state(3))
    assert cache.lookup([4, 5, 6, 0]).state[0] == 2
    assert cache.lookup([1, 2, 3, 0]).state[0] == 1
    assert cache.lookup([7, 8, 9, 9]).length == 2  # [7, 8, 9] is no entry although its hash matches
    assert cache.lookup([9, 9, 9, 9]) is None
    assert cache.insert([4, 5, 6], state(5)) and len(cache) == 3  # already there: kept once


def test_least_recently_used_goes_first_within_the_budget():
    entry = 3 * 4 + 4 * 4  # three int32 tokens and a float32 state of 4
    cache = PrefixCache(2 * entry)
    cache.insert([1, 1, 1], state(1))
    cache.insert([2, 2, 2], state(2))
    assert cache.bytes == 2 * entry
    assert cache.lookup([1, 1, 1, 0]) is not None  # [1, 1, 1] is now the most recent
    cache.insert([3, 3, 3], state(3))
    assert cache.lookup([2, 2, 2, 0]) is None and cache.lookup([1, 1, 1, 0]) is not None
    assert cache.bytes == 2 * entry and cache.stats.evictions == 1
    cache.insert([4, 4, 4, 4, 4, 4], state(4))  # needs both places
    assert len(cache) == 1 and cache.bytes == 6 * 4 + 4 * 4
    assert not cache.insert(list(range(20)), state(5))  # larger than the whole budget: not kept
    assert len(cache) == 1
    cache.clear()
    assert cache.bytes == 0 and len(cache) == 0


def test_budget_zero_turns_the_cache_off():
    cache = cache_of(0)
    assert not cache.enabled
    assert not cache.insert([1, 2, 3], state(1))
    assert cache.lookup([1, 2, 3, 4]) is None and cache.split_points(list(range(600)), 0) == []
    assert cache_of(None).budget_bytes == 64 << 20 and cache_of(0.5).budget_bytes == 1 << 19
    for bad in (-1, "64", True, float("inf"), float("nan"), np.float32("inf")):
        with pytest.raises(GenerationError, match="prefix_cache_mb"):
            cache_of(bad)


def test_split_points():
    cache = PrefixCache(1 << 20, interval=256, min_shared=32)
    p = list(range(1, 601))
    assert cache.split_points(p, 0) == [512]  # the last checkpoint before the end
    assert cache.split_points(p[:512], 0) == [256]  # a prompt ending at one keeps it as its end
    assert cache.split_points(p, 512) == []
    cache.remember(p[:100] + [0] * 50)
    assert cache.split_points(p, 0) == [100, 512]  # where it leaves a recent prompt
    assert cache.split_points(p, 80) == [512]  # too few tokens past the start to be worth a call
    mates = [p[:300] + [0], p[:310] + [0]]
    assert cache.split_points(p, 0, mates) == [100, 300, 512]  # 310 is within 32 of 300
    cache.remember(p)
    assert cache.split_points(p[:550], 0) == [512, 549]  # seen again: its last token is kept apart
    assert cache.split_points(p, 598) == [599]


# ------------------------------------------------------------ the scheduler, on a toy engine
class ToyEngine:
    """A recurrent model in numpy whose state after a prefix does not depend on how the
    prefix was split; it records each prefill's (start, length) per row."""

    supports_start_state = True
    D = 6

    def __init__(self, vocab: int = 11, n_ctx: int = 400, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.config = SimpleNamespace(context_length=n_ctx, vocab_size=vocab)
        self.embed, self.out = rng.standard_normal((vocab, self.D)), rng.standard_normal((self.D, vocab))
        self.prefills: list[list[tuple[int, int]]] = []

    def _run(self, s, tokens, start):
        for k, t in enumerate(tokens):
            s = 0.9 * s + np.tanh(self.embed[t] + 0.01 * (start + k))
        return s

    def _pick(self, logits, sampling, b, counter):
        if sampling is None or sampling.temperature[b] == 0:
            return int(np.argmax(logits))
        p = np.exp((logits - logits.max()) / sampling.temperature[b])
        return int(np.random.default_rng([int(sampling.seed[b]), int(counter)]).choice(len(p), p=p / p.sum()))

    def prefill(self, prompts, sampling=None, start_states=None, start_positions=None):
        B = len(prompts)
        starts = np.zeros(B, np.int64) if start_positions is None else np.asarray(start_positions)
        init = np.zeros((1, B, self.D)) if start_states is None else start_states
        states = np.stack([self._run(init[0, b], p, starts[b]) for b, p in enumerate(prompts)])[None]
        logits = states[0] @ self.out
        self.prefills.append([(int(starts[b]), len(p)) for b, p in enumerate(prompts)])
        return PrefillResult(logits, np.array([self._pick(logits[b], sampling, b, starts[b] + len(p))
                                               for b, p in enumerate(prompts)]), states)

    def draw(self, logits, rows, sampling, counters):
        return np.array([self._pick(logits[r], sampling, i, counters[i]) for i, r in enumerate(rows)])

    def regroup(self, pool, fresh, index, donate_pool=False):
        # a donated pool takes fresh rows in place, as the engines on a CPU: a pool that donated
        # states the cache still holds would change what a later prompt starts from
        index = np.asarray(index)
        taken = slots_taken(index, pool.shape[1]) if donate_pool and pool is not None else None
        if taken is not None:
            pool[:, taken] = fresh[:, index[taken] - pool.shape[1]]
            return pool
        return np.concatenate([x for x in (pool, fresh) if x is not None], axis=1)[:, index]

    def decode(self, ids, positions, states, sampling, steps=1, donate_states=False):
        # donated states are written in place, as the PHA engine does: a pool that donated
        # states the cache still holds would change what a later prompt starts from
        st = states if donate_states else states.copy()
        ids, pos, tokens = np.array(ids), np.array(positions), []
        for _ in range(steps):
            for b in range(len(ids)):
                st[0, b] = self._run(st[0, b], [ids[b]], pos[b])
            logits = st[0] @ self.out
            pos = pos + 1
            ids = np.array([self._pick(logits[b], sampling, b, pos[b]) for b in range(len(ids))])
            tokens.append(ids)
        return DecodeResult(np.stack(tokens, 1), st, ids, pos)

    def sampling_buffers(self, s):
        return s

    def to_device(self, a):
        return a

    host = to_device


def run_pool(engine, prompts, cache, temperature=0.0, slots=None, max_new=5, samples=1):
    seqs = [Sequence(list(p), temperature, 0, 1.0, 1000 * i + j, max_new, tag=i)
            for i, p in enumerate(prompts) for j in range(samples)]
    pool = SlotPool(engine, lambda ids: None, slots or len(seqs), 3, prefix_cache=cache)
    pool.submit(seqs)
    for _ in pool.run():
        pass
    return [s.tokens for s in seqs], [s.cached_tokens for s in seqs]


def shared_prompts(rng, n, prefix_len, vocab=11):
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    return [prefix + rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_toy_tokens_equal_with_and_without_the_cache(temperature):
    rng = np.random.default_rng(1)
    engine = ToyEngine()
    cache = PrefixCache(1 << 20, interval=64, min_shared=8)
    batches = [shared_prompts(rng, 6, 70), shared_prompts(rng, 3, 150),
               random_prompts([5, 64, 65, 129, 1], 11, seed=2)]
    batches.append([p + [3] for p in batches[0][:3]] + batches[1][:2])  # a cached prompt + 1; a prompt again
    for slots in (None, 2):
        for prompts in batches:
            plain, _ = run_pool(engine, prompts, None, temperature, slots, samples=2)
            cached, saved = run_pool(engine, prompts, cache, temperature, slots, samples=2)
            assert cached == plain
    assert cache.stats.hits > 10 and cache.stats.tokens_saved > 1000
    for entry in cache._lru.values():  # every kept state is the state after its tokens
        np.testing.assert_allclose(entry.state[0], engine._run(np.zeros(engine.D), entry.tokens, 0), rtol=1e-12)
    assert saved[:6:2] == [len(batches[0][i]) for i in range(3)]  # a cached prompt + 1 starts at its end
    assert saved[6] == len(batches[1][0]) - 1  # a prompt seen again: only its last token runs


def test_toy_prefill_runs_only_the_rest_and_a_shared_prefix_once():
    rng = np.random.default_rng(3)
    engine = ToyEngine()
    cache = PrefixCache(1 << 20, interval=256, min_shared=8)
    prompts = shared_prompts(rng, 5, 100)
    run_pool(engine, prompts, cache)
    lcp = max(common_prefix(np.array(a), np.array(b)) for a in prompts for b in prompts if a is not b)
    assert lcp >= 100
    pieces = [row for call in engine.prefills for row in call]
    assert sum(n for _, n in pieces) < sum(map(len, prompts)) - 3 * 100  # the prefix ran at most twice
    engine.prefills.clear()
    later = prompts[0][:100] + [1, 2, 3]
    _, saved = run_pool(engine, [later], cache)
    assert saved == [100] and engine.prefills == [[(100, 3)]]
    n = len(prompts[1])
    engine.prefills.clear()
    run_pool(engine, [prompts[1]], cache)  # seen again: from the shared prefix, keeping the state at n - 1
    assert engine.prefills == [[(100, n - 101)], [(n - 1, 1)]]
    engine.prefills.clear()
    run_pool(engine, [prompts[1]], cache)  # and again: only its last token runs
    assert engine.prefills == [[(n - 1, 1)]]


def test_toy_checkpoint_inside_a_long_prompt():
    engine = ToyEngine()
    cache = PrefixCache(1 << 20, interval=64, min_shared=1000)  # checkpoints only (and prompts seen again)
    p = random_prompts([200], 11, seed=4)[0]
    run_pool(engine, [p], cache)
    assert engine.prefills == [[(0, 192)], [(192, 8)]]  # [0, 192) first: the state at 192 is kept
    engine.prefills.clear()
    run_pool(engine, [p[:193]], cache)  # one past the checkpoint
    assert engine.prefills == [[(192, 1)]]
    engine.prefills.clear()
    run_pool(engine, [p[:192]], cache)  # ends at it: a lookup leaves its last token, so from 0, kept at 128
    assert engine.prefills == [[(0, 128)], [(128, 63)], [(191, 1)]]  # and at 191, being a prefix seen before
    engine.prefills.clear()
    run_pool(engine, [p[:150] + [(p[150] + 1) % 11]], cache)
    assert engine.prefills == [[(128, 23)]]


def test_engine_without_start_states_runs_as_before():
    engine = ToyEngine()
    engine.supports_start_state = False
    cache = PrefixCache(1 << 20, interval=8)
    prompts = random_prompts([30, 30], 11, seed=5)
    assert SlotPool(engine, lambda ids: None, 2, prefix_cache=cache).prefix_cache is None
    run_pool(engine, prompts * 2, cache)
    assert engine.prefills == [[(0, 30), (0, 30)]] and len(cache) == 0


# ------------------------------------------------------------ the SRM engine (TINY)
@graphs(TINY, ("prefill",))
def test_a_state_reached_in_pieces_gives_the_same_logits(engine):
    """The tolerance: the scan sums in another order, nothing more."""
    from tests.support.checks import assert_close_rel

    p = random_prompts([90], TINY.vocab_size, seed=6)[0]
    whole = engine.prefill([p])
    for k in (1, 31, 32, 33, 64):
        head = engine.prefill([p[:k]])
        rest = engine.prefill([p[k:]], start_states=head.states, start_positions=[k])
        assert_close_rel(engine.host(rest.logits), engine.host(whole.logits), rel=1e-4)
        assert_close_rel(engine.host(rest.states), engine.host(whole.states), rel=1e-4)
        assert rest.next_ids.tolist() == whole.next_ids.tolist()


@graphs(TINY, ENGINE_KINDS)
@pytest.mark.parametrize("sampled", [False, True])
def test_tokens_equal_with_and_without_the_cache(engine, sampled):
    on, off = generators(engine)
    rng = np.random.default_rng(7)
    V = TINY.vocab_size
    system = rng.integers(0, V, 40).tolist()
    base = random_prompts([32, 64, 20, 50], V, seed=8)
    prompts = [system + rng.integers(0, V, int(rng.integers(1, 20))).tolist() for _ in range(6)]
    prompts += [base[0], base[0] + [5], base[1], base[1][:33], base[2], base[2], base[3] + [1, 2]]
    kw = dict(max_new_tokens=6, temperature=0.9 if sampled else 0.0, top_p=0.9 if sampled else 1.0)
    for seed in range(3):
        for batch in (prompts[:4], prompts[4:], [p + [seed] for p in prompts[::3]], prompts):
            a = on.generate(batch, seed=seed, **kw)
            b = off.generate(batch, seed=seed, **kw)
            assert [(x.ids, x.finish_reason) for x in a] == [(x.ids, x.finish_reason) for x in b], seed
    stats = on.prefix_cache.stats
    assert stats.hits > 20 and stats.tokens_saved > 500, stats


@graphs(TINY, ENGINE_KINDS)
def test_stream_and_sample_many_use_the_cache(engine):
    on, off = generators(engine)
    prompts = [p + q for p in random_prompts([50], TINY.vocab_size, seed=9) for q in ([1], [2, 3], [4])]
    kw = dict(max_new_tokens=5, temperature=1.0, seed=4)

    def events(gen):
        return [(e.tokens, e.finished) for e in gen.stream(prompts, **kw)]

    assert events(on) == events(off)
    before = on.prefix_cache.stats.tokens_saved
    key = lambda s: (s.prompt_index, s.sample_index)  # noqa: E731
    a = sorted(on.sample_many(prompts, 3, max_batch=2, **kw), key=key)
    b = sorted(off.sample_many(prompts, 3, max_batch=2, **kw), key=key)
    assert [x.ids for x in a] == [x.ids for x in b]
    assert on.prefix_cache.stats.tokens_saved - before >= 3 * 50


@graphs(TINY, ENGINE_KINDS)
def test_context_limits_are_as_without_the_cache(engine):
    on, off = generators(engine)
    n = TINY.context_length
    p = random_prompts([n], TINY.vocab_size, seed=10)[0]
    for gen in (on, off):
        with pytest.raises(GenerationError, match="context length"):
            gen.generate(p + [1], max_new_tokens=2)
        assert gen.generate(p, max_new_tokens=2).finish_reason == "context"
    on.generate(p[:n - 2], max_new_tokens=1)
    a, b = on.generate(p[:n - 1], max_new_tokens=3), off.generate(p[:n - 1], max_new_tokens=3)
    assert (a.ids, a.finish_reason) == (b.ids, b.finish_reason) and len(a.ids) == 1 and a.finish_reason == "context"
    assert on.prefix_cache.stats.tokens_saved >= n - 2


@graphs(TINY, ENGINE_KINDS)
def test_server_reports_cached_tokens_and_metrics(engine):
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    uvicorn = pytest.importorskip("uvicorn")
    import json
    import socket
    import threading
    import time
    import urllib.request

    from srm_max.serve.http import create_app

    on, _ = generators(engine)
    server = uvicorn.Server(uvicorn.Config(create_app(on, model_name="tiny", max_batch=4), log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def get(path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.read()

    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        p = random_prompts([45], TINY.vocab_size, seed=11)[0]
        usage = [json.loads(get("/v1/completions", {"prompt": q, "max_tokens": 2, "n": 2}))["usage"]
                 for q in (p, p + [3, 4], [[7] + p, p + [3, 4, 5]])]
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 45, 47]
        metrics = dict(line.rsplit(" ", 1) for line in get("/metrics").decode().splitlines()
                       if line.startswith("srm_prefix_cache"))
        assert float(metrics["srm_prefix_cache_hits_total"]) == 2
        assert float(metrics["srm_prefix_cache_tokens_saved_total"]) == 92
        assert float(metrics["srm_prefix_cache_bytes"]) == on.prefix_cache.bytes > 0
    finally:
        server.should_exit = True
        thread.join(30)
