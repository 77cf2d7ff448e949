"""The prefill graph's first new token with its log-probabilities (``engine.prefill(...,
logprobs=n)``, ``graphs/sampler.py`` ``drawn_logprobs``): the drawn token's raw
log-probability and the top-n equal the PyTorch reference's log_softmax at the prompt's
last token; asking for them changes no token, no logit and no state; from a start state
too. TINY SRM (V = 64, context 96), the default CPU engine (the Mojo ops: the row op)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srm_max.errors import GenerationError
from srm_max.runtime.call_types import SamplingArrays
from tests.support.graphs import graphs
from tests.support.prompts import padded_batch, random_prompts
from tests.support.tiny import TINY

pytestmark = [graphs(TINY, ("prefill", "sample")), graphs(TINY, ("prefill",), dtype="bfloat16")]

LOGPROB_ATOL = 1e-4  # float32 engine against the float32 reference's log_softmax
BF16_REL = 0.02  # bfloat16 weights: of the row's largest |log-probability| (as the decode's bound)
# (temperature, top_k, top_p) per sample: greedy, plain, top-k, top-p, both
SAMPLED = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.9)]


def sampling(rows, seed=0) -> SamplingArrays:
    t, k, p = (np.array(c) for c in zip(*rows))
    return SamplingArrays(t.astype(np.float32), k.astype(np.int64), p.astype(np.float32),
                          np.arange(seed, seed + len(rows), dtype=np.uint64))


def last_logprobs(reference, prompts) -> np.ndarray:
    """[B, V]: log_softmax of the reference's logits after each prompt's last token."""
    ids, lengths = padded_batch(prompts)
    with torch.no_grad():
        logits = reference.prefill(ids, lengths)[0]
    full = torch.log_softmax(logits.double(), dim=-1).numpy()
    return np.stack([full[b, n - 1] for b, n in enumerate(lengths.tolist())])


def check(engine, reference, prompts, rows, top_n, rel=None):
    s = sampling(rows)
    res = engine.prefill(prompts, s, logprobs=top_n)
    plain = engine.prefill(prompts, s)
    np.testing.assert_array_equal(res.next_ids, plain.next_ids)  # asking changes no token
    np.testing.assert_array_equal(engine.host(res.logits), engine.host(plain.logits))
    np.testing.assert_array_equal(engine.host(res.states), engine.host(plain.states))
    assert plain.scores is None
    first = res.scores
    B = len(prompts)
    np.testing.assert_array_equal(first.tokens[:, 0], res.next_ids)
    assert first.logprobs.shape == (B, 1) and first.logprobs.dtype == np.float32
    assert first.top_ids.shape == (B, 1, top_n) and first.top_logprobs.shape == (B, 1, top_n)
    ref = last_logprobs(reference, prompts)
    tol = LOGPROB_ATOL if rel is None else rel * np.abs(ref).max()  # the rows' largest |log-probability|
    np.testing.assert_allclose(first.logprobs[:, 0], ref[np.arange(B), res.next_ids], rtol=0, atol=tol)
    top = np.argsort(-ref, axis=-1, kind="stable")[:, :top_n]
    want = np.take_along_axis(ref, top, -1)
    np.testing.assert_allclose(first.top_logprobs[:, 0], want, rtol=0, atol=tol)
    if rel is None:
        np.testing.assert_array_equal(first.top_ids[:, 0], top)
    assert (np.diff(first.top_logprobs[:, 0], axis=-1) <= 0).all()
    return res


def test_prefill_logprobs_equal_the_reference_greedy_and_sampled(engine, reference):
    """A mixed batch (greedy, temperature, top-k, top-p), prompts of 1 token to the context
    less one: the drawn tokens' log-probabilities are the raw logits' log_softmax."""
    prompts = random_prompts([1, 9, 33, 50, TINY.context_length - 1], TINY.vocab_size, 5)
    for top_n in (5, 0, 20):
        check(engine, reference, prompts, SAMPLED, top_n)
    check(engine, reference, prompts[2:3], SAMPLED[1:2], 3)


def test_prefill_logprobs_equal_the_sample_graph(engine):
    """The prefill's own draw and the sample graph on its logits (``draw_scored``): the same
    tokens and numbers, bit for bit (one row op), so a request's numbers do not depend on
    which graph drew its first token."""
    prompts = random_prompts([4, 17, 40], TINY.vocab_size, 6)
    s = sampling(SAMPLED[1:4], seed=7)
    res = engine.prefill(prompts, s, logprobs=5)
    lengths = [len(p) for p in prompts]
    drawn = engine.draw_scored(res.logits, [0, 1, 2], s, lengths, 5)
    np.testing.assert_array_equal(res.scores.tokens, drawn.tokens)
    np.testing.assert_array_equal(res.scores.top_ids, drawn.top_ids)
    np.testing.assert_array_equal(res.scores.logprobs, drawn.logprobs)
    np.testing.assert_array_equal(res.scores.top_logprobs, drawn.top_logprobs)


def test_prefill_logprobs_from_a_start_state(engine, reference):
    """A prompt continued from the state after its head: the first token's log-probability
    is the whole prompt's."""
    prompts = random_prompts([20, 45], TINY.vocab_size, 8)
    cut = [7, 32]
    head = engine.prefill([p[:c] for p, c in zip(prompts, cut)])
    s = sampling(SAMPLED[:2])
    res = engine.prefill([p[c:] for p, c in zip(prompts, cut)], s, start_states=head.states, start_positions=cut,
                         logprobs=4)
    whole = check(engine, reference, prompts, SAMPLED[:2], 4)
    np.testing.assert_array_equal(res.next_ids, whole.next_ids)
    np.testing.assert_array_equal(res.scores.top_ids, whole.scores.top_ids)
    np.testing.assert_allclose(res.scores.logprobs, whole.scores.logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_bfloat16_prefill_logprobs_within_the_stated_tolerance(engine_bf16, reference):
    prompts = random_prompts([5, 30], TINY.vocab_size, 9)
    check(engine_bf16, reference, prompts, [(0.0, 0, 1.0), (1.0, 0, 1.0)], 5, rel=BF16_REL)


@pytest.mark.parametrize("bad", [21, -1, 2.5, True])
def test_bad_prefill_logprobs_are_refused(engine, bad):
    with pytest.raises(GenerationError, match="logprobs must be None or an integer from 0 to 20"):
        engine.prefill([[1, 2]], logprobs=bad)
