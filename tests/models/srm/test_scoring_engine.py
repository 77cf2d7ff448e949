"""The engines' scoring path (``score``) and prefill/score continued from a state, against
the PyTorch references (same weights).

SRM: the TINY config with the Mojo ops (the scan op and the scored rows' ops: the
default CPU engine) and with the plain chunked graph and ``ops.top_k`` (what a GPU runs); PHA:
the CONFIG of tests/models/pha/test_pha_engine.py with the row op, from a fresh start only.
Context 96 = 3 chunks of 32 for the SRM, so splits fall on, before and after chunk edges.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srm_max.errors import GenerationError
from srm_max.graphs.op_names import OP_SCAN
from srm_max.runtime.call_types import SamplingArrays
from tests.support import mojo_ops as K
from tests.support.graphs import graphs, op_graphs
from tests.support.pha import CONFIG as PHA_CONFIG, random_pha
from tests.support.prompts import padded_batch, random_prompts
from tests.support.tiny import TINY

pytestmark = [graphs(TINY, ("prefill", "decode_steps")),
              graphs(TINY, ("prefill",), kernels=False),
              graphs(TINY, ("prefill",), dtype="bfloat16"),
              graphs(PHA_CONFIG, ("prefill",))]  # the PHA engine's default: the row op on a CPU


LOGPROB_ATOL = 1e-4  # float32 engine against the float32 reference's log_softmax
# Mixed lengths in one batch: 1 token, inside one chunk, one chunk, one past it, the context.
LENGTHS = [1, 5, 32, 33, 70, 96]


def texts(lengths, seed=0, vocab=TINY.vocab_size):
    return random_prompts(lengths, vocab, seed)


def ref_logprobs(reference, inputs) -> list[np.ndarray]:
    """log_softmax of the reference's logits at every position: [T_b, V] per sample."""
    ids, lengths = padded_batch(inputs)
    with torch.no_grad():
        logits = reference.prefill(ids, lengths)[0]
    full = torch.log_softmax(logits.double(), dim=-1).numpy()
    return [full[b, :n] for b, n in enumerate(lengths.tolist())]


def check_against_reference(result, ref, targets, top_n):
    for b, (lp, y) in enumerate(zip(ref, targets)):
        T = len(y)
        assert result.logprobs[b].shape == (T,) and result.logprobs[b].dtype == np.float32
        np.testing.assert_allclose(result.logprobs[b], lp[np.arange(T), y], rtol=0, atol=LOGPROB_ATOL)
        assert result.top_ids[b].shape == (T, top_n) and result.top_ids[b].dtype == np.int64
        assert result.top_logprobs[b].shape == (T, top_n) and result.top_logprobs[b].dtype == np.float32
        expected = np.argsort(-lp, axis=-1, kind="stable")[:, :top_n]
        np.testing.assert_array_equal(result.top_ids[b], expected)
        np.testing.assert_allclose(result.top_logprobs[b], np.take_along_axis(lp, expected, -1), rtol=0,
                                   atol=LOGPROB_ATOL)


# ---------------------------------------------------------------- SRM engines


@pytest.fixture(scope="module")
def plain(tiny_weights):
    from srm_max.models.srm.engine import Engine

    return Engine(TINY, tiny_weights, kernels=False)


@pytest.fixture(params=["kernels", "plain"])
def srm(request, engine, plain):
    """The Mojo-op engine (the scan op) and the plain-graph one (the chunked scan)."""
    return engine if request.param == "kernels" else plain


def test_score_equals_the_reference_log_softmax(srm, reference):
    inputs = texts(LENGTHS, seed=1)
    targets = texts(LENGTHS, seed=2)
    res = srm.score(inputs, targets, top_n=5)
    check_against_reference(res, ref_logprobs(reference, inputs), targets, 5)
    # the states after each text's last input are the prefill's
    states = srm.host(srm.prefill(inputs).states)
    np.testing.assert_allclose(srm.host(res.states), states, rtol=0, atol=1e-5)


def test_score_at_batch_one_and_the_widest_top(srm, reference):
    for n in (1, 33, 96):
        inputs, targets = texts([n], seed=n), texts([n], seed=n + 1)
        res = srm.score(inputs, targets, top_n=20)
        check_against_reference(res, ref_logprobs(reference, inputs), targets, 20)
    assert srm.score(inputs, targets).top_ids[0].shape == (96, 0)


def test_a_text_scores_the_same_in_any_batch(engine):
    inputs, targets = texts([7, 40, 96], seed=3), texts([7, 40, 96], seed=4)
    batched = engine.score(inputs, targets, top_n=3)
    for b in range(3):
        alone = engine.score(inputs[b : b + 1], targets[b : b + 1], top_n=3)
        np.testing.assert_allclose(alone.logprobs[0], batched.logprobs[b], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(alone.top_ids[0], batched.top_ids[b])


# Each sample of one batch is split at its own place: at a chunk edge, one before and one
# past it, after the first token, and with the rest crossing two chunk edges.
WHOLE = [96, 70, 64, 40, 96, 65]
SPLITS = [32, 33, 31, 1, 64, 5]


def test_prefill_from_a_state_equals_prefill_of_the_whole_prompt(srm):
    prompts = texts(WHOLE, seed=5)
    heads = [p[:s] for p, s in zip(prompts, SPLITS)]
    tails = [p[s:] for p, s in zip(prompts, SPLITS)]
    rng = np.random.default_rng(0)
    sampling = SamplingArrays(np.full(len(prompts), 0.9, np.float32), np.zeros(len(prompts), np.int64),
                              np.ones(len(prompts), np.float32), rng.integers(0, 2**63, len(prompts), dtype=np.uint64))
    for s in (None, sampling):
        whole = srm.prefill(prompts, s)
        head = srm.prefill(heads)
        rest = srm.prefill(tails, s, start_states=head.states, start_positions=SPLITS)
        np.testing.assert_allclose(srm.host(rest.logits), srm.host(whole.logits), rtol=0, atol=1e-4)
        np.testing.assert_allclose(srm.host(rest.states), srm.host(whole.states), rtol=0, atol=1e-5)
        np.testing.assert_array_equal(rest.next_ids, whole.next_ids)  # the sampler's counter: start + len


def test_a_state_continues_through_decode_as_the_whole_prompt(engine):
    """prefill(head) + prefill(tail from its state) + decode == prefill(whole) + decode."""
    prompts = texts([50, 33], seed=6)
    splits = [32, 32]
    head = engine.prefill([p[:s] for p, s in zip(prompts, splits)])
    rest = engine.prefill([p[s:] for p, s in zip(prompts, splits)], start_states=head.states,
                          start_positions=splits)
    whole = engine.prefill(prompts)
    greedy, lengths = SamplingArrays.greedy(2), [len(p) for p in prompts]
    a = engine.decode(rest.next_ids, lengths, rest.states, greedy, 12)
    b = engine.decode(whole.next_ids, lengths, whole.states, greedy, 12)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_score_from_a_state_equals_score_of_the_whole(srm):
    inputs, targets = texts(WHOLE, seed=7), texts(WHOLE, seed=8)
    whole = srm.score(inputs, targets, top_n=4)
    head = srm.score([x[:s] for x, s in zip(inputs, SPLITS)], [y[:s] for y, s in zip(targets, SPLITS)], top_n=4)
    rest = srm.score([x[s:] for x, s in zip(inputs, SPLITS)], [y[s:] for y, s in zip(targets, SPLITS)], top_n=4,
                     start_states=head.states, start_positions=SPLITS)
    for b in range(len(inputs)):
        np.testing.assert_allclose(np.concatenate([head.logprobs[b], rest.logprobs[b]]), whole.logprobs[b],
                                   rtol=0, atol=LOGPROB_ATOL)
        np.testing.assert_array_equal(np.concatenate([head.top_ids[b], rest.top_ids[b]]), whole.top_ids[b])
    np.testing.assert_allclose(srm.host(rest.states), srm.host(whole.states), rtol=0, atol=1e-5)
    # a fresh start given explicitly (zero states at position 0) is the default
    zeros = srm.empty_states(len(inputs))
    again = srm.score(inputs, targets, start_states=zeros, start_positions=np.zeros(len(inputs), np.int64))
    for b in range(len(inputs)):
        np.testing.assert_array_equal(again.logprobs[b], whole.logprobs[b])


def test_scoring_a_greedy_generation_gives_its_tokens_as_top_one(engine):
    prompts = texts([1, 20, 45], seed=9)
    steps = 40  # the longest prompt reaches 45 + 1 + 40 - 1 < 96 inputs
    pre = engine.prefill(prompts)
    dec = engine.decode(pre.next_ids, [len(p) for p in prompts], pre.states, SamplingArrays.greedy(3), steps - 1)
    generated = np.concatenate([pre.next_ids[:, None], dec.tokens], axis=1)  # [B, steps]
    texts_ = [p + g.tolist() for p, g in zip(prompts, generated)]
    res = engine.score([t[:-1] for t in texts_], [t[1:] for t in texts_], top_n=1)
    for b, p in enumerate(prompts):
        at = slice(len(p) - 1, None)  # the positions whose targets were generated
        np.testing.assert_array_equal(res.top_ids[b][at, 0], generated[b])
        np.testing.assert_array_equal(res.logprobs[b][at], res.top_logprobs[b][at, 0])


# max |bf16 - f32| log-probability error relative to max |f32 log-probability|: the bound
# test_engine.py puts on bfloat16 logits (measured 0.007 here, on log-probabilities down to -26)
BF16_LOGPROB_BOUND = 0.02


def test_bfloat16_scores_close_to_float32(engine, engine_bf16):
    inputs, targets = texts([3, 40, 96], seed=10), texts([3, 40, 96], seed=11)
    a = engine.score(inputs, targets, top_n=1)
    b = engine_bf16.score(inputs, targets, top_n=1)
    err = max(np.abs(x - y).max() for x, y in zip(a.logprobs, b.logprobs))
    scale = max(np.abs(x).max() for x in a.logprobs)
    assert err < BF16_LOGPROB_BOUND * scale, f"bf16 log-probabilities off by {err:.3g} (scale {scale:.3g})"
    for x, y in zip(a.top_ids, b.top_ids):
        np.testing.assert_array_equal(x, y)


def test_score_and_start_states_refuse_bad_input(engine):
    x = [[1, 2, 3]]
    for bad in (dict(inputs=x, targets=[[1, 2]]), dict(inputs=[[]], targets=[[]]), dict(inputs=x, targets=x, top_n=21),
                dict(inputs=[[1, 2, TINY.vocab_size]], targets=x), dict(inputs=x, targets=[[-1, 0, 0]]),
                dict(inputs=[[0] * 97], targets=[[0] * 97]), dict(inputs=x, targets=x, start_positions=[3]),
                dict(inputs=x, targets=x, start_states=engine.empty_states(1), start_positions=[94]),
                dict(inputs=x, targets=x, start_states=engine.empty_states(2), start_positions=[0])):
        with pytest.raises(GenerationError):
            engine.score(**bad)
    with pytest.raises(GenerationError):
        engine.prefill(x, start_positions=[-1])


# ---------------------------------------------------------------- the scan op from a state


@op_graphs(OP_SCAN)
def test_the_scan_op_continues_from_a_state():
    rng = np.random.default_rng(12)
    B, T, H, hd, n = 3, 40, 4, 7, 48
    u = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    w = rng.standard_normal((H, n)).astype(np.float32)
    beta = rng.standard_normal((H, n)).astype(np.float32)
    lam = rng.uniform(0.9, 1.0, H).astype(np.float32)
    y_full, fin_full = K.mixer_scan(u, [T] * B, w, beta, lam)
    split = [0, 17, 39]
    _, fin_head = K.mixer_scan(u, split, w, beta, lam)
    tail = np.zeros_like(u)
    for b, s in enumerate(split):
        tail[b, : T - s] = u[b, s:]
    y, fin = K.mixer_scan(tail, [T - s for s in split], w, beta, lam, start=split, init=fin_head)
    for b, s in enumerate(split):
        np.testing.assert_allclose(y[b, : T - s], y_full[b, s:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fin, fin_full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- PHA


@pytest.fixture(scope="module")
def pha_reference():
    return random_pha()


@pytest.fixture(scope="module")
def pha(pha_reference):
    from srm_max.models.pha.engine import PHAEngine

    weights = {k: v.detach().numpy().astype(np.float32) for k, v in pha_reference.state_dict().items()}
    return PHAEngine(PHA_CONFIG, weights, dtype="float32", device="cpu")


def test_pha_score_equals_the_reference_log_softmax(pha, pha_reference):
    # inside chunk 0, its last token, one past it, in chunk 1, the full context (chunks of 64)
    lengths = [1, 64, 65, 100, 160]
    inputs = texts(lengths, seed=13, vocab=PHA_CONFIG.vocab_size)
    targets = texts(lengths, seed=14, vocab=PHA_CONFIG.vocab_size)
    res = pha.score(inputs, targets, top_n=20)
    check_against_reference(res, ref_logprobs(pha_reference, inputs), targets, 20)
    np.testing.assert_allclose(pha.host(res.states), pha.host(pha.prefill(inputs).states), rtol=0, atol=1e-5)


def test_pha_refuses_to_start_from_a_state(pha):
    x = [[1, 2, 3]]
    states = pha.prefill(x).states
    with pytest.raises(GenerationError, match="cannot continue from a state"):
        pha.prefill(x, start_states=states, start_positions=[3])
    with pytest.raises(GenerationError, match="cannot continue from a state"):
        pha.score(x, x, start_states=states, start_positions=[3])
