"""The PHA prefill's query and key preparation op (mojo/pha_qk_rope.mojo: each head
normalised, rotated by its position, q times its logit scale) against float64 numpy.

The op runs in the graph of the Mojo ops alone (tests/support/op_graphs.py ``TOGETHER``),
every dimension symbolic, on head widths whose halves are whole vectors, a vector and a
remainder, and shorter than a vector (AVX-512 and AVX2 alike), at positions up to a long
context's, with zero rows and one row. The engines' prefill through it against the plain
graph and the reference: tests/models/pha/test_pha_prefill_attention_op.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_PHA_QK_ROPE
from tests.support.graphs import op_graphs
from tests.support.op_graphs import model as op_graph_model

pytestmark = op_graphs(OP_PHA_QK_ROPE)


@pytest.fixture
def op_graph():
    return op_graph_model(OP_PHA_QK_ROPE)


def inverse_frequencies(dh: int, base: float = 10000.0) -> np.ndarray:
    half = dh // 2
    return (base ** (-np.arange(half, dtype=np.float32) / half)).astype(np.float32)


def run_op(model, q, k, pos, freq, scale):
    from max.driver import Buffer

    arrays = (q, k, np.asarray(pos, np.int64), freq, scale)
    q_out, k_out = model.execute(*(Buffer.from_numpy(np.ascontiguousarray(a)) for a in arrays))
    return q_out.to_numpy(), k_out.to_numpy()


def prepared(x, pos, freq, scale=None) -> np.ndarray:
    """float64: each head of x [B, T, H*dh] at unit length, rotated by pos [T] (angles
    pos * freq taken in float32, as the graph takes them), times ``scale`` [H*dh]."""
    B, T, width = x.shape
    half = len(freq)
    heads = x.reshape(B, T, width // (2 * half), 2 * half).astype(np.float64)
    u = heads / np.maximum(np.linalg.norm(heads, axis=-1, keepdims=True), 1e-12)
    angle = (np.asarray(pos, np.float32)[:, None] * freq[None, :]).astype(np.float64)[None, :, None, :]
    u1, u2 = u[..., :half], u[..., half:]
    out = np.concatenate([u1 * np.cos(angle) - u2 * np.sin(angle), u1 * np.sin(angle) + u2 * np.cos(angle)], -1)
    out = out.reshape(B, T, width)
    return out if scale is None else out * scale


@pytest.mark.parametrize("B, T, Hq, Hkv, dh, first", [
    (1, 1, 4, 2, 64, 0),  # one row
    (2, 37, 4, 2, 64, 0),  # halves of two AVX-512 vectors (four AVX2 ones)
    (3, 50, 2, 1, 34, 8000),  # a vector and a remainder, positions of a long context
    (2, 17, 4, 2, 6, 5),  # heads narrower than a vector
    (1, 130, 4, 1, 32, 100),  # every query head on one KV head
])
def test_the_op_equals_float64(op_graph, B, T, Hq, Hkv, dh, first):
    rng = np.random.default_rng(T + dh)
    q = rng.normal(size=(B, T, Hq * dh)).astype(np.float32)
    k = rng.normal(size=(B, T, Hkv * dh)).astype(np.float32)
    pos = np.arange(first, first + T)
    freq = inverse_frequencies(dh)
    scale = np.repeat(rng.uniform(1.0, 100.0, Hq), dh).astype(np.float32)
    got_q, got_k = run_op(op_graph, q, k, pos, freq, scale)
    np.testing.assert_allclose(got_q, prepared(q, pos, freq, scale), rtol=0, atol=2e-6 * scale.max())
    np.testing.assert_allclose(got_k, prepared(k, pos, freq), rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(got_k.reshape(B, T, Hkv, dh), axis=-1), 1.0, rtol=1e-5)


def test_a_zero_row_stays_zero(op_graph):
    """A right-padded prompt's padding rows (zero projections) are zeros, not NaN."""
    q, k = np.zeros((1, 3, 8), np.float32), np.zeros((1, 3, 4), np.float32)
    q[0, 1] = 1.0
    got_q, got_k = run_op(op_graph, q, k, [0, 1, 2], inverse_frequencies(4), np.ones(8, np.float32))
    assert np.isfinite(got_q).all() and not got_q[0, 0].any() and not got_q[0, 2].any() and not got_k.any()


def test_the_op_refuses_a_width_that_is_not_whole_heads(op_graph):
    """q's width must be whole heads of 2 x the frequencies' channels."""
    with pytest.raises(Exception, match="multiples of the head width 4"):
        run_op(op_graph, np.zeros((1, 2, 6), np.float32), np.zeros((1, 2, 4), np.float32), [0, 1],
               inverse_frequencies(4), np.ones(6, np.float32))
