"""The packed-weight dense layer op (mojo/linear_packed.mojo, ``srm_linear_packed``: y = x @
w^T + b, or its exact GELU or SiLU, with w read from its packed copy at an offset of a flat array)
against numpy's float64 product, on the PHA decode op's own packed matrices, and the PHA
prefill graphs that call it.

Most inputs are small multiples of 1/8, so that every sum is exact in float32 whatever its
order: the op must then equal the float64 product exactly. The shapes cross the op's
edges: output counts that are not a multiple of the packing's row padding (16), of a
packed panel (64) or of the op's register tile (16 or 64 columns), so that the last panel
is narrower than a tile; row counts below one register tile (5 or 6 rows), off it and
across several blocks of rows; inner widths off the k unrolling and the SIMD width; and
matrices packed one after another in one array, read at their offsets. With bfloat16
matrices (a piece of the same op graph, as the decode ops' copies of bfloat16 weights)
each sum is rounded to bfloat16 before the bias, as MAX's bfloat16 matmul does.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from max.driver import Buffer
from max.dtype import DType

from srm_max.bfloat16 import bfloat16_round, to_bfloat16_bits
from srm_max.graphs.ops import ACT_GELU, ACT_NONE, ACT_SILU
from srm_max.graphs.op_names import OP_LINEAR, OP_LINEAR_PACKED, OP_SCORE_HEAD
from srm_max.models.pha import packing
from srm_max.models.srm.packing import pack_matrix
from tests.support.dense_cases import eighths, many_rows
from tests.support.graphs import op_graphs
from tests.support.op_graph_builders import LINEAR_PACKED_BF16
from tests.support.op_graphs import model
from tests.support.pha import CONFIG, random_pha

pytestmark = op_graphs(OP_LINEAR_PACKED, LINEAR_PACKED_BF16)


def linear_packed(x: np.ndarray, mats: np.ndarray, at: int, b: np.ndarray, act: int = ACT_NONE,
                  scale: np.ndarray | None = None) -> np.ndarray:
    """The op on x [R, K] and the matrix packed at ``mats[at:]`` -> y [R, len(b)]."""
    scale = np.zeros((0, 0), np.float32) if scale is None else scale
    out = model(OP_LINEAR_PACKED).execute(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(mats, np.float32),
                                          np.array([at, act], np.int64), np.ascontiguousarray(b, np.float32),
                                          np.ascontiguousarray(scale, np.float32))
    return out[0].to_numpy()


def linear_packed_bf16(x: np.ndarray, mats: np.ndarray, at: int, b: np.ndarray, act: int = ACT_NONE,
                       scale: np.ndarray | None = None) -> np.ndarray:
    """The op on bfloat16 matrices (``mats`` rounded to them)."""
    scale = np.zeros((0, 0), np.float32) if scale is None else scale
    mats16 = Buffer.from_numpy(to_bfloat16_bits(mats)).view(DType.bfloat16)
    out = model(LINEAR_PACKED_BF16).execute(np.ascontiguousarray(x, np.float32), mats16,
                                            np.array([at, act], np.int64), np.ascontiguousarray(b, np.float32),
                                            np.ascontiguousarray(scale, np.float32))
    return out[0].to_numpy()


def gelu64(v: np.ndarray) -> np.ndarray:
    """The exact GELU in float64."""
    return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


def silu64(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


ACTIVATED = {ACT_NONE: lambda v: v, ACT_GELU: gelu64, ACT_SILU: silu64}


def packed_after(*matrices: np.ndarray, lead: int = 40) -> tuple[np.ndarray, list[int]]:
    """The matrices packed one after another behind ``lead`` floats of garbage (and some
    after them): the flat array and each one's offset."""
    parts, offsets, at = [np.full(lead, 7.5, np.float32)], [], lead
    for m in matrices:
        packed = pack_matrix(m)
        parts.append(packed)
        offsets.append(at)
        at += packed.size
    parts.append(np.full(9, -3.25, np.float32))
    return np.concatenate(parts), offsets


@pytest.mark.parametrize("R, K, N", [(1, 1, 1), (1, 16, 16), (7, 3, 20), (23, 33, 37), (31, 64, 17), (5, 8, 80),
                                     (61, 256, 256), (16, 257, 1001), (2, 37, 130), (4, 256, 4096), (3, 5, 65),
                                     (100, 64, 112), (37, 24, 48)])
def test_exact_products_at_an_offset(R, K, N):
    rng = np.random.default_rng(R * 10_000 + K * 10 + N)
    x, w, b = eighths(rng, (R, K)), eighths(rng, (N, K)), eighths(rng, N)
    other = eighths(rng, (N + 3, K))  # packed before w: w starts at an offset of its own
    mats, (_, at) = packed_after(other, w)
    expected = x.astype(np.float64) @ w.astype(np.float64).T + b
    np.testing.assert_array_equal(linear_packed(x, mats, at, b), expected)


@pytest.mark.parametrize("act", [ACT_GELU, ACT_SILU])
@pytest.mark.parametrize("R, K, N", [(1, 16, 16), (7, 3, 20), (23, 33, 37), (61, 256, 1024), (5, 8, 80)])
def test_the_activation_of_the_products(R, K, N, act):
    """The activation on every stored column, the narrow last panel's included."""
    rng = np.random.default_rng(R * 10_000 + K * 10 + N + 2)
    x, w, b = eighths(rng, (R, K)), eighths(rng, (N, K)), eighths(rng, N)
    mats, (at,) = packed_after(w)
    expected = ACTIVATED[act](x.astype(np.float64) @ w.astype(np.float64).T + b)
    np.testing.assert_allclose(linear_packed(x, mats, at, b, act), expected, rtol=1e-6, atol=1e-6)


def test_the_gelu_over_the_whole_float_range_of_its_inputs():
    """The GELU's erf (one rational function up to |x| 3.9, +-1 beyond) on a dense grid of
    pre-activations from -60 to 60: within a few float32 ulps of the float64 GELU (1e-6 where
    it nears 0), exactly 0 far below zero and the input itself far above."""
    v = np.linspace(-60, 60, 48_001, dtype=np.float32)
    x = np.concatenate([v, v[:7]]).reshape(-1, 8)  # rows of 8 inputs, each its own product by 1
    w = np.eye(8, dtype=np.float32)
    mats, (at,) = packed_after(w)
    got = linear_packed(x, mats, at, np.zeros(8, np.float32), ACT_GELU).reshape(-1)[: v.size]
    expected = gelu64(v.astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=4e-7, atol=1e-6)
    assert np.all(got[v < -8] == 0) and np.array_equal(got[v > 8], v[v > 8])


def test_the_ops_erf_coefficients_are_the_fit_of_scripts_fit_erf():
    """mojo/pha_decode_step.mojo's ERF_P, ERF_Q and ERF_CLAMP are what scripts/fit_erf.py
    fits, and in float32 they are within the error the docs give, +-1 from the clamp on. The
    fit solves ill-conditioned least squares: another machine's BLAS moves its float32
    coefficients by a few units in the last place, so they are compared to 1e-4."""
    import importlib.util
    import re

    from tests.support.paths import REPO_ROOT

    spec = importlib.util.spec_from_file_location("fit_erf", REPO_ROOT / "scripts" / "fit_erf.py")
    fit_erf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit_erf)
    source = (REPO_ROOT / "mojo" / "pha_decode_step.mojo").read_text()

    def constant(name: str) -> np.ndarray:  # a number, or a tuple of them over lines
        body = re.search(rf"comptime {name}(?:: Float32)? = (\([^)]*\)|\S+)", source).group(1)
        return np.array([float(v) for v in body.strip("()").split(",")], np.float32)

    p, q = constant("ERF_P"), constant("ERF_Q")
    fitted = fit_erf.fit()
    np.testing.assert_allclose(p, fitted[0], rtol=1e-4)
    np.testing.assert_allclose(q, fitted[1], rtol=1e-4)
    assert constant("ERF_CLAMP")[0] == np.float32(fit_erf.CLAMP)
    x = np.linspace(-8, 8, 100_001, dtype=np.float32)
    error = np.abs(fit_erf.erf_float32(x, p, q).astype(np.float64) - np.vectorize(math.erf)(x.astype(np.float64)))
    assert error.max() < 3.2e-7 and np.all(fit_erf.erf_float32(np.array([3.9, 9.0, -9.0]), p, q) == [1, 1, -1])


@pytest.mark.parametrize("act", [ACT_NONE, ACT_GELU, ACT_SILU])
@pytest.mark.parametrize("R, K, N", [(1, 16, 16), (7, 3, 20), (61, 256, 1024), (5, 8, 80)])
def test_the_products_times_a_scale(R, K, N, act):
    """Each stored entry times its entry of ``scale`` (the GSS gate), after the activation."""
    rng = np.random.default_rng(R * 10_000 + K * 10 + N + 3)
    x, w, b, scale = eighths(rng, (R, K)), eighths(rng, (N, K)), eighths(rng, N), eighths(rng, (R, N))
    mats, (at,) = packed_after(w)
    y = x.astype(np.float64) @ w.astype(np.float64).T + b
    expected = ACTIVATED[act](y) * scale
    np.testing.assert_allclose(linear_packed(x, mats, at, b, act, scale), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("R, K, N", [(1, 16, 16), (2, 37, 130), (7, 3, 20), (23, 33, 37), (61, 256, 300),
                                     (40, 64, 1001)])
def test_bfloat16_matrices_round_each_sum_before_the_bias(R, K, N):
    """Exact sums (of eighths times 64ths, which bfloat16 holds exactly), each rounded to
    bfloat16, plus the bias in float32: the float64 product rounded the same way, whole and
    narrow panels, one row to several blocks."""
    rng = np.random.default_rng(R * 10_000 + K * 10 + N + 4)
    x, w = eighths(rng, (R, K), 7), (rng.integers(-63, 64, (N, K)) / 64).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    mats, (_, at) = packed_after(eighths(rng, (N + 5, K)), w)
    sums = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)  # exact
    expected = bfloat16_round(sums) + b
    assert not np.array_equal(bfloat16_round(sums), sums)  # some sums do round
    np.testing.assert_array_equal(linear_packed_bf16(x, mats, at, b), expected)


@pytest.mark.parametrize("act", [ACT_GELU, ACT_SILU])
def test_bfloat16_matrices_activate_and_scale_the_rounded_sums(act):
    rng = np.random.default_rng(5)
    R, K, N = 13, 40, 70
    x, w = eighths(rng, (R, K), 7), (rng.integers(-63, 64, (N, K)) / 64).astype(np.float32)
    b, scale = rng.standard_normal(N).astype(np.float32), eighths(rng, (R, N))
    mats, (at,) = packed_after(w)
    sums = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
    expected = ACTIVATED[act](bfloat16_round(sums).astype(np.float64) + b) * scale
    np.testing.assert_allclose(linear_packed_bf16(x, mats, at, b, act, scale), expected, rtol=1e-6, atol=1e-6)


def test_many_rows_between_the_cores():
    """Enough blocks of rows that every core takes some; every row written, none past its own."""
    x, w, b, expected = many_rows()
    mats, (at,) = packed_after(w)
    np.testing.assert_allclose(linear_packed(x, mats, at, b), expected, rtol=0, atol=1e-4)


def test_no_rows():
    rng = np.random.default_rng(6)
    mats, (at,) = packed_after(eighths(rng, (3, 8)))
    assert linear_packed(np.zeros((0, 8), np.float32), mats, at, eighths(rng, 3)).shape == (0, 3)


def test_every_matrix_of_the_pha_decode_ops_packing():
    """The op on ``packing.decode_step_weights``' MATS at each weight's offset
    (``packing.matrix_offsets``, what the prefill graph reads) is that weight's product."""
    from srm_max.graphs import pha as pha_graphs

    reference = random_pha(CONFIG, seed=2)
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in reference.state_dict().items()}
    full = {k: weights[k] for k in pha_graphs.graph_weight_names(CONFIG)} | pha_graphs.derived_weights(CONFIG, weights)
    mats = packing.decode_step_weights(CONFIG, full)[packing.MATS]
    offsets = packing.matrix_offsets(CONFIG)
    # every block's dense layers and the output layer
    assert len(offsets) == CONFIG.n_layers * (2 * len(CONFIG.ffn_dims) + 8) + 1
    rng = np.random.default_rng(3)
    for name, at in offsets.items():
        w = full[name]
        x = rng.standard_normal((9, w.shape[1])).astype(np.float32)
        b = rng.standard_normal(w.shape[0]).astype(np.float32)
        np.testing.assert_allclose(linear_packed(x, mats, at, b), x.astype(np.float64) @ w.T + b, rtol=0, atol=1e-4,
                                   err_msg=name)


def test_bad_inputs_are_refused_naming_the_problem():
    rng = np.random.default_rng(7)
    x, w, b = eighths(rng, (3, 8)), eighths(rng, (5, 8)), eighths(rng, 5)
    mats, (at,) = packed_after(w)
    for bad_at in (-1, mats.size - 16 * 8 + 1):
        with pytest.raises(Exception, match=r"a packed \[5, 8\] matrix at .* does not fit in mats of"):
            linear_packed(x, mats, bad_at, b)
    with pytest.raises(Exception, match="layer must hold an offset and an activation, got 3 entries"):
        model(OP_LINEAR_PACKED).execute(x, mats, np.array([at, 0, 0], np.int64), b, np.zeros((0, 0), np.float32))
    for act in (-1, ACT_SILU + 1):
        with pytest.raises(Exception, match=f"unknown activation {act}"):
            linear_packed(x, mats, at, b, act=act)
    with pytest.raises(Exception, match=r"scale must be \[3, 5\] or empty, got \[3, 4\]"):
        linear_packed(x, mats, at, b, scale=eighths(rng, (3, 4)))


def test_the_pha_prefill_reads_the_packed_matrices():
    """Built, not compiled: the CPU prefill graph with the Mojo ops runs every dense layer
    and the output layer through the packed-weight op on copies in the weights' dtype (the
    GELUs after the GSS's input projections and the FFNs' first layers inside it) and
    compiles no matmul; the plain graph keeps MAX's matmul; a model the decode op cannot
    run (no packed copies) takes the linear op that packs per call with bfloat16 weights.
    (That they compute what the reference does: the PHA engine tests.)"""
    from max.dtype import DType
    from max.graph import DeviceRef

    from srm_max.models.pha.build import build_graph

    def graph(dtype, kernels, config=CONFIG):
        return str(build_graph("prefill", config, dtype, DeviceRef.CPU(), kernels))

    for dtype in (DType.float32, DType.bfloat16):
        packed = graph(dtype, True)
        assert packed.count(OP_LINEAR_PACKED) == len(packing.matrix_offsets(CONFIG))
        # the scored rows' logits: the score head op on the output layer's packed copy
        assert packed.count(f'"{OP_SCORE_HEAD}"') == 1 and f'"{OP_LINEAR}"' not in packed
        assert "matmul" not in packed and "gelu" not in packed
        assert ("bf16" in packed) == (dtype == DType.bfloat16)
    sequential = dataclasses.replace(CONFIG, mode="sequential")
    assert packing.supported(sequential) is not None
    unpacked = graph(DType.bfloat16, True, sequential)
    assert OP_LINEAR_PACKED not in unpacked and f'"{OP_LINEAR}"' in unpacked
    plain = graph(DType.float32, False)
    assert OP_LINEAR_PACKED not in plain and "matmul" in plain
