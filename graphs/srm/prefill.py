"""Prefill graph: the parallel form over a batch of right-padded prompts.

Inputs (B = batch, N = number of chunks, C = ``CHUNK``; B and N symbolic):
    ids          [B, N, C] int64   right-padded token ids, reshaped into chunks
    pos          [N, C]    int64   the token's index in this call, 0 .. N*C-1 (same layout)
    last         [B, 2]    int64   (chunk, offset) of each prompt's last real token
    start        [B]       int64   tokens each sample has already read (0: a fresh prompt)
    init         [L, B, H, hd] f32 the state after those tokens (zeros for a fresh prompt)
    score_at     [B, R] int64      positions to score (0 .. N*C-1; R symbolic: 1 in a prefill)
    targets      [B, R] int64      the token whose log-probability is wanted at each
Outputs:
    logits       [B, V] f32        at each prompt's last real token (the engine draws the
                                   first new token from them with the sample graph)
    states       [L, B, H, hd] f32 recurrent state after the last real token
    target_logprobs [B, R] f32, target_top_values [B, R, K] f32, target_top_ids [B, R, K]
                 int64: at each scored position, log_softmax(logits)[target] and the K
                 likeliest tokens (``graphs/scoring.py``): a score call reads these

Token t of sample b sits at the absolute position start[b] + t: the mixer's
per-position weights w, beta are read there, so a prompt continued from a state
computes what the whole prompt would.

The token mixer runs as a chunked scan, O(T * C + (T / C)**2) per channel:
dense decay matrices inside each chunk (exponents < C), and a (T/C) x (T/C)
matrix of decays lam**(C*(n-1-m)) <= 1 carrying each chunk's final local
state into every later chunk; the initial state enters every chunk n as one
more carry, decayed by lam**(C*n). No negative powers of lam anywhere, so
nothing overflows; long-range decays underflow harmlessly to 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from .. import ops as gops
from ..op_names import OP_SCAN
from ..ops import F32, I64, Dense, PackedWeights
from ..scoring import rows_logprobs, score_input_types
from .blocks import SRMWeights, channel_mlp, embed, logits_of

# where the decode op's packed copy of each matrix lies, by the matrix's weight name:
# (the packed weight's name, its shape, the copy's offset in it flattened)
PackedCopies = Mapping[str, tuple[str, list[int], int]]

# Mixer chunk length of the prefill scan. lam >= 0.9, so lam**(C-1) >= 0.9**31 ~ 0.04:
# no under- or overflow inside a chunk; between chunks decay only shrinks.
CHUNK = 32


def absolute_positions(pos: TensorValue, start: TensorValue, config) -> TensorValue:
    """[B, N, C]: start[b] + pos, clamped to n - 1 (padding can run past the context)."""
    apos = ops.unsqueeze(ops.unsqueeze(start, -1), -1) + ops.unsqueeze(pos, 0)
    return gops.clamp_max(apos, config.context_length - 1)


def _mixer_parallel(u: TensorValue, pos: TensorValue, apos: TensorValue, init: TensorValue, p: dict, config,
                    device: DeviceRef) -> tuple[TensorValue, TensorValue]:
    """u [B, N, C, d], pos [N, C], absolute positions apos [B, N, C], initial state
    init [B, H, hd] -> (y [B, N, C, d], states [B, N, C, H, hd])."""
    H, hd, C = config.n_heads, config.head_dim, CHUNK
    B, N = u.shape[0], u.shape[1]
    # Per-head vectors expanded per channel [.., d]: see decode._mixer_step.
    heads = gops.HeadKinds(H, hd, device)
    wt = gops.per_channel(ops.gather(p["w"], apos, axis=0), H, hd, device)  # [B, N, C, d]
    bt = gops.per_channel(ops.gather(p["beta"], apos, axis=0), H, hd, device)
    v = ops.reshape(u * heads.one_on_columns(wt), [B, N, C, H, hd])  # what enters the state
    loglam = p["loglam"]  # [H]

    # Inside a chunk: within[h, j, i] = lam_h**(j - i) for j >= i.
    k = np.arange(C)
    gap = (k.reshape(C, 1) - k.reshape(1, C)).astype(np.float32)
    causal = gops.const((gap >= 0).astype(np.float32).reshape(1, C, C), F32, device)
    gapc = gops.const(np.maximum(gap, 0).reshape(1, C, C), F32, device)
    lam3 = ops.reshape(loglam, [H, 1, 1])
    within = ops.exp(gapc * lam3) * causal  # [H, C, C]
    # Everything below is rank-3 matmuls in a [H, rows, X] layout (X = B*N*hd): MAX
    # batched matmul is rank <= 4, and elementwise ops that broadcast size-1 axes
    # against reshaped matmul results were miscompiled (see decode._mixer_step).
    X = ops.reshape(ops.permute(v, [3, 2, 0, 1, 4]), [H, C, -1])  # [H, C(i), B*N*hd]
    local = ops.matmul(within, X)  # [H, C(j), B*N*hd]

    # Between chunks: carry[n] = sum_{m < n} lam**(C (n-1-m)) S_m + lam**(C n) init,
    # S_m = chunk m's last local state (init: the state before chunk 0's first token).
    S = ops.reshape(local[:, C - 1, :], [H, B, N, hd])
    S = ops.reshape(ops.permute(S, [0, 2, 1, 3]), [H, N, -1])  # [H, N(m), B*hd]
    cidx = ops.cast(gops.floor_div_nonnegative(pos[:, 0], C), F32)  # [N]
    ci = ops.reshape(cidx, [N, 1])
    cj = ops.reshape(cidx, [1, N])
    before = ops.cast(ci > cj, F32)  # [N, N]: 1 where m < n
    expo = gops.floor_at(ci - cj - 1.0, 0.0) * float(C)
    dc = ops.exp(ops.unsqueeze(expo, 0) * lam3) * ops.unsqueeze(before, 0)  # [H, N, N]
    d0 = ops.exp(ops.unsqueeze(ci * float(C), 0) * lam3)  # [H, N, 1]: lam**(C n)
    s0 = ops.reshape(ops.permute(init, [1, 0, 2]), [H, 1, -1])  # [H, 1, B*hd]
    carry = ops.matmul(dc, S) + ops.matmul(d0, s0)  # [H, N(n), B*hd] (outer product as a matmul)
    carry = ops.reshape(carry, [H, N, B, hd])
    carry = ops.reshape(ops.permute(carry, [0, 2, 1, 3]), [H, 1, -1])  # [H, 1, B*N*hd]
    pw = ops.exp(ops.reshape(gops.const((k + 1).astype(np.float32), F32, device), [1, C, 1])
                 * lam3)  # [H, C, 1]: lam**(j+1)
    states = local + ops.matmul(pw, carry)  # [H, C, B*N*hd]
    states = ops.permute(ops.reshape(states, [H, C, B, N, hd]), [2, 3, 1, 0, 4])  # [B, N, C, H, hd]

    flat = ops.reshape(states, [B, N, C, H * hd])
    y = flat * heads.one_on_rows(wt) + bt
    return y, states


def _mixer_scan_kernel(u: TensorValue, last: TensorValue, start: TensorValue, init: TensorValue, p: dict, config,
                       device: DeviceRef) -> tuple[TensorValue, TensorValue]:
    """The Mojo scan op (mojo/mixer_scan.mojo): u [B, N, C, d] -> (y [B, N, C, d],
    state after each prompt's last token [B, H, hd]); O(T) per channel, sequential in t.
    The op reads w, beta at start[b] + t itself (clamped to the context)."""
    H, hd, C = config.n_heads, config.head_dim, CHUNK
    B, N = u.shape[0], u.shape[1]
    u4 = ops.reshape(u, [B, -1, H, hd])  # [B, T, H, hd], T = N * C
    lengths = last[:, 0] * C + last[:, 1] + 1  # [B]
    y, final = ops.custom(
        OP_SCAN, device=device,
        values=[u4, lengths, start, init, ops.transpose(p["w"], 0, 1), ops.transpose(p["beta"], 0, 1),
                ops.exp(p["loglam"])],
        out_types=[TensorType(F32, u4.shape, device), TensorType(F32, [B, H, hd], device)])
    return ops.reshape(y.tensor, [B, N, C, H * hd]), final.tensor


def srm_layers(W: SRMWeights, ids: TensorValue, pos: TensorValue, last: TensorValue, start: TensorValue,
               init: TensorValue, device: DeviceRef, kernels: bool,
               dense_op: Dense = None) -> tuple[TensorValue, TensorValue]:
    """Every layer over right-padded prompts (the inputs of the module docs) ->
    (x [B, N, C, d] after the last layer, states [L, B, H, hd] after each prompt's last
    token). With ``kernels`` the mixer runs as the Mojo scan op, else as the chunked scan;
    ``dense_op``: how the dense layers run (``gops.linear``)."""
    c = W.config
    apos = None if kernels else absolute_positions(pos, start, c)
    x = embed(W, ids)  # [B, N, C, d]
    states = []
    for l in range(c.n_layers):
        p = W.layer(l)
        x = channel_mlp(x, p, c.layer_norm_eps, dense_op)
        z = ops.layer_norm(x, p["tn_w"], p["tn_b"], epsilon=c.layer_norm_eps)
        u = gops.linear(z, p["proj_w"], p["proj_b"], dense_op)
        if kernels:  # st: the state after each prompt's last token [B, H, hd]
            y, st = _mixer_scan_kernel(u, last, start, init[l], p, c, device)
        else:  # st: the state after every position, of which the last token's is kept
            y, st = _mixer_parallel(u, pos, apos, init[l], p, c, device)
            st = ops.gather_nd(st, last, batch_dims=1)
        x = x + gops.linear(y, p["out_w"], p["out_b"], dense_op)
        states.append(st)
    return x, ops.stack(states, axis=0)


def prefix_input_types(config, device: DeviceRef) -> list[TensorType]:
    """The prefill graph's first inputs: ids, pos, last, start, init (module docs)."""
    c, C = config, CHUNK
    return [
        TensorType(I64, ["batch", "chunks", C], device),  # ids
        TensorType(I64, ["chunks", C], device),  # pos
        TensorType(I64, ["batch", 2], device),  # last
        TensorType(I64, ["batch"], device),  # start
        TensorType(F32, [c.n_layers, "batch", c.n_heads, c.head_dim], device),  # init
    ]


def packed_weights(W: SRMWeights, packed: PackedCopies, device: DeviceRef) -> PackedWeights:
    """The decode op's packed copies (in the weights' dtype) as the dense layers' weights:
    each packed weight taken flat, each matrix at its offset in it."""
    flat: dict[str, TensorValue] = {}
    at = {}
    for matrix, (name, shape, offset) in packed.items():
        if name not in flat:
            flat[name] = ops.reshape(W.matrix(name, shape), [-1])
        at[matrix] = (flat[name], offset)
    return PackedWeights(at, device)


def build_prefill_graph(config, schema, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                        name: str | None = None, kernel_library: Path | None = None,
                        packed: PackedCopies | None = None) -> Graph:
    """``schema`` names the weights (``srm_max.models.srm.schema``); with ``kernel_library``
    (the Mojo package) the mixer runs as its scan op instead of the chunked scan, and on a
    CPU the Mojo ops compute and reduce the scored positions' logits and run the dense
    layers: on the decode op's packed copies of the matrices with ``packed`` (the graph
    then binds those weights too), else through the linear op that packs per call."""
    device = device or DeviceRef.CPU()
    kernels = kernel_library is not None
    cpu_ops = gops.cpu_ops_run(kernels, device)
    if packed is not None and not cpu_ops:
        raise ValueError("packed weights are for a prefill with the Mojo ops on a CPU")
    c = config
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    name = name or f"srm_prefill_{dt}" + ("_kernels" if kernels else "")
    input_types = prefix_input_types(c, device) + score_input_types(device)
    extensions = [kernel_library] if kernels else []
    with Graph(name, input_types=input_types, custom_extensions=extensions) as g:
        ids, pos, last, start, init, score_at, targets = (v.tensor for v in g.inputs)
        W = SRMWeights(c, schema, wdtype, device)
        row_op = device if cpu_ops else None  # the Mojo ops are CPU code
        copies = packed_weights(W, packed, device) if packed is not None else None
        dense_op = copies if copies is not None else row_op
        x, states = srm_layers(W, ids, pos, last, start, init, device, kernels, dense_op)
        xl = ops.gather_nd(x, last, batch_dims=1)  # [B, d]
        g.output(logits_of(W, xl, dense_op), states, *rows_logprobs(x, score_at, W.output(), targets, row_op, copies))
    return g
