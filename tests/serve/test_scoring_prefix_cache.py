"""Scoring through the prefix-state cache: a context's prefill for ``loglikelihood`` and
for the log-probabilities of generated tokens starts from the longest cached prefix and
leaves its states in the cache, with the same numbers as without it (within the
tolerance of the scan's summation order, 1e-4 of the values' scale)."""

from __future__ import annotations

import numpy as np

from tests.support.graphs import graphs
from tests.support.prefix_cache import generators
from tests.support.tiny import TINY

SCORING_KINDS = ("prefill", "regroup")
SHOTS = 40  # tokens of the shared few-shot prefix


def fewshot_requests(rng, shots: list[int], docs: int) -> list[tuple[list[int], list[int]]]:
    """Two continuations of each document, every document behind the same ``shots``."""
    V = TINY.vocab_size
    out = []
    for _ in range(docs):
        context = shots + rng.integers(0, V, int(rng.integers(3, 20))).tolist()
        out += [(context, rng.integers(0, V, int(rng.integers(1, 6))).tolist()) for _ in range(2)]
    return out


def assert_same(a, b):
    sums_a, sums_b = np.array([s for s, _ in a]), np.array([s for s, _ in b])
    np.testing.assert_allclose(sums_a, sums_b, rtol=1e-4, atol=1e-4 * np.abs(sums_b).max())
    assert [g for _, g in a] == [g for _, g in b]


@graphs(TINY, SCORING_KINDS)
def test_loglikelihood_reads_a_shared_few_shot_prefix_from_the_cache(engine):
    on, off = generators(engine)
    rng = np.random.default_rng(11)
    shots = rng.integers(0, TINY.vocab_size, SHOTS).tolist()
    first = fewshot_requests(rng, shots, 6)
    assert_same(on.loglikelihood(first), off.loglikelihood(first))
    assert off.prefix_cache.stats.lookups == 0  # off: no cache consulted
    # a later run of new documents behind the same shots starts every context from them
    saved = on.prefix_cache.stats.tokens_saved
    later = fewshot_requests(rng, shots, 5)
    assert_same(on.loglikelihood(later), off.loglikelihood(later))
    assert on.prefix_cache.stats.tokens_saved - saved >= 5 * SHOTS


@graphs(TINY, SCORING_KINDS + ("sample", "decode_steps"))
def test_generated_logprobs_equal_with_and_without_the_cache(engine):
    on, off = generators(engine)
    rng = np.random.default_rng(12)
    system = rng.integers(0, TINY.vocab_size, 70).tolist()
    prompts = [system + rng.integers(0, TINY.vocab_size, int(rng.integers(1, 10))).tolist() for _ in range(3)]
    kw = dict(max_new_tokens=6, temperature=0.9, seed=3, logprobs=3)
    for _ in range(2):  # the second round finds the system prompt and the prompts in the cache
        a, b = on.generate(prompts, **kw), off.generate(prompts, **kw)
        for x, y in zip(a, b):
            assert x.ids == y.ids
            np.testing.assert_allclose(x.logprobs.logprobs, y.logprobs.logprobs, rtol=1e-4, atol=1e-4)
    assert on.prefix_cache.stats.tokens_saved > 0
