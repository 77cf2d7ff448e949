"""The scored rows' fused output layer and row reduction (mojo/score_head.mojo,
``srm_score_head``, reading the output layer's packed copy at an offset of a flat array)
against numpy's float64 logits and log_softmax.

Most inputs are small multiples of 1/8, so that every logit is exact in float32 whatever
the order of the sums: the op's top ids must then equal the stable argsort exactly
(ties to the lower id) and its values the float64 log_softmax within 1e-4. The shapes
cross the op's edges: row counts that are not a multiple of its register tile (5 or 6
rows) or its block (4 tiles), vocabularies that are not a multiple of the SIMD width or
of a panel (2 or 4 vectors, and of the packing's 64-token panels), widths below the k
unrolling, one row, K from 1 to V. With a bfloat16 copy (a piece of the same op graph)
each logit is rounded to bfloat16 first.
"""

from __future__ import annotations

import numpy as np
import pytest

from max.driver import Buffer
from max.dtype import DType

from srm_max.bfloat16 import bfloat16_round, to_bfloat16_bits
from srm_max.graphs.op_names import OP_SCORE_HEAD
from srm_max.models.srm.packing import pack_matrix
from tests.support.graphs import op_graphs
from tests.support.op_graph_builders import SCORE_HEAD_BF16
from tests.support.op_graphs import model
from tests.support.score_checks import ATOL, check_scores, log_softmax64

pytestmark = op_graphs(OP_SCORE_HEAD, SCORE_HEAD_BF16)
LEAD = 24  # entries before the packed head: the op reads it at an offset


def packed_head(head: np.ndarray) -> np.ndarray:
    """head [V, d] packed as the engines pack it, behind LEAD entries of garbage."""
    return np.concatenate([np.full(LEAD, 9.5, np.float32), pack_matrix(head).reshape(-1), np.full(5, -9.5, np.float32)])


def score_packed(mats, head_at, x: np.ndarray, targets: np.ndarray, K: int, graph: str = OP_SCORE_HEAD):
    """The op on x and the packed head at ``head_at`` = (offset, V) of ``mats``."""
    outs = model(graph).execute(np.ascontiguousarray(x, np.float32), mats, np.asarray(head_at, np.int64),
                                np.ascontiguousarray(targets, np.int64), np.zeros(K, np.int64))
    return tuple(o.to_numpy() for o in outs)


def score_head(x: np.ndarray, head: np.ndarray, targets: np.ndarray, K: int):
    """The op on x [R, d] and head [V, d] packed -> (logprobs [R], top_values [R, K], top_ids [R, K])."""
    return score_packed(packed_head(head), [LEAD, head.shape[0]], x, targets, K)


def eighths(rng, shape, spread: int = 2) -> np.ndarray:
    """Values k / 8 for integers |k| <= spread: products and sums of them are exact in float32."""
    return (rng.integers(-spread, spread + 1, shape) / 8).astype(np.float32)


def check(x: np.ndarray, head: np.ndarray, targets: np.ndarray, K: int):
    logits = x.astype(np.float64) @ head.astype(np.float64).T  # exact: the inputs are eighths
    check_scores(*score_head(x, head, targets, K), logits, targets, K)


@pytest.mark.parametrize("R, d, V", [(1, 16, 4096), (7, 3, 20), (23, 33, 37), (61, 64, 1001), (97, 256, 4096),
                                     (121, 17, 129)])
def test_exact_logits(R, d, V):
    """Rows across tile and block edges, vocabularies off the vector and panel widths;
    values from a few steps, so many ties inside the top 20 and across its last place."""
    rng = np.random.default_rng(R * 1000 + V)
    x, head = eighths(rng, (R, d)), eighths(rng, (V, d))
    check(x, head, rng.integers(0, V, R), K=min(20, V))


def test_many_rows_between_the_cores():
    """Enough blocks of rows that every core takes some, random (inexact) values."""
    rng = np.random.default_rng(5)
    R, d, V = 2003, 64, 777
    x = rng.standard_normal((R, d)).astype(np.float32)
    head = (rng.standard_normal((V, d)) / 4).astype(np.float32)
    lp, values, ids = score_head(x, head, rng.integers(0, V, R), 20)
    ref = log_softmax64(x.astype(np.float64) @ head.astype(np.float64).T)
    np.testing.assert_allclose(values, -np.sort(-ref, axis=-1)[:, :20], rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.take_along_axis(ref, ids, -1), values, rtol=0, atol=ATOL)


def test_flat_rows_keep_the_lowest_ids():
    """A zero x makes every logit 0: the top K are ids 0 .. K-1, each log(1/V)."""
    V = 300
    rng = np.random.default_rng(6)
    lp, values, ids = score_head(np.zeros((9, 12), np.float32), eighths(rng, (V, 12)), np.arange(9), 20)
    np.testing.assert_array_equal(ids, np.tile(np.arange(20), (9, 1)))
    np.testing.assert_allclose(values, np.full((9, 20), -np.log(V)), rtol=0, atol=ATOL)
    np.testing.assert_allclose(lp, np.full(9, -np.log(V)), rtol=0, atol=ATOL)


@pytest.mark.parametrize("K", [1, 64])
def test_any_width(K):
    """K from 1 to the whole row (64 tokens, past the reduction's lane bound)."""
    rng = np.random.default_rng(K)
    x, head = eighths(rng, (30, 40)), eighths(rng, (64, 40))
    check(x, head, rng.integers(0, 64, 30), K=K)


@pytest.mark.parametrize("R, d, V", [(1, 16, 300), (29, 40, 1001)])
def test_a_bfloat16_head_rounds_each_logit(R, d, V):
    """Exact logits (eighths times 64ths), each rounded to bfloat16 as a bfloat16 product
    returns it, then reduced: the float64 log_softmax of the rounded logits."""
    rng = np.random.default_rng(R + V)
    x, head = eighths(rng, (R, d), 7), (rng.integers(-63, 64, (V, d)) / 64).astype(np.float32)
    logits = (x.astype(np.float64) @ head.astype(np.float64).T).astype(np.float32)  # exact
    assert not np.array_equal(bfloat16_round(logits), logits)  # some do round
    mats16 = Buffer.from_numpy(to_bfloat16_bits(packed_head(head))).view(DType.bfloat16)
    targets = rng.integers(0, V, R)
    scores = score_packed(mats16, [LEAD, V], x, targets, 20, SCORE_HEAD_BF16)
    check_scores(*scores, bfloat16_round(logits).astype(np.float64), targets, 20)


def test_bad_inputs_are_refused():
    rng = np.random.default_rng(7)
    x, head = eighths(rng, (3, 8)), eighths(rng, (50, 8))
    with pytest.raises(Exception, match="row 1 has target 50 outside"):
        score_head(x, head, np.array([0, 50, 1]), 20)
    mats = packed_head(head)
    for bad in ([LEAD + 8, 50], [-1, 50], [LEAD, 0], [mats.size, 50]):
        with pytest.raises(Exception, match=r"a packed \[.*, 8\] head at .* does not fit in mats of"):
            score_packed(mats, bad, x, np.zeros(3, np.int64), 20)
    with pytest.raises(Exception, match="head_at must hold an offset and a vocabulary size, got 3 entries"):
        score_packed(mats, [LEAD, 50, 0], x, np.zeros(3, np.int64), 20)
    with pytest.raises(Exception, match="K=51 must be 1 to the vocabulary size 50"):
        score_head(x, head, np.zeros(3, np.int64), 51)
