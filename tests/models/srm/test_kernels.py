"""Mojo custom ops of the SRM token mixer vs a float64 numpy loop.

Three CPU graphs (in-place step, functional step, scan) with all dims symbolic,
each compiled once per cache (``srm_max.runtime.compile_cache``); cold ~25 s each on
2 cores, warm a few ms. The GPU-path compile check runs in a subprocess
(virtual device mode) and can be skipped with SRM_MAX_SKIP_GPU_COMPILE=1 or
``-k "not virtual_gpu"``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from srm_max.runtime import kernels as library
from tests.support import mojo_ops as K

RTOL, ATOL = 2e-5, 2e-5


# ----------------------------------------------------------------- reference


def ref_step(u, positions, w, beta, lam, state):
    """float64 reference of one decode step; returns (y, new_state)."""
    u, state = np.asarray(u, np.float64), np.asarray(state, np.float64).copy()
    B, H, _ = u.shape
    y = np.empty_like(u)
    for b in range(B):
        t = int(positions[b])
        for h in range(H):
            lh = float(lam[h])
            if h < H // 2:
                state[b, h] = u[b, h] + lh * state[b, h]
                y[b, h] = w[h, t] * state[b, h] + beta[h, t]
            else:
                state[b, h] = w[h, t] * u[b, h] + lh * state[b, h]
                y[b, h] = state[b, h] + beta[h, t]
    return y, state


def ref_scan(u, lengths, w, beta, lam):
    """float64 reference of the prefill scan; returns (y, final_state)."""
    u = np.asarray(u, np.float64)
    B, T, H, hd = u.shape
    y = np.empty_like(u)
    fin = np.zeros((B, H, hd))
    for b in range(B):
        s = np.zeros((H, hd))
        for t in range(T):
            y_bt, s_new = ref_step(u[b : b + 1, t], [t], w, beta, lam, s[None])
            y[b, t], s = y_bt[0], s_new[0]
            if t == lengths[b] - 1:
                fin[b] = s
    return y, fin


def closed_form_state(u, length, w, lam, H):
    """s_T = sum_i lam^(T-1-i) u_i (column), r_T = sum_i lam^(T-1-i) w[i] u_i (row)."""
    u = np.asarray(u, np.float64)  # [T, H, hd]
    out = np.zeros(u.shape[1:])
    for h in range(H):
        for i in range(length):
            coef = float(lam[h]) ** (length - 1 - i)
            if h >= H // 2:
                coef *= w[h, i]
            out[h] += coef * u[i, h]
    return out


def make_params(rng, H, n):
    w = rng.standard_normal((H, n)).astype(np.float32)
    beta = rng.standard_normal((H, n)).astype(np.float32)
    lam = rng.uniform(0.9, 1.0, H).astype(np.float32)
    return w, beta, lam


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# ----------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def step_inplace_model():
    return K._model("step_inplace")


@pytest.fixture(scope="session")
def step_functional_model():
    return K._model("step_functional")


@pytest.fixture(scope="session")
def scan_model():
    return K._model("scan")


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
    K.build_step_graph(DeviceRef.CPU(), inplace=True)
    K.build_step_graph(DeviceRef.CPU(), inplace=False)
    K.build_scan_graph(DeviceRef.CPU())


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
        K.mixer_scan(np.zeros((1, 5, 2, 3)), [5], w, beta, lam)  # T > n
    with pytest.raises(ValueError):
        K.mixer_scan(np.zeros((1, 3, 2, 3)), [4], w, beta, lam)  # length > T


def test_scan_kernel_raises_when_t_exceeds_n(scan_model):
    # bypass the wrapper: the kernel itself refuses T > n (an Error raised in
    # Mojo arrives as ValueError from execute)
    rng = np.random.default_rng(0)
    w, beta, lam = make_params(rng, 2, 4)
    u = np.zeros((1, 5, 2, 3), np.float32)
    with pytest.raises(ValueError, match="srm_mixer_scan"):
        scan_model.execute(u, np.array([5], np.int64), np.zeros(1, np.int64), np.zeros((1, 2, 3), np.float32),
                           w, beta, lam)


# ----------------------------------------------------------------- step


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "functional"])
@pytest.mark.parametrize(
    "B,H,hd,n",
    [(1, 2, 3, 8), (3, 4, 5, 10), (2, 4, 16, 6), (5, 6, 37, 20)],
)
def test_step_several_steps(step_inplace_model, step_functional_model, inplace, B, H, hd, n):
    rng = np.random.default_rng(B * 100 + hd)
    w, beta, lam = make_params(rng, H, n)
    pos = rng.integers(0, n // 2, B)  # mixed per-sample positions
    state = rng.standard_normal((B, H, hd)).astype(np.float32)
    ref_state = state.astype(np.float64)
    for _ in range(n - n // 2):  # several steps in a row, up to position n-1
        u = rng.standard_normal((B, H, hd)).astype(np.float32)
        y, new_state = K.mixer_step(u, pos, w, beta, lam, state, inplace=inplace)
        y_ref, ref_state = ref_step(u, pos, w, beta, lam, ref_state)
        assert y.shape == (B, H, hd) and new_state.shape == (B, H, hd)
        close(y, y_ref, rtol=1e-4, atol=1e-4)
        close(new_state, ref_state, rtol=1e-4, atol=1e-4)
        state = new_state
        pos = pos + 1


def test_step_inplace_mutates_buffer(step_inplace_model):
    """The in-place op updates the caller's Buffer; feed it back for 10 steps."""
    from max.driver import Buffer

    rng = np.random.default_rng(11)
    B, H, hd, n = 3, 4, 13, 16
    w, beta, lam = make_params(rng, H, n)
    host = np.zeros((B, H, hd), np.float32)
    buf = Buffer.from_numpy(host)
    ref_state = np.zeros((B, H, hd))
    pos = np.array([0, 3, 5], np.int64)
    for _ in range(10):
        u = rng.standard_normal((B, H, hd)).astype(np.float32)
        (y,) = step_inplace_model.execute(buf, u, pos, w, beta, lam)
        y_ref, ref_state = ref_step(u, pos, w, beta, lam, ref_state)
        close(y.to_numpy(), y_ref, rtol=1e-4, atol=1e-4)
        close(buf.to_numpy(), ref_state, rtol=1e-4, atol=1e-4)
        pos += 1
    close(host, ref_state, rtol=1e-4, atol=1e-4)  # numpy memory shared with the Buffer


def test_step_continues_scan(scan_model, step_inplace_model, step_functional_model):
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
    for inplace in (True, False):
        s, p = state.copy(), pos.copy()
        while (p < T).all():
            u_t = u[np.arange(B), p]
            y_t, s = K.mixer_step(u_t, p, w, beta, lam, s, inplace=inplace)
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
    """Compile all three ops for sm_90a in MAX virtual-device mode (no GPU needed).

    Runs in a subprocess: virtual device mode must be set before any device
    exists, and this test process already has a CPU session.
    """
    if os.environ.get("SRM_MAX_SKIP_GPU_COMPILE"):
        pytest.skip("SRM_MAX_SKIP_GPU_COMPILE is set")
    from max import driver

    if not hasattr(driver, "set_virtual_device_api"):
        pytest.skip("this MAX has no virtual device mode")
    proc = subprocess.run(
        [sys.executable, "-m", "srm_max.runtime.virtual_gpu", "--virtual-gpu", "sm_90a"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "OK sm_90a" in proc.stdout, proc.stdout + proc.stderr


# ----------------------------------------------------------------- the whole decode step


def ref_decode_layer(x, state, positions, p, eps):
    """numpy: one SRM block at one position per sample (graphs/srm/decode.py `step`)."""
    def ln(v, g, b):
        mu = v.mean(-1, keepdims=True)
        return (v - mu) / np.sqrt(((v - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b

    B, H, hd = state.shape
    h = ln(x, p["cn_w"], p["cn_b"]) @ p["fc1_w"].T + p["fc1_b"]
    x = x + (h / (1 + np.exp(-h))) @ p["fc2_w"].T + p["fc2_b"]
    u = (ln(x, p["tn_w"], p["tn_b"]) @ p["proj_w"].T + p["proj_b"]).reshape(B, H, hd)
    y, new_state = ref_step(u, positions, p["w"], p["beta"], p["lam"], state)
    return x + y.reshape(B, H * hd) @ p["out_w"].T + p["out_b"], new_state


DECODE_STEP_CASES = [
    # B, L, H, hd, f, V: widths below, at and past the SIMD width and the 64-column
    # panels, none a multiple of 16 (padding) and some heads straddling a SIMD vector;
    # batches of one register tile or less, several, and several units of rows
    (1, 1, 2, 3, 7, 5),
    (2, 2, 4, 5, 37, 19),
    (3, 1, 2, 16, 64, 33),
    (7, 2, 4, 24, 200, 101),
    (13, 1, 2, 40, 96, 130),
    (50, 2, 2, 8, 40, 9),
    (101, 1, 4, 32, 72, 70),
]


def random_decode_model(rng, L, H, hd, f, V, n):
    """One dict of LAYER_PARAMS per layer, an embedding of V + 3 rows and a head [V, d]."""
    d = H * hd
    shapes = {"cn_w": [d], "cn_b": [d], "fc1_w": [f, d], "fc1_b": [f], "fc2_w": [d, f], "fc2_b": [d],
              "tn_w": [d], "tn_b": [d], "proj_w": [d, d], "proj_b": [d], "out_w": [d, d], "out_b": [d]}
    layers = []
    for _ in range(L):
        p = {k: rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-1]) for k, s in shapes.items()}
        p["w"], p["beta"], p["lam"] = make_params(rng, H, n)
        layers.append(p)
    return layers, rng.standard_normal((V + 3, d)).astype(np.float32), rng.standard_normal((V, d)).astype(np.float32)


@pytest.mark.parametrize("B,L,H,hd,f,V", DECODE_STEP_CASES)
def test_whole_decode_step_matches_reference(B, L, H, hd, f, V):
    rng = np.random.default_rng(B * 100 + hd)
    n = 11
    layers, embedding, head_w = random_decode_model(rng, L, H, hd, f, V, n)
    ids = rng.integers(0, V + 3, B)
    states = rng.standard_normal((L, B, H, hd)).astype(np.float32)
    positions = rng.integers(0, n + 5, B)  # some past the context: clamped to n - 1
    logits, new_states = K.decode_step(ids, embedding, states, positions, layers, head_w, 1e-5)
    ref_x, ref_states = embedding[ids].astype(np.float64), []
    for l, p in enumerate(layers):
        ref_x, s = ref_decode_layer(ref_x, states[l], np.minimum(positions, n - 1), p, 1e-5)
        ref_states.append(s)
    close(new_states, np.stack(ref_states))
    close(logits, ref_x @ head_w.T.astype(np.float64))


@pytest.mark.parametrize("B,L,H,hd,f,V,S", [(1, 1, 2, 3, 7, 5, 4), (7, 2, 4, 24, 200, 101, 3),
                                            (50, 2, 2, 8, 40, 9, 6), (3, 1, 2, 16, 64, 33, 0),
                                            (2, 1, 2, 3, 7, 5, 70)])  # 70: two fork-joins
def test_greedy_steps_match_one_step_at_a_time(B, L, H, hd, f, V, S):
    """S greedy steps in one op = S calls of the one-step op, each fed the first argmax
    of its logits: the same tokens and bit for bit the same states (positions cross
    the context's end, where they stay clamped)."""
    rng = np.random.default_rng(S * 1000 + B)
    n = 11
    layers, embedding, head_w = random_decode_model(rng, L, H, hd, f, V, n)
    ids = rng.integers(0, V + 3, B)
    states = rng.standard_normal((L, B, H, hd)).astype(np.float32)
    positions = rng.integers(n - 4, n + 2, B)
    tokens, new_states, last, next_positions = K.decode_steps(
        ids, embedding, states, positions, layers, head_w, 1e-5, S)
    want, s, t = [], states, ids
    for k in range(S):
        logits, s = K.decode_step(t, embedding, s, positions + k, layers, head_w, 1e-5)
        t = logits.argmax(-1)
        want.append(t)
    assert tokens.shape == (B, S)
    np.testing.assert_array_equal(tokens, np.stack(want, 1) if S else np.zeros((B, 0)))
    np.testing.assert_array_equal(new_states, s)
    np.testing.assert_array_equal(last, t)
    np.testing.assert_array_equal(next_positions, positions + S)


def test_whole_decode_step_rejects_negative_positions_and_unknown_tokens():
    rng = np.random.default_rng(0)
    H, hd, f, d, n = 2, 4, 8, 8, 4
    p = {k: np.ones(s, np.float32) for k, s in {"cn_w": [d], "cn_b": [d], "fc1_w": [f, d], "fc1_b": [f],
         "fc2_w": [d, f], "fc2_b": [d], "tn_w": [d], "tn_b": [d], "proj_w": [d, d], "proj_b": [d],
         "out_w": [d, d], "out_b": [d]}.items()}
    p["w"], p["beta"], p["lam"] = make_params(rng, H, n)
    emb, states = np.ones((5, d)), np.ones((1, 2, H, hd))
    with pytest.raises(Exception, match="position -1 is negative"):
        K.decode_step([0, 1], emb, states, [0, -1], [p], np.ones((3, d)), 1e-5)
    with pytest.raises(Exception, match=r"token id 5 outside \[0, 5\)"):
        K.decode_step([5, 1], emb, states, [0, 1], [p], np.ones((3, d)), 1e-5)
    with pytest.raises(Exception, match="srm_decode_steps: position -1 is negative"):
        K.decode_steps([0, 1], emb, states, [0, -1], [p], np.ones((3, d)), 1e-5, 2)
