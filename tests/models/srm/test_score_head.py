"""The score graph's fused output layer and row reduction (mojo/score_head.mojo,
``srm_score_head``) against numpy's float64 logits and log_softmax.

Most inputs are small multiples of 1/8, so that every logit is exact in float32 whatever
the order of the sums: the op's top ids must then equal the stable argsort exactly
(ties to the lower id) and its values the float64 log_softmax within 1e-4. The shapes
cross the op's edges: row counts that are not a multiple of its register tile (5 or 6
rows) or its block (4 tiles), vocabularies that are not a multiple of the SIMD width or
of a panel (2 or 4 vectors), widths below the k unrolling, one row, K from 1 to V.
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_SCORE_HEAD
from tests.support.graphs import op_graphs
from tests.support.op_graphs import model
from tests.support.score_checks import ATOL, check_scores, log_softmax64

pytestmark = op_graphs(OP_SCORE_HEAD)


def score_head(x: np.ndarray, head: np.ndarray, targets: np.ndarray, K: int):
    """The op on x [R, d], head [V, d] -> (logprobs [R], top_values [R, K], top_ids [R, K])."""
    outs = model(OP_SCORE_HEAD).execute(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(head, np.float32),
                                        np.ascontiguousarray(targets, np.int64), np.zeros(K, np.int64))
    return tuple(o.to_numpy() for o in outs)


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


def test_bad_inputs_are_refused():
    rng = np.random.default_rng(7)
    x, head = eighths(rng, (3, 8)), eighths(rng, (50, 8))
    with pytest.raises(Exception, match="row 1 has target 50 outside"):
        score_head(x, head, np.array([0, 50, 1]), 20)
    with pytest.raises(Exception, match="head is"):
        score_head(x, eighths(rng, (50, 9)), np.zeros(3, np.int64), 20)
