"""The GSS branch: its load-time tables, the chunked-scan prefill and the decode step.

DSS over H channels with N complex modes shared by the channels (A = Abar = exp(Lambda)):

    s_t = A s_{t-1} + x_t          x = LN(gelu(W_v h + b_v)), [H] per token
    y_t = Re(Ct . s_t) + D x_t

Prefill splits T = M C tokens into M chunks of C = ``CHUNK``. With P_m the state
entering chunk m and j the offset in it:

    y[mC + j] = sum_{i <= j} K[j - i] x[mC + i]          inside the chunk: [H, C, C] Toeplitz
              + Re(sum_n Ct A**(j+1) P_m)                the state carried in
    S_m       = sum_i A**(C-1-i) x[mC + i]               the chunk's own final state
    P_m       = sum_{m' < m} A**(C (m-1-m')) S_m'        an [M, M] matrix per mode (plain ops)
              = A**C P_{m-1} + S_{m-1}                   one pass over the chunks (the Mojo op)

O(T C H + T H N) work and O(T H + M H N) memory per sample, plus O(M**2 H N) work on
the plain path (the GPU path and the op's reference) or O(M H N) through the op
(mojo/pha_gss_scan.mojo, CPU code, which also does the in-chunk sums and the products
by the tables; a prompt of up to ``whole_prompt_rows`` tokens it sums as one Toeplitz
sum over the whole prompt, O(T**2 H), fewer multiply-adds than the carried share's
O(T H N) there), against the O(H N T**2) time and O(N T**2) memory
of a dense Toeplitz kernel. Every power of A is a table computed in float64 at load
time (``gss_tables``), so long-range phases keep float64 accuracy; the op carries the
state in float64 from the table's A**C.
"""

from __future__ import annotations

import numpy as np
from max.graph import TensorType, TensorValue, ops

from ..op_names import OP_PHA_GSS_SCAN
from ..ops import F32, I64, Dense, Rows, const, floor_div_nonnegative, linear

# Prefill chunk (tokens). The scan costs O(T C H) inside chunks and O((T / C)**2 N H)
# between them on the plain path; 64 balances the two at T = 8192, N = 512.
CHUNK = 64


def n_chunks(config) -> int:
    """Chunks of the longest prompt: ceil(n / CHUNK)."""
    return -(-config.context_length // CHUNK)


def _pairs(z: np.ndarray) -> np.ndarray:
    """complex [..., N] -> real [..., 2N]: real parts, then imaginary parts."""
    return np.concatenate([z.real, z.imag], axis=-1)


def whole_prompt_rows(config) -> int:
    """Rows of the whole-prompt taps ``long_taps``: the op sums a prompt of up to this many
    (padded) tokens as one Toeplitz sum over it, T / 2 multiply-adds per token and channel
    on average, instead of carrying the state into each chunk, 2N per token and channel
    (``p_out``) whatever T; so up to 4N tokens, where the two counts meet (and at least one
    chunk, where the two are the same sum), at most the context's chunks. The op sums whole
    only up to its own ``WHOLE_ROWS_PER_MODE`` N, 2N with AVX2's narrower tiles
    (mojo/pha_gss_scan.mojo): the table covers the widest."""
    C, N = CHUNK, config.dss_state_size
    return min(n_chunks(config) * C, max(C, -(-4 * N // C) * C))


def long_taps(lam: np.ndarray, ct: np.ndarray, rows: int) -> np.ndarray:
    """[rows, H]: K[k, h] = Re(sum_n Ct[h, n] A_n**k) for every lag k < rows (float64)."""
    return (np.exp(np.outer(np.arange(rows), lam)) @ ct.T).real


def gss_tables(config, lam: np.ndarray, ct: np.ndarray) -> dict[str, np.ndarray]:
    """The GSS tensors of one layer, from Lambda [N] and Ct [H, N] (complex128).

    Decode (per flat (h, n) channel [H*N]): abar_re, abar_im, ct_re_flat, ct_im_flat.
    Chunked prefill (C = CHUNK, pairs: [re | im] on the last axis):
      ct_t_re, ct_t_im [N, H]   Ct transposed
      kin     [H, C, C]   K[i - j, h] for j <= i, else 0; K[k, h] = Re(sum_n Ct A**k)
      p_end   [C, 2N]     A**(C-1-j): a chunk's inputs -> its final local state
      p_out   [C, 2N]     (Re, -Im) of A**(j+1): the entering state's share of y at offset j
      p_chunk [K+1, 2N]   A**(C k), k < K = ceil(n / C), then a zero row
      p_step  [C+2, 2N]   A**k, k <= C, then a zero row
    The Mojo op's (mojo/pha_gss_scan.mojo) in the layouts it reads as they are:
      taps    [H, C]      K[k, h] per channel (kin's first column)
      long_taps [LT, H]   K[k, h] for k < LT = ``whole_prompt_rows``
      p_out_t [2N, C]     p_out transposed
      ct_rows [H, 2N]     Ct per channel
    """
    C, H = CHUNK, ct.shape[0]
    powers = np.exp(np.outer(np.arange(C + 1), lam))  # [C+1, N]: A**k
    long = long_taps(lam, ct, whole_prompt_rows(config))  # [LT, H], LT >= C
    K = long[:C]  # [C, H]
    gap = np.arange(C)[:, None] - np.arange(C)[None, :]
    kin = np.where(gap >= 0, K[np.maximum(gap, 0)].transpose(2, 0, 1), 0.0)  # [H, C, C]
    chunk_powers = np.exp(np.outer(np.arange(n_chunks(config)) * C, lam))
    zero = np.zeros((1, 2 * lam.shape[0]))
    p_out = np.concatenate([powers[1:].real, -powers[1:].imag], axis=1)  # [C, 2N]
    abar = np.exp(lam)
    return {
        "abar_re": np.tile(abar.real, H), "abar_im": np.tile(abar.imag, H),
        "ct_re_flat": ct.real.reshape(-1), "ct_im_flat": ct.imag.reshape(-1),
        "ct_t_re": ct.real.T, "ct_t_im": ct.imag.T,
        "kin": kin, "p_end": _pairs(powers[C - 1 :: -1][:C]),
        "p_out": p_out,
        "p_chunk": np.concatenate([_pairs(chunk_powers), zero]),
        "p_step": np.concatenate([_pairs(powers), zero]),
        "taps": K.T, "long_taps": long, "p_out_t": p_out.T,
        "ct_rows": _pairs(ct),
    }


def gss_table_shapes(config) -> dict[str, list[int]]:
    c = config
    H, N, C = c.gss_hidden_dim, c.dss_state_size, CHUNK
    return {"abar_re": [H * N], "abar_im": [H * N], "ct_re_flat": [H * N], "ct_im_flat": [H * N],
            "ct_t_re": [N, H], "ct_t_im": [N, H], "kin": [H, C, C], "p_end": [C, 2 * N],
            "p_out": [C, 2 * N], "p_chunk": [n_chunks(c) + 1, 2 * N], "p_step": [C + 2, 2 * N],
            "taps": [H, C], "long_taps": [whole_prompt_rows(c), H], "p_out_t": [2 * N, C], "ct_rows": [H, 2 * N]}


def _projections(x: TensorValue, g: dict, c, dense_op: Dense = None, keep=lambda t: t):
    """(u = gelu(W_u x) at the rows ``keep`` keeps, the DSS input LN(gelu(W_v x + b_v)));
    ``dense_op``: the products through the linear op (``graphs.ops.linear``)."""
    u = linear(keep(x), g["to_u"], op_device=dense_op, activation="gelu")
    xn = ops.layer_norm(linear(x, g["to_v"], g["to_v_b"], dense_op, activation="gelu"), g["norm_w"], g["norm_b"],
                        epsilon=c.norm_eps)
    return u, xn


def _out(y: TensorValue, u: TensorValue, g: dict, dense_op: Dense = None) -> TensorValue:
    return linear(linear(y, g["to_gate"], op_device=dense_op, times=u), g["to_out"], g["to_out_b"], dense_op)


def _cmul(ar, ai, br, bi):
    """(ar + i ai)(br + i bi) as real pairs."""
    return ar * br - ai * bi, ar * bi + ai * br


def gss_prefill(x: TensorValue, chunk_rows: TensorValue, chunk_cols: TensorValue, lengths: TensorValue,
                g: dict, c, device, scan_op: bool = False, dense_op: Dense = None, kept: Rows = None):
    """x [B, M, C, E] -> (out [B, M, C, E], state [B, 2*H*N] after each sample's last real token).

    chunk_rows, chunk_cols [M] int64: 0 .. M-1, twice (two graph inputs: see prefill.py).
    ``scan_op``: the DSS outputs and states by the Mojo op (``scanned_by_op``, CPU code,
    O(M H N) across the chunks); else the in-chunk Toeplitz product and each chunk's own
    final state as matmuls, the state carried across the chunks by [M, M] decay matmuls per
    mode (``carried_by_matmuls``, O(M**2 H N)) and through the last chunk's tokens by its
    powers of A (``_state_after_last``): the GPU path and the op's reference.
    ``dense_op``: the layers' products through the linear op. ``kept``: out only at the rows
    it keeps ([B, R, E]; ``prefill.pha_layers``' ``out_at``): the state still reads every
    row's DSS input, but u, the gate's product and the output layer run on those rows alone.
    """
    H, N, C = c.gss_hidden_dim, c.dss_state_size, CHUNK
    B, M = x.shape[0], x.shape[1]
    keep = kept or (lambda t: t)
    u, xs = _projections(x, g, c, dense_op, keep)  # xs [B, M, C, H]
    if scan_op:
        y, state = scanned_by_op(xs, lengths, g, c, device)
        return _out(keep(y), u, g, dense_op), state

    # inside each chunk: [H, C, C] @ [H, C, B*M]
    xh = ops.reshape(ops.permute(xs, [3, 2, 0, 1]), [H, C, -1])
    y_in = ops.permute(ops.reshape(ops.matmul(g["kin"], xh), [H, C, B, M]), [2, 3, 1, 0])  # [B, M, C, H]

    # each chunk's own final state [B, M, H, 2N] (real parts, then imaginary parts)
    rows = ops.reshape(ops.permute(xs, [0, 1, 3, 2]), [-1, C])  # [B*M*H, C]
    ends = ops.reshape(ops.matmul(rows, g["p_end"]), [B, M, H, 2 * N])

    last = lengths - 1
    m = floor_div_nonnegative(last, C)  # each sample's last chunk
    j = last - m * C
    y_carry, entering = carried_by_matmuls(ends, chunk_rows, chunk_cols, m, g, c)
    out = _out(keep(y_in + y_carry + xs * g["D"]), u, g, dense_op)
    return out, _state_after_last(entering, xs, m, j, g, c, device)


def _state_after_last(entering: TensorValue, xs: TensorValue, m: TensorValue, j: TensorValue, g: dict, c,
                      device) -> TensorValue:
    """The state after token e - 1 = m C + j [B, 2 H N] (real parts, then imaginary):
    A**(j+1) P_m + sum_{i <= j} A**(j-i) x[mC + i], from the state entering chunk m
    [B, H, 2N] and the DSS inputs xs [B, M, C, H], with the float64 tables' powers."""
    H, N, C = c.gss_hidden_dim, c.dss_state_size, CHUNK
    B = xs.shape[0]
    w = ops.gather(g["p_step"], j + 1, axis=0)  # [B, 2N]: A**(j+1)
    w_re = ops.broadcast_to(ops.reshape(w[:, :N], [B, 1, N]), [B, H, N])
    w_im = ops.broadcast_to(ops.reshape(w[:, N:], [B, 1, N]), [B, H, N])
    c_re, c_im = _cmul(w_re, w_im, entering[:, :, :N], entering[:, :, N:])
    offs = const(np.arange(C, dtype=np.int64).reshape(1, C), I64, device)
    jb = ops.unsqueeze(j, -1)
    inside = ops.cast(offs <= jb, I64)
    index = inside * (jb - offs) + (1 - inside) * (C + 1)  # [B, C]: A**(j-i), or the zero row
    weights = ops.gather(g["p_step"], index, axis=0)  # [B, C, 2N]
    x_last = ops.permute(ops.gather_nd(xs, ops.unsqueeze(m, -1), batch_dims=1), [0, 2, 1])  # [B, H, C]
    local = ops.matmul(x_last, weights)  # [B, H, 2N]
    s_re = ops.reshape(c_re + local[:, :, :N], [B, H * N])
    s_im = ops.reshape(c_im + local[:, :, N:], [B, H * N])
    return ops.concat([s_re, s_im], axis=1)


def carried_by_matmuls(ends: TensorValue, chunk_rows: TensorValue, chunk_cols: TensorValue, m: TensorValue,
                       g: dict, c):
    """ends [B, M, H, 2N], each sample's last chunk m [B] -> (each chunk's carried-in share
    of y [B, M, C, H], the state entering chunk m [B, H, 2N]), with plain ops:
    P_m = sum_{m' < m} A**(C (m-1-m')) S_m' as [N, M, M] matmuls over the modes."""
    H, N, C = c.gss_hidden_dim, c.dss_state_size, CHUNK
    B, M = ends.shape[0], ends.shape[1]
    modes_first = ops.reshape(ops.permute(ends, [3, 1, 0, 2]), [2 * N, M, -1])  # [2N, M, B*H]
    s_re, s_im = modes_first[:N], modes_first[N:]

    # decay[n, m, m'] = A**(C (m-1-m')) for m' < m, else 0 (the zero row of p_chunk)
    ci, cj = ops.unsqueeze(chunk_rows, 1), ops.unsqueeze(chunk_cols, 0)
    before = ops.cast(cj < ci, I64)
    index = before * (ci - cj - 1) + (1 - before) * n_chunks(c)  # [M, M]
    decay = ops.permute(ops.gather(g["p_chunk"], index, axis=0), [2, 0, 1])  # [2N, M, M]
    d_re, d_im = decay[:N], decay[N:]
    p_re = ops.matmul(d_re, s_re) - ops.matmul(d_im, s_im)  # [N, M, B*H]
    p_im = ops.matmul(d_re, s_im) + ops.matmul(d_im, s_re)

    # its share of y: Re(sum_n A**(j+1) (Ct P)_n) = p_out [C, 2N] @ [Re; Im](Ct P)
    def per_mode(t):  # Ct^T [N, H] spread over [N, M, B, H]
        return ops.reshape(ops.broadcast_to(ops.reshape(t, [N, 1, 1, H]), [N, M, B, H]), [N, M, -1])

    q_re, q_im = _cmul(per_mode(g["ct_t_re"]), per_mode(g["ct_t_im"]), p_re, p_im)
    q = ops.reshape(ops.concat([q_re, q_im], axis=0), [2 * N, -1])
    y_carry = ops.permute(ops.reshape(ops.matmul(g["p_out"], q), [C, M, B, H]), [2, 1, 0, 3])  # [B, M, C, H]

    def entering(p):  # [N, M, B*H] -> [B, H, N] at each sample's chunk
        return ops.gather_nd(ops.permute(ops.reshape(p, [N, M, B, H]), [2, 1, 3, 0]), ops.unsqueeze(m, -1),
                             batch_dims=1)

    return y_carry, ops.concat([entering(p_re), entering(p_im)], axis=2)


def scanned_by_op(xs: TensorValue, lengths: TensorValue, g: dict, c, device):
    """The DSS inputs xs [B, M, C, H] -> (the DSS outputs y [B, M, C, H], the state after
    each prompt's last token [B, 2 H N]) by the Mojo op (mojo/pha_gss_scan.mojo: per
    sample and channel, each chunk's own final state and the in-chunk Toeplitz sum from
    the tables, the state entering each chunk by P_{m+1} = A**C P_m + S_m in float64, the
    chunks past each prompt skipped, and the state after the last token from the state
    entering its chunk and the chunk's inputs; prompts padded to no more than the long
    taps' rows summed whole instead): what the matmuls, ``carried_by_matmuls``
    and ``_state_after_last`` compute on the plain path."""
    H, N = c.gss_hidden_dim, c.dss_state_size
    B = xs.shape[0]
    y, state = ops.custom(
        OP_PHA_GSS_SCAN, device=device,
        values=[xs, g["taps"], g["long_taps"], g["D"], g["p_end"], g["p_out_t"], g["p_step"], g["ct_rows"], lengths],
        out_types=[TensorType(F32, xs.shape, device), TensorType(F32, [B, 2, H, N], device)])
    return y.tensor, ops.reshape(state.tensor, [B, 2 * H * N])


def gss_step(x: TensorValue, re: TensorValue, im: TensorValue, g: dict, c, K):
    """x [B, E], the state's real and imaginary parts [B, H*N] -> (out [B, E], new re, new im).

    s = A s + x (complex, as real pairs over flat (h, n) channels);
    y = Re(Ct . s) + D x, the sum over n by ``K.group_sum``, the spread by ``K.spread``.
    """
    H, N = c.gss_hidden_dim, c.dss_state_size
    u, xn = _projections(x, g, c)  # xn [B, H]
    re2, im2 = _cmul(g["abar_re"], g["abar_im"], re, im)
    re2 = re2 + K.spread(xn, H, N)
    y = K.group_sum(re2 * g["ct_re_flat"] - im2 * g["ct_im_flat"], H, N) + xn * g["D"]
    return _out(y, u, g), re2, im2
