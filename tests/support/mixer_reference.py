"""float64 numpy references of the SRM token mixer's Mojo ops (one decode step, the scan,
the closed-form state) and the tolerance the ops are held to."""

from __future__ import annotations

import numpy as np
RTOL, ATOL = 2e-5, 2e-5


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
