"""The decode's log-probabilities (``engine.decode(..., logprobs=n)``): each new token's
raw log-probability and the top-n at each step equal the PyTorch reference's log_softmax
and what scoring gives for the same tokens; asking for them changes no token.
Through the whole-step decode op (mojo/decode_step.mojo with mojo/row_logprobs.mojo: the
default CPU engine) and the plain decode graph's loop (graphs/loop.py, ``kernels=False``:
the GPU's path), which also equals the op on the same draws. TINY SRM (V = 64, context 96)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srm_max.errors import GenerationError
from srm_max.runtime.call_types import SamplingArrays
from tests.support.graphs import graphs
from tests.support.prompts import padded_batch, random_prompts
from tests.support.tiny import TINY

pytestmark = [graphs(TINY, ("prefill", "decode_steps")),
              graphs(TINY, ("prefill", "decode_steps"), dtype="bfloat16")]

# the plain-op engine's graphs, as tests/models/srm/test_engine.py declares them (no new graph)
PLAIN_OPS = graphs(TINY, ("prefill", "decode", "sample", "regroup"), kernels=False)

LOGPROB_ATOL = 1e-4  # float32 engine against the float32 reference's log_softmax
# bfloat16 weights: within 2 % of the largest |log-probability| in the step's row of the float32
# reference (scoring's bound, tests/models/srm/test_scoring_engine.py)
BF16_REL = 0.02
TOP = 5
# (temperature, top_k, top_p) per sample: greedy, plain, top-k, top-p, both
SAMPLED = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.9)]


def sampling(rows, seed=0) -> SamplingArrays:
    t, k, p = (np.array(c) for c in zip(*rows))
    return SamplingArrays(t.astype(np.float32), k.astype(np.int64), p.astype(np.float32),
                          np.arange(seed, seed + len(rows), dtype=np.uint64))


def run(engine, prompts, rows, steps, logprobs):
    """Prefill, then one decode call of ``steps``: -> (first tokens [B], DecodeResult)."""
    s = sampling(rows)
    pre = engine.prefill(prompts, s)
    lengths = [len(p) for p in prompts]
    return pre.next_ids, engine.decode(pre.next_ids, lengths, pre.states, s, steps, logprobs=logprobs)


def reference_logprobs(reference, texts) -> list[np.ndarray]:
    """log_softmax of the reference's logits after each token of each text: [T_b, V]."""
    ids, lengths = padded_batch(texts)
    with torch.no_grad():
        logits = reference.prefill(ids, lengths)[0]
    full = torch.log_softmax(logits.double(), dim=-1).numpy()
    return [full[b, :n] for b, n in enumerate(lengths.tolist())]


def check(engine, reference, prompts, rows, steps, top_n=TOP, atol=LOGPROB_ATOL, rel=None):
    first, res = run(engine, prompts, rows, steps, top_n)
    plain_first, plain = run(engine, prompts, rows, steps, None)
    np.testing.assert_array_equal(res.tokens, plain.tokens)  # asking changes no token
    assert plain.logprobs is None and plain.top_ids is None
    B = len(prompts)
    assert res.logprobs.shape == (B, steps) and res.logprobs.dtype == np.float32
    assert res.top_ids.shape == (B, steps, top_n) and res.top_logprobs.shape == (B, steps, top_n)
    n = TINY.context_length
    # step s reads the token at position len + s and chooses the next; past the context the
    # host drops them, so only steps whose token stays inside are checked
    kept = [min(steps, n - len(p) - 1) for p in prompts]
    texts = [list(p) + [int(f)] + res.tokens[b, :kept[b]].tolist() for b, (p, f) in enumerate(zip(prompts, first))]
    ref = reference_logprobs(reference, [t[:-1] for t in texts])
    for b, (p, t) in enumerate(zip(prompts, texts)):
        at = np.arange(len(p), len(p) + kept[b])  # the rows that predict the decoded tokens
        want = ref[b][at, np.array(t[len(p) + 1:], np.int64)]
        tol = atol if rel is None else rel * np.abs(ref[b][at]).max()  # the rows' largest |log-probability|
        np.testing.assert_allclose(res.logprobs[b, :kept[b]], want, rtol=0, atol=tol)
        top = np.argsort(-ref[b][at], axis=-1, kind="stable")[:, :top_n]
        np.testing.assert_allclose(res.top_logprobs[b, :kept[b]], np.take_along_axis(ref[b][at], top, -1),
                                   rtol=0, atol=tol)
        if rel is None:
            np.testing.assert_array_equal(res.top_ids[b, :kept[b]], top)
        assert (np.diff(res.top_logprobs[b, :kept[b]], axis=-1) <= 0).all()
    return texts, res, kept


@pytest.mark.parametrize("steps", [1, 7])
def test_greedy_decode_logprobs_equal_the_reference_and_the_score_graph(engine, reference, steps):
    """Greedy (the op's argmax phase), batch 3 and 1, one step and several: each token is its
    own top-1, its log-probability the reference's and scoring's on the same text."""
    prompts = random_prompts([3, 20, 40], TINY.vocab_size, 1)
    texts, res, kept = check(engine, reference, prompts, [(0.0, 0, 1.0)] * 3, steps)
    for b, t in enumerate(texts):
        np.testing.assert_array_equal(res.top_ids[b, :kept[b], 0], t[len(prompts[b]) + 1:])
    scored = engine.score([t[:-1] for t in texts], [t[1:] for t in texts], top_n=TOP)
    for b, p in enumerate(prompts):
        tail = slice(len(p), len(p) + kept[b])
        np.testing.assert_allclose(res.logprobs[b, :kept[b]], scored.logprobs[b][tail], rtol=0, atol=LOGPROB_ATOL)
        np.testing.assert_array_equal(res.top_ids[b, :kept[b]], scored.top_ids[b][tail])
    check(engine, reference, prompts[1:2], [(0.0, 0, 1.0)], steps)


@pytest.mark.parametrize("steps", [1, 6])
def test_sampled_decode_logprobs_are_the_raw_distributions(engine, reference, steps):
    """A mixed batch (greedy, temperature, top-k, top-p): the drawn tokens' log-probabilities
    are the raw logits' log_softmax whatever drew them; every alternative asked for."""
    prompts = random_prompts([1, 9, 33, 50, 64], TINY.vocab_size, 2)
    check(engine, reference, prompts, SAMPLED, steps)
    check(engine, reference, prompts, SAMPLED, steps, top_n=0)
    check(engine, reference, prompts[:2], SAMPLED[1:3], steps, top_n=20)


def test_decode_logprobs_near_the_end_of_the_context(engine, reference):
    """Prompts that leave 1 to 3 tokens of context: the steps inside it are exact (the op
    clamps later positions; the host drops those tokens)."""
    n = TINY.context_length
    prompts = random_prompts([n - 2, n - 3, n - 4], TINY.vocab_size, 3)
    check(engine, reference, prompts, SAMPLED[:3], 4)


def test_bfloat16_decode_logprobs_within_the_stated_tolerance(engine_bf16, reference):
    prompts = random_prompts([5, 30], TINY.vocab_size, 4)
    check(engine_bf16, reference, prompts, [(0.0, 0, 1.0), (1.0, 0, 1.0)], 5, rel=BF16_REL)


def test_bad_logprobs_are_refused(engine):
    with pytest.raises(GenerationError, match="logprobs=21"):
        run(engine, [[1, 2]], [(0.0, 0, 1.0)], 1, 21)


@pytest.fixture(scope="module")
def plain(tiny_weights):
    """The engine of plain MAX ops (``kernels=False``): its decode is the graph's loop."""
    from srm_max.models.srm.engine import Engine

    engine = Engine(TINY, tiny_weights, kernels=False)
    assert not engine.steps_in_one_op
    return engine


@PLAIN_OPS
@pytest.mark.parametrize("steps", [1, 6])
def test_plain_decode_graph_logprobs_are_the_raw_distributions(plain, reference, steps):
    """The decode graph's loop: the same checks as the op's above (a mixed batch, 0 to 20
    alternatives, the end of the context)."""
    prompts = random_prompts([1, 9, 33, 50, 64], TINY.vocab_size, 2)
    check(plain, reference, prompts, SAMPLED, steps)
    check(plain, reference, prompts, SAMPLED, steps, top_n=0)
    check(plain, reference, prompts[:2], SAMPLED[1:3], steps, top_n=20)
    n = TINY.context_length
    check(plain, reference, random_prompts([n - 2, n - 3, n - 4], TINY.vocab_size, 3), SAMPLED[:3], 4)


@PLAIN_OPS
def test_plain_decode_graph_logprobs_equal_the_ops_on_the_same_draws(engine, plain):
    """From the same states, the loop of plain ops and the whole-step op draw the same
    tokens and give them the same log-probabilities and alternatives."""
    prompts = random_prompts([1, 9, 33, 50, 64], TINY.vocab_size, 5)
    s = sampling(SAMPLED)
    pre = plain.prefill(prompts, s)
    lengths = [len(p) for p in prompts]
    looped = plain.decode(pre.next_ids, lengths, pre.states, s, 6, logprobs=TOP)
    op = engine.decode(pre.next_ids, lengths, pre.states, s, 6, logprobs=TOP)
    np.testing.assert_array_equal(looped.tokens, op.tokens)
    np.testing.assert_allclose(looped.logprobs, op.logprobs, rtol=0, atol=LOGPROB_ATOL)
    np.testing.assert_array_equal(looped.top_ids, op.top_ids)
    np.testing.assert_allclose(looped.top_logprobs, op.top_logprobs, rtol=0, atol=LOGPROB_ATOL)
