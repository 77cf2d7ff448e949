"""The PHA decode's log-probabilities (``PHAEngine.decode(..., logprobs=n)``) through the
whole-step decode op (mojo/pha_decode_step.mojo with mojo/row_logprobs.mojo) and the
one-step decode graph of plain ops (``kernels=False``): each new token's raw
log-probability and the top-n equal the PyTorch reference's log_softmax, the two paths
equal each other on the same draws; asking changes no token; ``generate(...,
logprobs=n)`` takes them from the op's decode (no score pass; the plain engine's
generator would need graphs the suite does not compile, and tests/serve/
test_decode_logprobs_api.py runs the SRM's plain one). tests/support/pha.py CONFIG (V = 64,
context 160), float32."""

from __future__ import annotations

import numpy as np
import pytest

from srm_max import Generator
from srm_max.runtime.call_types import SamplingArrays
from tests.support.graphs import graphs
from tests.support.pha import CONFIG, cpu_engine, prompts_of
from tests.support.reference_scores import ref_log_softmax

pytestmark = graphs(CONFIG, ("prefill", "decode_steps", "sample", "regroup"))
# the plain engine's graphs, as tests/models/pha/test_pha_decode_op.py declares them (no new graph)
plain_graphs = graphs(CONFIG, ("prefill", "decode"), kernels=False)

TOL = 1e-4
# (temperature, top_k, top_p) per sample: greedy, plain, top-k, top-p
ROWS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 1.0), (1.2, 0, 0.8)]


@pytest.fixture(scope="module")
def engine(weights):
    return cpu_engine(weights)


@pytest.fixture(scope="module")
def plain(weights):
    return cpu_engine(weights, plain=True)


def sampling(rows) -> SamplingArrays:
    t, k, p = (np.array(c) for c in zip(*rows))
    return SamplingArrays(t.astype(np.float32), k.astype(np.int64), p.astype(np.float32),
                          np.arange(7, 7 + len(rows), dtype=np.uint64))


@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("rows", [ROWS[:1] * 3, ROWS], ids=["greedy", "sampled"])
def test_pha_decode_logprobs_equal_the_reference(engine, reference, steps, rows):
    check_against_reference(engine, reference, steps, rows)


@plain_graphs
@pytest.mark.parametrize("steps", [1, 5])
def test_pha_plain_decode_graph_logprobs_equal_the_reference(plain, reference, steps):
    check_against_reference(plain, reference, steps, ROWS)


@plain_graphs
def test_pha_plain_decode_graph_logprobs_equal_the_ops_on_the_same_draws(engine, plain):
    """From the plain engine's prefill, the one-step graph and the op draw the same tokens
    and give them the same log-probabilities and alternatives (0, 3 and all 20)."""
    prompts = prompts_of([3, 31, 64, CONFIG.context_length - 3], seed=6)
    s = sampling(ROWS)
    pre = plain.prefill(prompts, s)
    lengths = [len(p) for p in prompts]
    for n in (0, 3, 20):
        got = plain.decode(pre.next_ids, lengths, pre.states, s, 5, logprobs=n)
        op = engine.decode(pre.next_ids, lengths, pre.states, s, 5, logprobs=n)
        np.testing.assert_array_equal(got.tokens, op.tokens)
        assert got.top_ids.shape == op.top_ids.shape == (len(prompts), 5, n)
        np.testing.assert_allclose(got.logprobs, op.logprobs, rtol=0, atol=TOL)
        np.testing.assert_array_equal(got.top_ids, op.top_ids)
        np.testing.assert_allclose(got.top_logprobs, op.top_logprobs, rtol=0, atol=TOL)


def check_against_reference(engine, reference, steps, rows):
    prompts = prompts_of([3, 31, 64, CONFIG.context_length - 3][:len(rows)], seed=4)
    s = sampling(rows)
    pre = engine.prefill(prompts, s)
    lengths = [len(p) for p in prompts]
    plain = engine.decode(pre.next_ids, lengths, pre.states, s, steps)
    res = engine.decode(pre.next_ids, lengths, pre.states, s, steps, logprobs=3)
    np.testing.assert_array_equal(res.tokens, plain.tokens)
    assert plain.logprobs is None and res.top_ids.shape == (len(prompts), steps, 3)
    n = CONFIG.context_length
    for b, p in enumerate(prompts):
        kept = min(steps, n - len(p) - 1)  # tokens past the context are dropped by the host
        text = list(p) + [int(pre.next_ids[b])] + res.tokens[b, :kept].tolist()
        lp = ref_log_softmax(reference, text[:-1])[len(p):]
        new = np.array(text[len(p) + 1:], np.int64)
        np.testing.assert_allclose(res.logprobs[b, :kept], lp[np.arange(kept), new], rtol=0, atol=TOL)
        top = np.argsort(-lp, axis=-1, kind="stable")[:, :3]
        np.testing.assert_array_equal(res.top_ids[b, :kept], top)
        np.testing.assert_allclose(res.top_logprobs[b, :kept], np.take_along_axis(lp, top, -1), rtol=0, atol=TOL)


def test_pha_generate_takes_the_decodes_logprobs(engine, reference, monkeypatch):
    gen = Generator.from_engine(engine)

    def refuse(*args, **kwargs):
        raise AssertionError("the sampled tokens were scored again")

    monkeypatch.setattr(engine, "score", refuse)
    prompts = prompts_of([5, 40], seed=5)
    outs = gen.generate(prompts, max_new_tokens=8, temperature=0.9, seed=2, steps_per_call=3, logprobs=2)
    for p, c in zip(prompts, outs):
        want = ref_log_softmax(reference, (p + c.ids)[:-1])[len(p) - 1:]
        np.testing.assert_allclose(c.logprobs.logprobs, want[np.arange(len(c.ids)), c.ids], rtol=0, atol=TOL)


@plain_graphs
def test_the_plain_and_the_op_engines_load_their_graphs_without_compiling_again(weights, caplog):
    """A clean run compiles the op engine's prefill with the plain engine's prefill and
    decode as one unit (``precompile`` joins graphs with the Mojo ops that bind no op
    weights to their model's plain unit, tests/runtime/test_precompile.py): each engine
    initializes that file with its own weights and compiles nothing again."""
    import logging
    import os

    engines = {"op": cpu_engine(weights), "plain": cpu_engine(weights, plain=True)}
    loads = [("op", "prefill"), ("plain", "prefill"), ("plain", "decode")]
    def written():
        return [os.stat(engines[name].graph_job(kind).mef_path()).st_mtime_ns for name, kind in loads]

    before = written()
    with caplog.at_level(logging.INFO, logger="srm_max"):
        for name, kind in loads:
            engines[name].model(kind)
    assert "compil" not in caplog.text
    assert written() == before
