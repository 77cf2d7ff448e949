"""The PHA's whole-step decode op with bfloat16 weights (mojo/pha_decode_step.mojo, the
``PHAEngine`` default on a CPU in either weight dtype) against the PyTorch reference made to
round where a bfloat16 engine rounds (``bf16_products``: each product's input and output
rounded to bfloat16, as ``graphs.ops.linear`` does) and against the float32 reference.

tests/support/pha.py CONFIG and its weights. Every test starts from the float32
reference's prefill (its cache as the engine's states), so no prefill graph is needed:
the file compiles the op's bfloat16 graph alone. Context 160: the op's online softmax runs
over blocks of 32 cached rows and a batch of one cuts the context into slices of at least 64
rows, so the prompts and steps end inside, on and across those edges. The ablations (the GSS
branch alone, attention alone) are not rerun in bfloat16: each would be one more op graph to
compile, and they only leave out products whose rounding the full block checks here. The
draws of sampled tokens are the float32 op's sampler on the bfloat16 logits
(tests/models/pha/test_pha_decode_op.py checks them against the plain graph's).

Bounds (measured on the 2-core EPYC, Zen 4, AVX-512, over these prompts):
- against the rounding reference: the same greedy tokens, GSS states within ``ROUNDED_REL``
  of their largest value (measured up to 2.1e-6), and the KV caches within one bfloat16 step
  of each value (``assert_within_bfloat16_step``; measured equal but for float32 sums): the
  reference rounds where the op rounds, so what is left is the order of the float32 sums
  inside each product, which can move a product's output across a bfloat16 rounding edge
  now and then (the bound leaves room for that on CPUs whose tiles sum in another order).
  The reference with its matrices rounded but not its products' inputs and outputs
  (``bf16_rounded`` alone) is 6.6e-4 to 7.8e-3 off in the GSS states and 17 to 160 bfloat16
  steps off in the caches, so these bounds see a rounding the op skips or adds;
- against the float32 reference, teacher-forced along the op's tokens: each new token's
  log-probability within ``REF_LOGPROB`` (measured 2.8e-2) and states within ``REF_REL``
  of their largest value (measured 1.6e-2): the rounding of the weights and of every
  product's input and output to bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest

import copy

import numpy as np
import pytest
import torch

from srm_max.runtime.call_types import SamplingArrays
from tests.support.checks import assert_close_rel, assert_within_bfloat16_step
from tests.support.graphs import graphs
from tests.support.pha import (CONFIG, assert_states_close, bf16_products, bf16_rounded, cpu_engine, prompts_of,
                               reference_start)
from tests.support.prompts import reference_prefill
from tests.support.reference_scores import ref_log_softmax

# the op's engine runs its bfloat16 decode_steps graph only
pytestmark = graphs(CONFIG, ("decode_steps",), "bfloat16", kernels=True)

ROUNDED_REL = 1e-4
REF_LOGPROB = 6e-2
REF_REL = 4e-2


@pytest.fixture(scope="module")
def op(weights):
    return cpu_engine(weights, "bfloat16")


@pytest.fixture(scope="module")
def rounding_reference(reference):
    return bf16_products(bf16_rounded(copy.deepcopy(reference)))


def decode_calls(engine, ids, states, lengths, calls, logprobs=None):
    """The engine's greedy decode calls from ``states`` at positions ``lengths``: (tokens [B, sum
    calls], states, positions after, log-probabilities [B, sum calls] or None)."""
    sampling = SamplingArrays.greedy(len(lengths))
    pos, tokens, lps = np.array(lengths), [], []
    for steps in calls:
        res = engine.decode(ids, pos, states, sampling, steps, logprobs=logprobs)
        assert res.tokens.shape == (len(lengths), steps)
        np.testing.assert_array_equal(engine.host(res.ids), res.tokens[:, -1])
        tokens.append(res.tokens)
        lps.append(res.logprobs)
        ids, pos, states = res.ids, engine.host(res.positions), res.states
    return np.concatenate(tokens, 1), states, pos, None if logprobs is None else np.concatenate(lps, 1)


def reference_greedy(model, start, prompts, steps):
    """``model``'s greedy steps from ``start``'s prefill of ``prompts``: (tokens [B, steps], cache)."""
    logits, cache = reference_prefill(start, prompts)
    token, pos, tokens = torch.tensor(logits.argmax(-1)), torch.tensor([len(p) for p in prompts]), []
    with torch.no_grad():
        for _ in range(steps):
            logits, cache = model.step(token, pos, cache)
            token, pos = logits.argmax(-1), pos + 1
            tokens.append(token)
    return torch.stack(tokens, 1).numpy(), cache


def assert_op_rounds_as_the_reference(op, reference, rounding_reference, prompts, calls):
    """The op and the rounding reference decode the same greedy steps from the float32
    reference's prefill: the same tokens, GSS states within ``ROUNDED_REL``, the KV caches
    (up to each sample's rows) within one bfloat16 step of each value."""
    lengths = [len(p) for p in prompts]
    ids, states = reference_start(reference, prompts, op)
    tokens, states, pos, _ = decode_calls(op, ids, states, lengths, calls)
    want, cache = reference_greedy(rounding_reference, reference, prompts, sum(calls))
    np.testing.assert_array_equal(tokens, want)
    got = op.split_states(states)
    assert_close_rel(got["gss_state"], cache.gss_state.numpy(), ROUNDED_REL)
    for name in ("keys", "values"):
        for s, f in enumerate(pos):
            assert_within_bfloat16_step(got[name][:, s, :, :f], getattr(cache, name)[:, s, :, :f].numpy(), ROUNDED_REL)


def test_the_bfloat16_step_bound_takes_one_step_and_refuses_two():
    """A value of 0.2 rounded to bfloat16 one step up (2**-10 there) passes; two do not,
    nor does a small value off by a step of the largest."""
    expected = np.array([0.2, -2.5, 0.01], np.float32)
    assert_within_bfloat16_step(expected + [2.0**-10, 0, 0], expected)
    with pytest.raises(AssertionError, match="one bfloat16 step"):
        assert_within_bfloat16_step(expected + [2.0**-9, 0, 0], expected)
    with pytest.raises(AssertionError, match=r"at \(2,\)"):
        assert_within_bfloat16_step(expected + [0, 0, 2.0**-7 * 2.5], expected)


def test_the_bfloat16_engine_decodes_in_the_op_on_bfloat16_matrices(op, weights):
    """The op reads the packed matrices in bfloat16, half the bytes of the float32
    engine's packing; the plain engine has no packed copies (no graph is compiled here)."""
    from max.dtype import DType

    from srm_max.models.pha import packing
    from srm_max.models.pha.engine import PHAEngine

    assert op.kernels and op.dtype == "bfloat16"
    mats = op.weights[packing.MATS]
    assert mats.dtype == DType.bfloat16 and mats.element_size == 2
    f32 = np.asarray(PHAEngine(CONFIG, weights, dtype="float32").weights[packing.MATS])
    assert f32.dtype == np.float32 and mats.num_elements == f32.size
    assert packing.MATS not in cpu_engine(weights, "bfloat16", plain=True).weights


def test_greedy_batch_rounds_as_the_reference(op, reference, rounding_reference):
    # prompts ending inside the first block of 32 rows, one short of the second edge,
    # past 4 blocks, and near the context; 12 steps cross the edges at 64 and 160 = n
    assert_op_rounds_as_the_reference(op, reference, rounding_reference, prompts_of([1, 63, 148, 13], seed=1),
                                      [4, 1, 7])


@pytest.mark.parametrize("length", [1, 31, 64, 97])
def test_greedy_batch_of_one_across_blocks_and_slices_rounds_as_the_reference(op, reference, rounding_reference,
                                                                               length):
    """Alone, a sample's context is cut into slices (two at this context): each length
    puts the slices' and blocks' edges elsewhere, and the steps move them on."""
    assert_op_rounds_as_the_reference(op, reference, rounding_reference, prompts_of([length], seed=2 + length),
                                      [17, 23])


def test_the_rounding_reference_tells_a_rounding_apart(op, reference):
    """The bounds above see rounding: the reference with its matrices rounded to bfloat16
    but not its products' inputs and outputs is far outside them."""
    prompts = prompts_of([1, 63, 148, 13], seed=1)
    with pytest.raises(AssertionError):
        assert_op_rounds_as_the_reference(op, reference, bf16_rounded(copy.deepcopy(reference)), prompts, [4, 1, 7])


@pytest.mark.parametrize("lengths, calls", [([1, 63, 120, 13], [5, 1, 8]), ([97], [17, 23])],
                         ids=["batch", "alone"])
def test_greedy_decode_is_close_to_the_float32_reference(op, reference, lengths, calls):
    """Along the op's own tokens, the float32 reference's log-probabilities of each new
    token and its states after the last one (its prefill of the whole text)."""
    prompts = prompts_of(lengths, seed=7)
    ids, states = reference_start(reference, prompts, op)
    tokens, states, pos, logprobs = decode_calls(op, ids, states, lengths, calls, logprobs=0)
    for b, p in enumerate(prompts):
        text = list(p) + [int(ids[b])] + tokens[b].tolist()
        want = ref_log_softmax(reference, text[:-1])[len(p):]
        new = np.array(text[len(p) + 1:], np.int64)
        np.testing.assert_allclose(logprobs[b], want[np.arange(len(new)), new], rtol=0, atol=REF_LOGPROB)
        _, cache = reference_prefill(reference, [text[:-1]])
        assert_states_close(op, op.host(states)[:, b:b + 1], cache, [pos[b]], REF_REL)


def test_the_suite_compiles_every_graph_these_tests_load(request, op):
    """The op's engine loads its bfloat16 decode_steps graph alone here."""
    from tests.support.graphs import declared_graph_jobs

    assert set(declared_graph_jobs([request.node])) == {op.graph_job("decode_steps")}
