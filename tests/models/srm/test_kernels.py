"""Mojo custom ops of the SRM token mixer vs a float64 numpy loop.

Two CPU graphs (one step, scan) with all dims symbolic, declared below so the session
compiles them up front (tests/support/op_graphs.py). The GPU-path compile check runs in a subprocess
(virtual device mode, tests/support/virtual_gpu.py) and can be skipped with SRM_MAX_SKIP_GPU_COMPILE=1 or
``-k "not virtual_gpu"``.
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_SCAN, OP_STEP_FUNCTIONAL
from srm_max.runtime import kernels as library
from tests.support import mojo_ops as K
from tests.support import op_graph_builders, virtual_gpu
from tests.support.graphs import op_graphs
from tests.support.mixer_reference import close, closed_form_state, make_params, ref_scan, ref_step
from tests.support.op_graphs import model

pytestmark = op_graphs(OP_SCAN, OP_STEP_FUNCTIONAL)


# ----------------------------------------------------------------- fixtures


@pytest.fixture
def step_functional_model():
    return model(OP_STEP_FUNCTIONAL)


@pytest.fixture
def scan_model():
    return model(OP_SCAN)


# ----------------------------------------------------------------- library


def test_source_dir_and_library():
    src = library.mojo_source_dir()
    assert (src / "__init__.mojo").is_file()
    assert {"mixer_step.mojo", "mixer_scan.mojo"} <= {p.name for p in src.glob("*.mojo")}
    lib = library.kernel_library()
    assert lib.suffix == ".mojoc" and lib.stat().st_size > 0
    assert library.kernel_library() == lib  # cached, same file


def test_ops_registered():
    from max.graph import DeviceRef

    # building the graphs checks that every op is registered in the library
    op_graph_builders.graph_of("srm_mixer_step", op_graph_builders.STEP, DeviceRef.CPU())
    op_graph_builders.graph_of("srm_mixer_scan", op_graph_builders.SCAN, DeviceRef.CPU())


# ----------------------------------------------------------------- scan


SCAN_CASES = [
    # B, T, H, hd, n, lengths
    (1, 1, 2, 3, 4, [1]),
    (1, 6, 2, 1, 6, [6]),
    (3, 9, 4, 5, 12, [9, 0, 4]),
    (2, 17, 4, 19, 40, [17, 1]),  # hd 19: SIMD body + scalar tail
    (4, 33, 6, 37, 33, [0, 33, 20, 7]),  # T == n
    (2, 5, 4, 16, 8, [2, 5]),  # hd multiple of the SIMD width
]


@pytest.mark.parametrize("B,T,H,hd,n,lengths", SCAN_CASES)
def test_scan_matches_reference(scan_model, B, T, H, hd, n, lengths):
    rng = np.random.default_rng(B * 1000 + T * 10 + hd)
    u = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    w, beta, lam = make_params(rng, H, n)
    y, fin = K.mixer_scan(u, lengths, w, beta, lam)
    y_ref, fin_ref = ref_scan(u, lengths, w, beta, lam)
    assert y.shape == (B, T, H, hd) and fin.shape == (B, H, hd)
    assert y.dtype == np.float32 and fin.dtype == np.float32
    close(y, y_ref)
    close(fin, fin_ref)
    for b in range(B):
        close(fin[b], closed_form_state(u[b], lengths[b], w, lam, H), rtol=1e-4, atol=1e-4)
        if lengths[b] == 0:
            assert not fin[b].any()


def test_scan_padding_does_not_leak(scan_model):
    rng = np.random.default_rng(7)
    B, T, H, hd, n = 3, 12, 4, 7, 16
    lengths = [5, 12, 0]
    u = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    w, beta, lam = make_params(rng, H, n)
    y1, f1 = K.mixer_scan(u, lengths, w, beta, lam)
    u2 = u.copy()
    for b, L in enumerate(lengths):
        u2[b, L:] = rng.standard_normal(u2[b, L:].shape) * 1e3
    y2, f2 = K.mixer_scan(u2, lengths, w, beta, lam)
    np.testing.assert_array_equal(f1, f2)
    for b, L in enumerate(lengths):
        np.testing.assert_array_equal(y1[b, :L], y2[b, :L])
    # batch rows are independent: sample 0 alone gives the same result
    y0, f0 = K.mixer_scan(u[:1, :5], [5], w, beta, lam)
    np.testing.assert_array_equal(y0[0], y1[0, :5])
    np.testing.assert_array_equal(f0[0], f1[0])


def test_scan_is_stable_for_long_sequences(scan_model):
    # lam = 0.9 over 600 positions: a lam**-t rescaling would overflow float32
    rng = np.random.default_rng(3)
    B, T, H, hd, n = 1, 600, 2, 4, 600
    u = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    w, beta, _ = make_params(rng, H, n)
    lam = np.full(H, 0.9, np.float32)
    y, fin = K.mixer_scan(u, [T], w, beta, lam)
    y_ref, fin_ref = ref_scan(u, [T], w, beta, lam)
    assert np.isfinite(y).all()
    close(y, y_ref, rtol=1e-4, atol=1e-4)
    close(fin, fin_ref, rtol=1e-4, atol=1e-4)


def test_scan_rejects_bad_input():
    rng = np.random.default_rng(0)
    w, beta, lam = make_params(rng, 2, 4)
    with pytest.raises(ValueError):
        K.mixer_scan(np.zeros((1, 3, 2, 3)), [4], w, beta, lam)  # length > T


@pytest.mark.parametrize("start", [0, 3])
def test_scan_past_n_reads_the_last_position_for_the_padding(start):
    """A prompt padded to whole chunks runs past n when n is not a multiple of the chunk:
    positions clamp to n - 1, and every output and the final state are the reference's."""
    rng = np.random.default_rng(0)
    B, T, H, hd, n = 2, 7, 2, 3, 4
    w, beta, lam = make_params(rng, H, n)
    u = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    y, fin = K.mixer_scan(u, [T, 2], w, beta, lam, start=[start, start])
    clamped = np.minimum(np.arange(start + T), n - 1)  # the tables as the positions read them
    y_ref, fin_ref = ref_scan(u, [T, 2], w[:, clamped][:, start:], beta[:, clamped][:, start:], lam)
    close(y, y_ref, rtol=1e-5, atol=1e-5)
    close(fin, fin_ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- step


@pytest.mark.parametrize(
    "B,H,hd,n",
    [(1, 2, 3, 8), (3, 4, 5, 10), (2, 4, 16, 6), (5, 6, 37, 20)],
)
def test_step_several_steps(step_functional_model, B, H, hd, n):
    rng = np.random.default_rng(B * 100 + hd)
    w, beta, lam = make_params(rng, H, n)
    pos = rng.integers(0, n // 2, B)  # mixed per-sample positions
    state = rng.standard_normal((B, H, hd)).astype(np.float32)
    ref_state = state.astype(np.float64)
    for _ in range(n - n // 2):  # several steps in a row, up to position n-1
        u = rng.standard_normal((B, H, hd)).astype(np.float32)
        y, new_state = K.mixer_step(u, pos, w, beta, lam, state)
        y_ref, ref_state = ref_step(u, pos, w, beta, lam, ref_state)
        assert y.shape == (B, H, hd) and new_state.shape == (B, H, hd)
        close(y, y_ref, rtol=1e-4, atol=1e-4)
        close(new_state, ref_state, rtol=1e-4, atol=1e-4)
        state = new_state
        pos = pos + 1


def test_step_continues_scan(scan_model, step_functional_model):
    """prefill(prompt) then decode steps == one scan over the whole sequence."""
    rng = np.random.default_rng(5)
    B, T, H, hd, n = 3, 10, 4, 9, 12
    lengths = np.array([4, 1, 7])
    u = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    w, beta, lam = make_params(rng, H, n)
    y_full, _ = K.mixer_scan(u, [T] * B, w, beta, lam)
    y_pre, state = K.mixer_scan(u, lengths, w, beta, lam)
    for b, L in enumerate(lengths):
        close(y_pre[b, :L], y_full[b, :L])
    pos = lengths.copy()
    s, p = state.copy(), pos.copy()
    while (p < T).all():
        u_t = u[np.arange(B), p]
        y_t, s = K.mixer_step(u_t, p, w, beta, lam, s)
        close(y_t, y_full[np.arange(B), p], rtol=1e-4, atol=1e-4)
        p = p + 1


def test_step_out_of_range_position(step_functional_model):
    rng = np.random.default_rng(0)
    B, H, hd, n = 2, 2, 3, 4
    w, beta, lam = make_params(rng, H, n)
    u = np.ones((B, H, hd), np.float32)
    state = np.zeros((B, H, hd), np.float32)
    with pytest.raises(ValueError):
        K.mixer_step(u, [0, n], w, beta, lam, state)
    # the kernel itself poisons an out-of-range sample with NaN, never reads out of bounds
    y, ns = step_functional_model.execute(state, u, np.array([1, n], np.int64), w, beta, lam)
    y, ns = y.to_numpy(), ns.to_numpy()
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all() and np.isnan(ns[1]).all()


# ----------------------------------------------------------------- GPU path


@pytest.mark.slow
def test_gpu_path_compiles_virtual_sm90a():
    """Compile the GPU ops (the mixer step and scan) for sm_90a in MAX virtual-device mode (no GPU needed).

    Runs in a subprocess: virtual device mode must be set before any device
    exists, and this test process already has a CPU session. The session starts it
    beside the tests (tests/conftest.py ``suite_graphs``).
    """
    if reason := virtual_gpu.skip_reason():
        pytest.skip(reason)
    code, output = virtual_gpu.outcome()
    assert code == 0 and f"OK {virtual_gpu.ARCH}" in output, output


def test_the_session_starts_the_virtual_gpu_check_by_this_name(request):
    """tests/conftest.py starts the check's compile beside the tests when its test is
    selected, found by its node id."""
    assert virtual_gpu.TEST == f"{request.node.nodeid.split('::')[0]}::{test_gpu_path_compiles_virtual_sm90a.__name__}"
