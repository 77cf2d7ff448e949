"""The dense layer op (mojo/linear.mojo, ``srm_linear``: y = x @ w^T + b) against numpy's
float64 product, and the SRM graphs that call it (graphs/ops.py ``linear``).

One compiled op graph with symbolic dimensions serves every case. Most inputs are small
multiples of 1/8, so that every sum is exact in float32 whatever its order: the op must
then equal the float64 product exactly. The shapes cross the op's edges: row counts that
are not a multiple of its register tile (5 or 6 rows) or its block (3 tiles), output
widths that are not a multiple of the SIMD width or of a panel (2 or 4 vectors), inner
widths below and off the k unrolling (4) and the SIMD width, one row, one output; and
the few-rows path (fewer rows than a tile: no packing) with inner widths off the SIMD
width and outputs across several of its blocks of 64. With bfloat16 weights (a piece of
the same op graph) each sum is rounded to bfloat16 before the bias, as MAX's bfloat16
matmul returns it.
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.bfloat16 import bfloat16_round, to_bfloat16_bits
from srm_max.graphs.op_names import OP_LINEAR, OP_LINEAR_PACKED, OP_SCORE_HEAD
from tests.support.dense_cases import eighths, many_rows
from tests.support.graphs import op_graphs
from tests.support.op_graph_builders import LINEAR_BF16
from tests.support.op_graphs import model
from tests.support.tiny import TINY

pytestmark = op_graphs(OP_LINEAR, LINEAR_BF16)


def srm_linear(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The op on x [R, K], w [N, K], b [N] -> y [R, N]."""
    out = model(OP_LINEAR).execute(*(np.ascontiguousarray(a, np.float32) for a in (x, w, b)))
    return out[0].to_numpy()


def srm_linear_bf16(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The op on bfloat16 weights (``w`` rounded to them)."""
    from max.driver import Buffer
    from max.dtype import DType

    w16 = Buffer.from_numpy(to_bfloat16_bits(w)).view(DType.bfloat16)
    out = model(LINEAR_BF16).execute(np.ascontiguousarray(x, np.float32), w16, np.ascontiguousarray(b, np.float32))
    return out[0].to_numpy()


@pytest.mark.parametrize("R, K, N", [(1, 1, 1), (1, 16, 16), (7, 3, 20), (23, 33, 37), (31, 64, 17),
                                     (61, 256, 256), (16, 257, 1001), (97, 1024, 40), (5, 8, 16),
                                     (2, 37, 130), (4, 256, 4096), (3, 5, 65)])
def test_exact_products(R, K, N):
    rng = np.random.default_rng(R * 10_000 + K * 10 + N)
    x, w, b = eighths(rng, (R, K)), eighths(rng, (N, K)), eighths(rng, N)
    expected = x.astype(np.float64) @ w.astype(np.float64).T + b
    np.testing.assert_array_equal(srm_linear(x, w, b), expected)


@pytest.mark.parametrize("R, K, N", [(1, 16, 16), (2, 37, 130), (7, 3, 20), (23, 33, 37), (61, 256, 300)])
def test_bfloat16_weights_round_each_sum_before_the_bias(R, K, N):
    """Exact sums (of eighths times 64ths, which bfloat16 holds exactly), each rounded to
    bfloat16, plus the bias in float32: equal to the float64 product rounded the same way."""
    rng = np.random.default_rng(R * 10_000 + K * 10 + N + 1)
    x, w = eighths(rng, (R, K), 7), (rng.integers(-63, 64, (N, K)) / 64).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    sums = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)  # exact
    expected = bfloat16_round(sums) + b
    assert not np.array_equal(bfloat16_round(sums), sums)  # some sums do round
    np.testing.assert_array_equal(srm_linear_bf16(x, w, b), expected)


def test_many_rows_between_the_cores():
    """Enough blocks of rows that every core takes some; every row written, none past its own."""
    x, w, b, expected = many_rows()
    np.testing.assert_allclose(srm_linear(x, w, b), expected, rtol=0, atol=1e-4)


def test_no_rows():
    rng = np.random.default_rng(6)
    assert srm_linear(np.zeros((0, 8), np.float32), eighths(rng, (3, 8)), eighths(rng, 3)).shape == (0, 3)


def test_bad_inputs_are_refused():
    rng = np.random.default_rng(7)
    x, w, b = eighths(rng, (3, 8)), eighths(rng, (5, 8)), eighths(rng, 5)
    with pytest.raises(Exception, match="w is"):
        srm_linear(x, eighths(rng, (5, 9)), b)
    with pytest.raises(Exception, match="b has 4 entries for 5 outputs"):
        srm_linear(x, w, eighths(rng, 4))


def test_the_srm_layers_use_the_linear_ops_on_a_cpu_with_the_mojo_ops():
    """Prefill and score on a CPU with the Mojo ops run their dense layers and the output
    layer through the packed-weight op on the decode op's packed copies, in the weights'
    dtype (the channel MLP's SiLU inside it), and compile no matmul; the plain graph keeps
    MAX's matmul.
    (That they compute what the reference does: tests/models/srm/test_engine.py,
    test_scoring_engine.py and test_prefill_logprobs.py.)"""
    from max.dtype import DType
    from max.graph import DeviceRef

    from srm_max.models.srm import packing
    from srm_max.models.srm.build import build_graph

    def graph(dtype, kernels):
        return str(build_graph("prefill", TINY, dtype, DeviceRef.CPU(), kernels=kernels))

    assert len(packing.packed_copies(TINY)) == 4 * TINY.n_layers + 1
    for dtype in (DType.float32, DType.bfloat16):
        packed = graph(dtype, True)
        assert packed.count(OP_LINEAR_PACKED) == 4 * TINY.n_layers + 1  # and the output layer
        # the scored rows' logits: the score head op on the output layer's packed copy
        assert packed.count(f'"{OP_SCORE_HEAD}"') == 1 and f'"{OP_LINEAR}"' not in packed
        assert "matmul" not in packed and "silu" not in packed  # no matmul kernel to compile (docs/testing.md)
    plain = graph(DType.float32, False)
    assert OP_LINEAR not in plain and "matmul" in plain
