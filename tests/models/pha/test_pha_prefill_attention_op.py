"""The PHA prefill's tiled attention op (mojo/pha_prefill_attention.mojo, the prefill's
attention, scoring included, on a CPU with the Mojo ops) against float64 numpy, the plain-op
prefill graph (``kernels=False``) and the PyTorch reference.

The op alone runs in a graph of its own with every dimension symbolic (one compile), on
shapes whose lengths end inside, on and across its query and key tiles (32 queries with
AVX2, 64 with AVX-512), one token, padding past each prompt and an empty prompt, and on
query rows at given positions (a prefill's last block asks for the last token's and the
scored ones alone). The
engine tests reuse tests/models/pha/test_pha_engine.py's CONFIG: its default engine's
prefill graph (declared there) and the plain engine's (declared in
test_pha_decode_op.py); attention alone, the ablation whose prefill passes through the op
with no GSS branch, compiles one prefill graph of its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_LINEAR, OP_PHA_PREFILL_ATTENTION, OP_PHA_QK_ROPE
from tests.support.checks import assert_close_rel, assert_prefill_matches_reference
from tests.support.graphs import graphs, op_graphs
from tests.support.op_graphs import model as op_graph_model
from tests.support.pha import (ATTENTION_ALONE, CONFIG, assert_prefill_equals_plain_and_reference, assert_states_close,
                               prompts_of, random_pha)

# the op's own tests run a graph of the op alone; the tests that prefill through it, the
# engines' prefill graphs
op_alone = op_graphs(OP_PHA_PREFILL_ATTENTION)
op_prefill = graphs(CONFIG, ("prefill",), kernels=True)
plain_prefill = graphs(CONFIG, ("prefill",), kernels=False)
# lengths ending inside, on and after a tile of 32 and of 64 queries, and at the context
LENGTHS = [1, 31, 32, 33, 63, 64, 65, 100, 160]


@pytest.fixture
def op_graph():
    """The op alone: (q [B, R, Hq, dh], k, v [B, T, Hkv, dh], lengths [B], at [B, R]) -> attended."""
    return op_graph_model(OP_PHA_PREFILL_ATTENTION)


def run_op(model, q, k, v, lengths, at=None) -> np.ndarray:
    """The op's attention for the queries q at the positions ``at`` (default: every position)."""
    from max.driver import Buffer

    B, R = q.shape[:2]
    at = np.tile(np.arange(R), (B, 1)) if at is None else at
    arrays = (q, k, v, np.asarray(lengths, np.int64), np.asarray(at, np.int64))
    (att,) = model.execute(*(Buffer.from_numpy(np.ascontiguousarray(a)) for a in arrays))
    return att.to_numpy()


def causal_gqa(q, k, v, lengths) -> np.ndarray:
    """float64: softmax over keys j <= t of q . k, times v; rows past a prompt's length zero."""
    B, T, Hq, _ = q.shape
    G = Hq // k.shape[2]
    out = np.zeros(q.shape)
    causal = np.tril(np.ones((T, T), bool))
    for b in range(B):
        for h in range(Hq):
            s = np.where(causal, q[b, :, h].astype(np.float64) @ k[b, :, h // G].T.astype(np.float64), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // G]
        out[b, lengths[b]:] = 0
    return out


def random_qkv(B, T, Hq, Hkv, dh, scale, seed):
    """Unit-length q (times ``scale``, the logit scale the graph folds into q) and k, as
    the PHA's scaled-cosine attention gives the op; v normal."""
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.normal(size=shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = (scale * unit((B, T, Hq, dh))).astype(np.float32)
    return q, unit((B, T, Hkv, dh)).astype(np.float32), rng.normal(size=(B, T, Hkv, dh)).astype(np.float32)


@op_alone
@pytest.mark.parametrize("B, T, Hq, Hkv, dh, lengths, scale", [
    (1, 1, 4, 2, 16, [1], 10.0),  # one token
    (2, 33, 4, 2, 16, [33, 5], 10.0),
    (3, 100, 4, 1, 16, [100, 64, 31], 30.0),  # every query head on one KV head
    (1, 130, 2, 2, 64, [130], 100.0),  # the largest logit scale
    (2, 129, 4, 2, 7, [0, 129], 3.0),  # an empty prompt; dh not a multiple of the SIMD width
    (2, 160, 4, 2, 16, [160, 97], 10.0),
])
def test_the_op_equals_float64_causal_attention(op_graph, B, T, Hq, Hkv, dh, lengths, scale):
    q, k, v = random_qkv(B, T, Hq, Hkv, dh, scale, seed=T)
    got = run_op(op_graph, q, k, v, lengths)
    expected = causal_gqa(q, k, v, lengths)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(v).max())
    for b, n in enumerate(lengths):
        assert not got[b, n:].any()  # the padding's rows are zeros, not left unwritten


@op_alone
@pytest.mark.parametrize("T, R, lengths, dh", [
    (100, 40, [100, 70], 16),  # 40 rows: a block of 32 queries and one of 8
    (65, 2, [65, 65], 7),  # a prefill's last block: the last token's query and one scored row
    (1, 3, [1, 0], 16),  # one token, the same position asked for three times; an empty prompt
])
def test_queries_at_given_positions_equal_those_rows_of_causal_attention(op_graph, T, R, lengths, dh):
    """What a prefill's last block asks for: query rows at positions in any order, repeated,
    some past the prompt (those rows zero), each attending the keys up to its position."""
    B = len(lengths)
    q, k, v = random_qkv(B, T, 4, 2, dh, 10.0, seed=T + R)
    at = np.random.default_rng(R).integers(0, T, (B, R))
    at[0, 0] = T - 1  # the last position, whose query attends every key
    rows = np.stack([q[b, at[b]] for b in range(B)])
    got = run_op(op_graph, rows, k, v, lengths, at)
    every = causal_gqa(q, k, v, lengths)
    expected = np.stack([every[b, at[b]] for b in range(B)])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(v).max())
    assert not got[np.asarray(at) >= np.asarray(lengths)[:, None]].any()


@op_alone
@pytest.mark.parametrize("shapes, lengths, at, problem", [
    (((1, 8, 3, 4), (1, 8, 2, 4), (1, 8, 2, 4)), [8], None, "3 query heads are not a multiple of 2 KV heads"),
    (((1, 8, 4, 4), (1, 8, 2, 4), (1, 8, 2, 4)), [9], None, r"lengths\[0\] = 9 outside \[0, 8\]"),
    (((1, 2, 4, 4), (1, 8, 2, 4), (1, 8, 2, 4)), [8], [[7, 8]], r"at\[0, 1\] = 8 outside \[0, 8\)"),
    (((1, 1, 4, 4), (1, 8, 2, 4), (1, 8, 2, 4)), [8], [[-1]], r"at\[0, 0\] = -1 outside \[0, 8\)"),
])
def test_the_op_refuses_bad_shapes_naming_the_problem(op_graph, shapes, lengths, at, problem):
    """What the graph's symbolic dimensions let through (a batch, head or row count that
    disagrees is refused by the graph before the op runs)."""
    q, k, v = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(Exception, match=problem):
        run_op(op_graph, q, k, v, lengths, at)


def test_the_cpu_graphs_take_the_op_and_the_plain_ones_do_not(weights):
    """Built, not compiled: the default CPU engine's prefill graph (which also scores) calls the op
    (and the op that prepares q and k), ``kernels=False`` (the GPU path's graph) has the [T, T]
    softmax instead. With float32 weights the dense layers read the decode op's packed
    matrices, not the linear op that packs per call (tests/models/pha/test_linear_packed_op.py)."""
    from srm_max.models.pha.engine import PHAEngine

    cpu_graph = str(PHAEngine(CONFIG, weights).graph_job("prefill").graph())
    assert OP_PHA_PREFILL_ATTENTION in cpu_graph and OP_PHA_QK_ROPE in cpu_graph
    assert f'"{OP_LINEAR}"' not in cpu_graph
    plain_graph = str(PHAEngine(CONFIG, weights, kernels=False).graph_job("prefill").graph())
    assert OP_PHA_PREFILL_ATTENTION not in plain_graph and OP_PHA_QK_ROPE not in plain_graph


@pytest.fixture(scope="module")
def engine(weights):
    from srm_max.models.pha.engine import PHAEngine

    return PHAEngine(CONFIG, weights, dtype="float32", device="cpu")


@op_prefill
@plain_prefill
def test_prefill_through_the_op_equals_the_plain_graph_and_the_reference(engine, weights, reference):
    """A batch of mixed lengths across the tiles: logits, next tokens, GSS states and the KV
    caches written (up to each prompt's length) against the plain graph and the reference."""
    from srm_max.models.pha.engine import PHAEngine

    plain = PHAEngine(CONFIG, weights, dtype="float32", device="cpu", kernels=False)
    prompts = prompts_of(LENGTHS, seed=7)
    got, want = assert_prefill_equals_plain_and_reference(engine, plain, reference, prompts, LENGTHS)
    for name in ("keys", "values"):
        for b, n in enumerate(LENGTHS):
            assert_close_rel(got[name][:, b, :, :n], want[name][:, b, :, :n], rel=1e-4)
    # one token alone
    one = prompts_of([1], seed=8)
    assert_close_rel(engine.host(engine.prefill(one).logits), plain.host(plain.prefill(one).logits), rel=1e-4)


@graphs(ATTENTION_ALONE, ("prefill",), kernels=True)
def test_attention_alone_through_the_op_equals_the_reference():
    from srm_max.models.pha.engine import PHAEngine

    reference = random_pha(ATTENTION_ALONE, seed=5)
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in reference.state_dict().items()}
    engine = PHAEngine(ATTENTION_ALONE, weights, dtype="float32", device="cpu")
    prompts = prompts_of(LENGTHS, seed=9)
    res, _, cache = assert_prefill_matches_reference(engine, reference, prompts, CONFIG.vocab_size)
    assert_states_close(engine, res.states, cache, LENGTHS)
