"""The scored rows' reduction op (mojo/score_rows.mojo, ``srm_score_rows``) on rows the tests
make, against numpy's float64 log_softmax: the target's log-probability within 1e-4 and
the K largest in order, ties to the lower id; rows whose width is not a multiple of the
vector width, K up to the whole row and past the op's lane bound, ties across the K-th
place, huge logits, and a target outside the row refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_SCORE_ROWS
from tests.support.graphs import op_graphs
from tests.support.op_graphs import model
from tests.support.score_checks import check_scores

pytestmark = op_graphs(OP_SCORE_ROWS)


def score_rows(logits: np.ndarray, targets: np.ndarray, K: int):
    """The op on [R, V] logits -> (logprobs [R], top_values [R, K], top_ids [R, K])."""
    outs = model(OP_SCORE_ROWS).execute(np.ascontiguousarray(logits, np.float32),
                                        np.ascontiguousarray(targets, np.int64), np.zeros(K, np.int64))
    return tuple(o.to_numpy() for o in outs)


def check(logits: np.ndarray, targets: np.ndarray, K: int):
    check_scores(*score_rows(logits, targets, K), logits, targets, K)


@pytest.mark.parametrize("V", [4096, 1000, 37, 20])
def test_random_rows(V):
    rng = np.random.default_rng(V)
    logits = (rng.standard_normal((300, V)) * 3).astype(np.float32)
    check(logits, rng.integers(0, V, 300), K=min(20, V))


def test_peaked_and_ascending_rows():
    """A language model's peaked rows, and rows whose values grow along the ids (every
    vector beats the list kept so far) or fall (none does after the first)."""
    rng = np.random.default_rng(1)
    V = 512
    peaked = rng.standard_normal((8, V)).astype(np.float32)
    peaked[np.arange(8), rng.integers(0, V, 8)] += 25
    ramp = np.linspace(-5, 5, V, dtype=np.float32)
    logits = np.concatenate([peaked, np.stack([ramp, ramp[::-1]])])
    check(logits, rng.integers(0, V, len(logits)), K=20)


def test_ties_keep_the_lower_ids():
    """Values from a small set: many ties inside the K and across the K-th place."""
    rng = np.random.default_rng(2)
    logits = rng.integers(0, 4, (64, 100)).astype(np.float32)
    logits[0] = 1.0  # a flat row: the K lowest ids
    check(logits, rng.integers(0, 100, 64), K=20)


@pytest.mark.parametrize("K", [1, 5, 40, 64])
def test_any_width(K):
    """K from 1 to the whole row; past the op's lane bound (W x DEPTH values) it keeps
    the K largest without the bound."""
    rng = np.random.default_rng(K)
    logits = rng.standard_normal((50, 64)).astype(np.float32)
    check(logits, rng.integers(0, 64, 50), K=K)


def test_huge_logits_do_not_overflow():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((10, 300)) * 50 + 1e4).astype(np.float32)
    lp, values, _ = score_rows(logits, np.zeros(10, np.int64), 20)
    assert np.isfinite(lp).all() and np.isfinite(values).all()
    check(logits, np.zeros(10, np.int64), K=20)


def test_a_target_outside_the_row_is_refused():
    logits = np.zeros((3, 50), np.float32)
    with pytest.raises(Exception, match="row 1 has target 50 outside"):
        score_rows(logits, np.array([0, 50, 1]), 20)
