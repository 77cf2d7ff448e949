"""The PHA prefill's GSS scan op (mojo/pha_gss_scan.mojo: the state carried across
chunks and through each prompt's last tokens, the prefill graph's GSS on a CPU with the
Mojo ops) against float64
numpy, the plain-op prefill graph (``kernels=False``, its [M, M] decay matrix per mode)
and the PyTorch reference.

The op alone runs in a graph of its own with every dimension symbolic (one compile), on
prompts of 1, 63, 64, 65 tokens and several chunks, padding past each prompt, batch > 1,
a mode count that is not a multiple of the SIMD width, and 128 chunks of slow modes (the
8,192 tokens of bench/pha_long_context.py) for the float64 phase accuracy. The engine
tests reuse tests/support/pha.py's CONFIG and its prefill graphs with and without the
Mojo ops (declared by test_pha_prefill_attention_op.py and test_pha_decode_op.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_PHA_GSS_SCAN
from srm_max.graphs.pha.gss import CHUNK
from tests.support.checks import assert_close_rel
from tests.support.graphs import graphs, op_graphs
from tests.support.op_graphs import model as op_graph_model
from tests.support.pha import CONFIG, assert_prefill_equals_plain_and_reference, prompts_of

# the op's own tests run a graph of the op alone; the tests that prefill through it, the
# engines' prefill graphs
op_alone = op_graphs(OP_PHA_GSS_SCAN)
op_prefill = graphs(CONFIG, ("prefill",), kernels=True)
plain_prefill = graphs(CONFIG, ("prefill",), kernels=False)


@pytest.fixture
def op_graph():
    """The op alone: (ends [B, M, H, 2N], xs [B, M, C, H], a_chunk [2N], a_step [2N],
    ct [H, 2N], lengths [B]) -> (carried [B, M, H, 2N], state [B, 2, H, N])."""
    return op_graph_model(OP_PHA_GSS_SCAN)


def run_op(model, ends, xs, a_chunk, a_step, ct, lengths):
    from max.driver import Buffer

    arrays = (ends, xs, a_chunk, a_step, ct, np.asarray(lengths, np.int64))
    carried, state = model.execute(*(Buffer.from_numpy(np.ascontiguousarray(a)) for a in arrays))
    return carried.to_numpy(), state.to_numpy()


def pairs(z: np.ndarray) -> np.ndarray:
    return np.concatenate([z.real, z.imag], axis=-1)


def complex_of(p: np.ndarray) -> np.ndarray:
    n = p.shape[-1] // 2
    return p[..., :n] + 1j * p[..., n:]


def state_of(state: np.ndarray) -> np.ndarray:
    """The op's state [B, 2, H, N] (real parts, then imaginary) as complex [B, H, N]."""
    return state[:, 0] + 1j * state[:, 1]


def float64_scan(x, lengths, lam, ct, M):
    """The token-by-token recurrence s_t = A s_{t-1} + x_t in complex128 over prompts
    right-padded to M chunks: (carried [B, M, H, N] = Ct P_m for the chunks holding each
    prompt, else 0; the state after each prompt's last token [B, H, N]; each chunk's own
    final state [B, M, H, N])."""
    B, T, H = x.shape
    A = np.exp(lam)
    carried = np.zeros((B, M, H, lam.size), complex)
    last = np.zeros((B, H, lam.size), complex)
    ends = np.zeros((B, M, H, lam.size), complex)
    for b in range(B):
        chunks = -(-lengths[b] // CHUNK)
        s = np.zeros((H, lam.size), complex)
        for m in range(M):
            if m < chunks:
                carried[b, m] = ct * s
            own = np.zeros_like(s)
            for t in range(m * CHUNK, (m + 1) * CHUNK):
                own = A * own + x[b, t][:, None]
                s = A * s + x[b, t][:, None]
                if t == lengths[b] - 1:
                    last[b] = s
            ends[b, m] = own
    return carried, last, ends


def random_case(B, M, H, N, seed, slow=False):
    """Inputs x [B, M C, H], Lambda [N] (modes decaying from 0.1 to 0.995 per token, or
    to 0.9999 with ``slow``; phases up to pi per token) and Ct [H, N]."""
    rng = np.random.default_rng(seed)
    decay = np.linspace(np.log(0.1), np.log(0.9999 if slow else 0.995), N)
    lam = decay + 1j * rng.uniform(0, np.pi, N)
    ct = rng.normal(size=(H, N)) + 1j * rng.normal(size=(H, N))
    return rng.normal(size=(B, M * CHUNK, H)), lam, ct


def op_inputs(ends, x, lam, ct):
    """The op's float32 inputs as the graph gives them (A**C and A from the float64
    table; x [B, M C, H] as chunks [B, M, C, H])."""
    B, T, H = x.shape
    xs = x.reshape(B, T // CHUNK, CHUNK, H)
    return tuple(a.astype(np.float32) for a in (pairs(ends), xs, pairs(np.exp(CHUNK * lam)), pairs(np.exp(lam)),
                                                pairs(ct)))


@op_alone
@pytest.mark.parametrize("B, H, N, lengths", [
    (1, 3, 8, [1]),  # one token
    (1, 2, 8, [63]),  # inside the first chunk
    (1, 2, 8, [64]),  # on its edge
    (1, 2, 8, [65]),  # one token into the second chunk
    (3, 4, 5, [200, 64, 129]),  # several chunks, padding past two prompts; N not a multiple of the SIMD width
    (2, 2, 8, [0, 130]),  # an empty prompt
    (2, 3, 45, [70, 128]),  # modes in blocks of several vectors, one vector and single modes (the last chunk)
])
def test_the_op_equals_the_float64_recurrence(op_graph, B, H, N, lengths):
    M = max(1, -(-max(lengths) // CHUNK))
    x, lam, ct = random_case(B, M, H, N, seed=sum(lengths) + N)
    carried, last, ends = float64_scan(x, lengths, lam, ct, M)
    got_carried, got_state = run_op(op_graph, *op_inputs(ends, x, lam, ct), lengths)
    scale = np.abs(carried).max() + 1e-30
    np.testing.assert_allclose(complex_of(got_carried), carried, rtol=0, atol=2e-6 * scale)
    np.testing.assert_allclose(state_of(got_state), last, rtol=0, atol=2e-6 * (np.abs(last).max() + 1e-30))
    for b, n in enumerate(lengths):
        assert not got_carried[b, -(-n // CHUNK):].any()  # past the prompt: zeros, not left unwritten
        if n == 0:
            assert not got_state[b].any()


@op_alone
def test_the_phases_stay_accurate_over_8192_tokens(op_graph):
    """128 chunks of modes that keep 0.9999 of their size per token: the state entering
    each chunk against a complex128 sum of the powers of A, within the float32 rounding of
    A**C compounded over the chunks crossed (127 * 2**-24, about 8e-6); the state after
    the last token (no input in the last chunk: A**C times the state entering it) within
    that and A's rounding over the chunk's 64 tokens."""
    M, H, N = 128, 2, 16
    rng = np.random.default_rng(3)
    _, lam, ct = random_case(1, 1, H, N, seed=3, slow=True)
    ends = rng.normal(size=(1, M, H, N)) + 1j * rng.normal(size=(1, M, H, N))
    AC = np.exp(CHUNK * lam)
    entering = np.zeros((1, M, H, N), complex)
    for m in range(1, M):
        entering[0, m] = AC * entering[0, m - 1] + ends[0, m - 1]
    got, state = run_op(op_graph, *op_inputs(ends, np.zeros((1, M * CHUNK, H)), lam, ct), [M * CHUNK])
    error = np.abs(complex_of(got) - ct * entering) / np.abs(ct * entering).max()
    assert error.max() < 1e-5
    after = AC * entering[0, -1]
    np.testing.assert_allclose(state_of(state)[0], after, rtol=0, atol=1e-5 * np.abs(after).max())


@op_alone
@pytest.mark.parametrize("shapes, lengths, problem", [
    (((1, 2, 3, 7), (1, 2, 4, 3), (7,), (7,), (3, 7)), [1], r"last axis \(7\) must be 2N"),
    (((1, 2, 3, 8), (1, 2, 4, 2), (8,), (8,), (3, 8)), [1], r"xs must be \[B, M, C, H\] = \[1, 2, C, 3\]"),
    (((1, 2, 3, 8), (1, 2, 4, 3), (6,), (8,), (3, 8)), [1], "a_chunk and a_step have 6 and 8 entries, ends' rows 8"),
    (((1, 2, 3, 8), (1, 2, 4, 3), (8,), (8,), (2, 8)), [1], r"ct must be \[H, 2N\] = \[3, 8\]"),
    (((2, 2, 3, 8), (2, 2, 4, 3), (8,), (8,), (3, 8)), [1], "lengths must have one entry per sample"),
    (((1, 2, 3, 8), (1, 2, 4, 3), (8,), (8,), (3, 8)), [9], r"lengths\[0\] = 9 outside \[0, 8\]"),
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
