"""The GSS branch: chunked scan for prefill, one recurrent step for decode.

DSS over H channels with N complex modes shared by the channels (A = Abar = exp(Lambda)):

    s_t = A s_{t-1} + x_t          x = LN(gelu(W_v h + b_v)), [H] per token
    y_t = Re(Ct . s_t) + D x_t

Prefill splits T = M C tokens into M chunks of C = ``weights.CHUNK``. With P_m the
state entering chunk m and j the offset in it:

    y[mC + j] = sum_{i <= j} K[j - i] x[mC + i]          inside the chunk: [H, C, C] Toeplitz
              + Re(sum_n Ct A**(j+1) P_m)                the state carried in
    S_m       = sum_i A**(C-1-i) x[mC + i]               the chunk's own final state
    P_m       = sum_{m' < m} A**(C (m-1-m')) S_m'        an [M, M] matrix per mode

O(T C H + T H N + M**2 H N) work and O(T H + M H N) memory per sample, against the
O(H N T**2) time and O(N T**2) memory of a dense Toeplitz kernel. Every power of A
is a table computed in float64 at load time (``weights.gss_tables``).
"""

from __future__ import annotations

import numpy as np
from max.graph import TensorValue, ops

from ..ops import I64, const, linear
from .common import Consts
from .weights import CHUNK, n_chunks


def _projections(x: TensorValue, g: dict, c):
    """(u = gelu(W_u x), the DSS input LN(gelu(W_v x + b_v)))."""
    u = ops.gelu(linear(x, g["to_u"]))
    xn = ops.layer_norm(ops.gelu(linear(x, g["to_v"], g["to_v_b"])), g["norm_w"], g["norm_b"],
                        epsilon=c.norm_eps)
    return u, xn


def _out(y: TensorValue, u: TensorValue, g: dict) -> TensorValue:
    return linear(linear(y, g["to_gate"]) * u, g["to_out"], g["to_out_b"])


def _cmul(ar, ai, br, bi):
    """(ar + i ai)(br + i bi) as real pairs."""
    return ar * br - ai * bi, ar * bi + ai * br


def gss_prefill(x: TensorValue, chunk_rows: TensorValue, chunk_cols: TensorValue, lengths: TensorValue,
                g: dict, c, K: Consts):
    """x [B, M, C, E] -> (out [B, M, C, E], state [B, 2*H*N] after each sample's last real token).

    chunk_rows, chunk_cols [M] int64: 0 .. M-1, twice (two graph inputs: see prefill.py).
    """
    H, N, C = c.gss_hidden_dim, c.dss_state_size, CHUNK
    B, M = x.shape[0], x.shape[1]
    u, xs = _projections(x, g, c)  # xs [B, M, C, H]

    # inside each chunk: [H, C, C] @ [H, C, B*M]
    xh = ops.reshape(ops.permute(xs, [3, 2, 0, 1]), [H, C, -1])
    y_in = ops.reshape(ops.matmul(g["kin"], xh), [H, C, B, M])
    y_in = ops.permute(y_in, [2, 3, 1, 0])  # [B, M, C, H]

    # each chunk's own final state, modes first: [2N, M, B*H] (real parts, then imaginary)
    rows = ops.reshape(ops.permute(xs, [0, 1, 3, 2]), [-1, C])  # [B*M*H, C]
    ends = ops.reshape(ops.matmul(rows, g["p_end"]), [B, M, H, 2 * N])
    ends = ops.reshape(ops.permute(ends, [3, 1, 0, 2]), [2 * N, M, -1])
    s_re, s_im = ends[:N], ends[N:]

    # the state entering chunk m: decay[n, m, m'] = A**(C (m-1-m')) for m' < m, else 0
    # (the zero row of p_chunk), as [N, M, M] matmuls over the modes
    ci, cj = ops.unsqueeze(chunk_rows, 1), ops.unsqueeze(chunk_cols, 0)
    before = ops.cast(cj < ci, I64)
    index = before * (ci - cj - 1) + (1 - before) * n_chunks(c)  # [M, M]
    decay = ops.permute(ops.gather(g["p_chunk"], index, axis=0), [2, 0, 1])  # [2N, M, M]
    d_re, d_im = decay[:N], decay[N:]
    p_re = ops.matmul(d_re, s_re) - ops.matmul(d_im, s_im)  # [N, M, B*H]
    p_im = ops.matmul(d_re, s_im) + ops.matmul(d_im, s_re)

    # its share of y: Re(sum_n A**(j+1) (Ct P)_n) = p_out [C, 2N] @ [Re; Im](Ct P)
    def per_mode(t):  # Ct^T [N, H] spread over [N, M, B, H]
        t = ops.broadcast_to(ops.reshape(t, [N, 1, 1, H]), [N, M, B, H])
        return ops.reshape(t, [N, M, -1])

    q_re, q_im = _cmul(per_mode(g["ct_t_re"]), per_mode(g["ct_t_im"]), p_re, p_im)
    q = ops.reshape(ops.concat([q_re, q_im], axis=0), [2 * N, -1])
    y_carry = ops.reshape(ops.matmul(g["p_out"], q), [C, M, B, H])
    y_carry = ops.permute(y_carry, [2, 1, 0, 3])  # [B, M, C, H]
    y = y_in + y_carry + xs * g["D"]
    out = _out(y, u, g)

    # the state after token e - 1 = m C + j: A**(j+1) P_m + sum_{i <= j} A**(j-i) x[mC + i]
    last = lengths - 1
    m = ops.floor_div(last, ops.constant(C, I64, device=K.device))
    j = last - m * C
    mb = ops.unsqueeze(m, -1)  # [B, 1]

    def entering(p):  # [N, M, B*H] -> [B, H, N] at each sample's chunk
        p = ops.permute(ops.reshape(p, [N, M, B, H]), [2, 1, 3, 0])
        return ops.gather_nd(p, mb, batch_dims=1)

    w = ops.gather(g["p_step"], j + 1, axis=0)  # [B, 2N]: A**(j+1)
    w_re = ops.broadcast_to(ops.reshape(w[:, :N], [B, 1, N]), [B, H, N])
    w_im = ops.broadcast_to(ops.reshape(w[:, N:], [B, 1, N]), [B, H, N])
    c_re, c_im = _cmul(w_re, w_im, entering(p_re), entering(p_im))
    offs = K.once("iota_c", lambda: const(np.arange(C, dtype=np.int64).reshape(1, C), I64, K.device))
    jb = ops.unsqueeze(j, -1)
    inside = ops.cast(offs <= jb, I64)
    index = inside * (jb - offs) + (1 - inside) * (C + 1)  # [B, C]: A**(j-i), or the zero row
    weights = ops.gather(g["p_step"], index, axis=0)  # [B, C, 2N]
    x_last = ops.permute(ops.gather_nd(xs, mb, batch_dims=1), [0, 2, 1])  # [B, H, C]
    local = ops.matmul(x_last, weights)  # [B, H, 2N]
    s_re = ops.reshape(c_re + local[:, :, :N], [B, H * N])
    s_im = ops.reshape(c_im + local[:, :, N:], [B, H * N])
    return out, ops.concat([s_re, s_im], axis=1)


def gss_step(x: TensorValue, st: TensorValue, g: dict, c, K: Consts):
    """x [B, E], this layer's state [B, X] -> (out [B, E], new GSS state [B, 2*H*N]).

    s = A s + x (complex, as real pairs over flat (h, n) channels);
    y = Re(Ct . s) + D x, the sum over n by ``group_sum``.
    """
    H, N = c.gss_hidden_dim, c.dss_state_size
    HN = H * N
    u, xn = _projections(x, g, c)  # xn [B, H]
    xe = K.spread(xn, H, N)  # [B, H*N]
    re, im = st[:, :HN], st[:, HN : 2 * HN]
    re2, im2 = _cmul(g["abar_re"], g["abar_im"], re, im)
    re2 = re2 + xe
    y = K.group_sum(re2 * g["ct_re_flat"] - im2 * g["ct_im_flat"], H, N) + xn * g["D"]
    return _out(y, u, g), ops.concat([re2, im2], axis=1)
