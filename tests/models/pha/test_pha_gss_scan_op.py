"""The PHA prefill's GSS scan op (mojo/pha_gss_scan.mojo: the DSS outputs of every
token and the state after each prompt's last token, the prefill graph's GSS on a CPU with
the Mojo ops) against float64 numpy, both ways it sums the outputs (the state carried into
each chunk, and one Toeplitz sum over a whole prompt no longer than its long taps), the
plain-op prefill graph (``kernels=False``: its Toeplitz and table matmuls and [M, M] decay
matrix per mode) and the PyTorch reference.

The op alone runs in a graph of its own with every dimension symbolic (one compile), on
the load-time tables of ``gss_tables``, prompts of 1, 63, 64, 65 tokens and several
chunks, padding past each prompt (zero outputs there), batch > 1, channels in several register tiles and a
remainder, mode counts that fill no whole vector or panel, and 128 chunks of slow modes
(the 8,192 tokens of bench/pha_long_context.py) for the float64 phase accuracy. The engine
tests reuse tests/support/pha.py's CONFIG and its prefill graphs with and without the
Mojo ops (declared by test_pha_prefill_attention_op.py and test_pha_decode_op.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_PHA_GSS_SCAN
from srm_max.graphs.pha import gss
from srm_max.graphs.pha.gss import CHUNK, gss_tables, long_taps
from tests.support.checks import assert_close_rel
from tests.support.graphs import graphs, op_graphs
from tests.support.op_graphs import model as op_graph_model
from tests.support.pha import CONFIG, assert_prefill_equals_plain_and_reference, prompts_of

# the op's own tests run a graph of the op alone; the tests that prefill through it, the
# engines' prefill graphs
op_alone = op_graphs(OP_PHA_GSS_SCAN)
op_prefill = graphs(CONFIG, ("prefill",), kernels=True)
plain_prefill = graphs(CONFIG, ("prefill",), kernels=False)
TABLES = ("taps", "long_taps", "D", "p_end", "p_out_t", "p_step", "ct_rows")


@pytest.fixture
def op_graph():
    """The op alone: (xs [B, M, C, H], taps [H, C], long_taps [LT, H], d [H], p_end [C, 2N],
    p_out_t [2N, C], p_step [S, 2N], ct [H, 2N], lengths [B]) -> (y [B, M, C, H], state [B, 2, H, N])."""
    return op_graph_model(OP_PHA_GSS_SCAN)


def run_op(model, *arrays):
    from max.driver import Buffer

    *floats, lengths = arrays
    inputs = [np.ascontiguousarray(a, np.float32) for a in floats] + [np.asarray(lengths, np.int64)]
    y, state = model.execute(*(Buffer.from_numpy(a) for a in inputs))
    return y.to_numpy(), state.to_numpy()


def state_of(state: np.ndarray) -> np.ndarray:
    """The op's state [B, 2, H, N] (real parts, then imaginary) as complex [B, H, N]."""
    return state[:, 0] + 1j * state[:, 1]


def float64_scan(x, lengths, lam, ct, d, C=CHUNK):
    """The token-by-token recurrence s_t = A s_{t-1} + x_t, y_t = Re(sum_n Ct s_t) + D x_t
    in complex128 over prompts right-padded to chunks of C: (y [B, T, H], zero in the
    chunks past each prompt (no caller reads them; the op writes zeros); the state after
    each prompt's last token [B, H, N])."""
    B, T, H = x.shape
    A = np.exp(lam)
    y = np.zeros((B, T, H))
    last = np.zeros((B, H, lam.size), complex)
    for b in range(B):
        chunks = -(-lengths[b] // C)
        s = np.zeros((H, lam.size), complex)
        for t in range(T):
            if t >= chunks * C:
                break
            s = A * s + x[b, t][:, None]
            y[b, t] = (ct * s).sum(-1).real + d * x[b, t]
            if t == lengths[b] - 1:
                last[b] = s
    return y, last


def random_case(B, M, H, N, seed, slow=False, C=CHUNK):
    """x [B, M C, H], Lambda [N] (modes decaying from 0.1 to 0.995 per token, or to 0.9999
    with ``slow``; phases up to pi per token), Ct [H, N] and D [H]."""
    rng = np.random.default_rng(seed)
    decay = np.linspace(np.log(0.1), np.log(0.9999 if slow else 0.995), N)
    lam = decay + 1j * rng.uniform(0, np.pi, N)
    ct = (rng.normal(size=(H, N)) + 1j * rng.normal(size=(H, N))) / np.sqrt(N)
    return rng.normal(size=(B, M * C, H)), lam, ct, rng.normal(size=H)


def op_inputs(x, lam, ct, d, C=CHUNK, whole=False):
    """The op's inputs as the prefill graph gives them: x [B, M C, H] as chunks
    [B, M, C, H] and the layer's float64 tables (``gss_tables``, whose chunk is C)
    rounded to float32; long taps for the whole padded prompt with ``whole`` (the op sums
    it at once), else a single row (it carries the state into each chunk)."""
    B, T, H = x.shape
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gss, "CHUNK", C)
        tables = gss_tables(SimpleNamespace(context_length=T, dss_state_size=lam.size), lam, ct) | {"D": d}
    tables["long_taps"] = long_taps(lam, ct, T if whole else 1)
    return (x.reshape(B, T // C, C, H), *(tables[k] for k in TABLES))


@op_alone
@pytest.mark.parametrize("whole", [False, True], ids=["by_chunks", "whole_prompt"])
@pytest.mark.parametrize("B, H, N, lengths, C", [
    (1, 3, 8, [1], CHUNK),  # one token
    (1, 2, 8, [63], CHUNK),  # inside the first chunk
    (1, 2, 8, [64], CHUNK),  # on its edge
    (1, 2, 8, [65], CHUNK),  # one token into the second chunk
    (3, 4, 5, [200, 64, 129], CHUNK),  # several chunks, padding past two; N not a multiple of the SIMD width
    (2, 2, 8, [0, 130], CHUNK),  # an empty prompt
    (2, 13, 45, [70, 128], CHUNK),  # channels in two whole register tiles and a remainder; 2N = 90: panels and a rest
    (2, 7, 9, [50, 21], 21),  # chunks of 21 tokens: no whole panel or vector of them
])
def test_the_op_equals_the_float64_recurrence(op_graph, B, H, N, lengths, C, whole):
    M = max(1, -(-max(lengths) // C))
    x, lam, ct, d = random_case(B, M, H, N, seed=sum(lengths) + N, C=C)
    want_y, want_last = float64_scan(x, lengths, lam, ct, d, C)
    got_y, got_state = run_op(op_graph, *op_inputs(x, lam, ct, d, C, whole), lengths)
    np.testing.assert_allclose(got_y.reshape(want_y.shape), want_y, rtol=0, atol=1e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(state_of(got_state), want_last, rtol=0,
                               atol=2e-6 * (np.abs(want_last).max() + 1e-30))
    for b, n in enumerate(lengths):
        if n == 0:
            assert not got_state[b].any()  # zeros, not left unwritten


@op_alone
@pytest.mark.parametrize("whole", [False, True], ids=["by_chunks", "whole_prompt"])
def test_the_phases_stay_accurate_over_8192_tokens(op_graph, whole):
    """128 chunks of modes that keep 0.9999 of their size per token: every output and
    the state after the last token against the complex128 recurrence, within the float32
    rounding of A**C compounded over the chunks crossed (127 * 2**-24, about 8e-6) and of
    the products by the tables."""
    M, H, N = 128, 2, 16
    x, lam, ct, d = random_case(1, M, H, N, seed=3, slow=True)
    want_y, want_last = float64_scan(x, [M * CHUNK], lam, ct, d)
    got_y, state = run_op(op_graph, *op_inputs(x, lam, ct, d, whole=whole), [M * CHUNK])
    np.testing.assert_allclose(got_y.reshape(want_y.shape), want_y, rtol=0, atol=2e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(state_of(state), want_last, rtol=0, atol=2e-5 * np.abs(want_last).max())


def _shapes(B=1, M=2, C=4, H=3, N=4, S=None, taps=None, long=None, d=None, p_end=None, p_out_t=None, ct=None):
    """Zero inputs of consistent shapes, one of them replaced to make it wrong."""
    return [(B, M, C, H), taps or (H, C), long or (1, H), d or (H,), p_end or (C, 2 * N), p_out_t or (2 * N, C),
            (S or C + 2, 2 * N), ct or (H, 2 * N)]


@op_alone
@pytest.mark.parametrize("shapes, lengths, problem", [
    (_shapes(p_end=(4, 7)), [1], r"p_end's last axis \(7\) must be 2N"),
    (_shapes(taps=(3, 5)), [1], r"taps must be \[H, C\] = \[3, 4\]"),
    (_shapes(long=(8, 2)), [1], r"long_taps must be \[LT, H\] with H = 3"),
    (_shapes(d=(2,)), [1], "d has 2 entries for 3 channels"),
    (_shapes(p_end=(5, 8)), [1], r"p_end must be \[C, 2N\] = \[4, 8\]"),
    (_shapes(p_out_t=(8, 5)), [1], r"p_out_t must be \[2N, C\] = \[8, 4\]"),
    (_shapes(S=4), [1], r"p_step must be \[S, 2N\] with S > C = 4"),
    (_shapes(ct=(2, 8)), [1], r"ct must be \[H, 2N\] = \[3, 8\]"),
    (_shapes(B=2), [1], "lengths must have one entry per sample"),
    (_shapes(), [9], r"lengths\[0\] = 9 outside \[0, 8\]"),
])
def test_the_op_refuses_bad_shapes_naming_the_problem(op_graph, shapes, lengths, problem):
    with pytest.raises(Exception, match=problem):
        run_op(op_graph, *(np.zeros(s, np.float32) for s in shapes), lengths)


def test_the_cpu_graphs_take_the_op_and_the_plain_ones_do_not(weights):
    """Built, not compiled: the default CPU engine's prefill graph (which also scores) calls the op,
    ``kernels=False`` (the GPU path's graph) carries the state by matmuls instead."""
    from srm_max.models.pha.engine import PHAEngine

    assert OP_PHA_GSS_SCAN in str(PHAEngine(CONFIG, weights).graph_job("prefill").graph())
    assert OP_PHA_GSS_SCAN not in str(PHAEngine(CONFIG, weights, kernels=False).graph_job("prefill").graph())


# prompts ending inside, on and after each chunk edge of CONFIG's 160-token context
LENGTHS = [1, 63, 64, 65, 127, 128, 129, 160]


@op_prefill
@plain_prefill
def test_prefill_through_the_op_equals_the_plain_graph_and_the_reference(weights, reference):
    """A batch of mixed lengths, padded to 3 chunks: logits, next tokens and the GSS
    states against the plain graph and the reference; then each prompt alone (no
    padding, 1 to 3 chunks)."""
    from srm_max.models.pha.engine import PHAEngine

    engine = PHAEngine(CONFIG, weights, dtype="float32", device="cpu")
    plain = PHAEngine(CONFIG, weights, dtype="float32", device="cpu", kernels=False)
    prompts = prompts_of(LENGTHS, seed=11)
    got, want = assert_prefill_equals_plain_and_reference(engine, plain, reference, prompts, LENGTHS)
    for prompt in (prompts[0], prompts[3], prompts[-1]):
        alone, base = engine.prefill([prompt]), plain.prefill([prompt])
        assert_close_rel(engine.host(alone.logits), plain.host(base.logits), rel=1e-4)
        assert_close_rel(engine.split_states(alone.states)["gss_state"], plain.split_states(base.states)["gss_state"],
                         rel=1e-4)
