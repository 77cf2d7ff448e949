"""Per-position log-probabilities on the device, shared by every architecture's prefill graph.

Scoring outputs, per position, the log-probability of a given target token and the
``TOP_N`` most likely tokens with their log-probabilities: [.., TOP_N] values and ids
instead of [.., V] logits, so only a few numbers per position cross to the host. The
host keeps the first n <= TOP_N of them (``runtime.compiled.ScoreResult``).

Every architecture's prefill graph scores: it takes the positions to score and their
targets (``score_input_types``) and calls ``rows_logprobs`` on the last layer's output, so
one compiled graph serves a prefill (one dummy row per sample) and a score call (every
position). Three ways to the same numbers: on a CPU with the kernel library, where the
engine holds the output layer's packed copy for its decode op (graphs/ops.py
``PackedWeights``), one Mojo op ``srm_score_head`` (mojo/score_head.mojo) computes the
output layer from that copy for a block of positions into a cache-resident tile and
reduces it there, so the [.., V] logits never go to memory; on such a CPU without the
copy, the dense-layer op ``srm_linear`` (mojo/linear.mojo) and then the Mojo op
``srm_score_rows`` (mojo/score_rows.mojo), which reduces each row of logits in two passes
(the K largest by a lane-wise bound, then the sum of exponentials), rows split between
the cores; elsewhere MAX's ops: max, the shifted sum of exponentials, gather and
``ops.top_k``. The row op exists because ``ops.top_k`` sorts each row: at V = 4,096
that alone cost more than the whole prefill of the same tokens on a 2-core CPU
(bench/scoring.py).
"""

from __future__ import annotations

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, TensorType, TensorValue, ops

from .op_names import OP_SCORE_HEAD, OP_SCORE_ROWS
from .ops import PackedWeights, const, linear, rounded_to_weights, rows_at

# The most alternatives a caller may ask for per position (OpenAI's top_logprobs limit).
TOP_N = 20


def top_width(vocab_size: int) -> int:
    """The alternatives scored rows return: TOP_N, or the whole vocabulary if smaller."""
    return min(TOP_N, vocab_size)


def head_logprobs(x: TensorValue, head: TensorValue, targets: TensorValue, row_op_device: DeviceRef | None = None,
                  packed: PackedWeights | None = None) -> tuple[TensorValue, TensorValue, TensorValue]:
    """``token_logprobs`` of the logits ``linear(x, head)``: x [..., d] f32 the last layer's
    output, head [V, d] the output layer (a named weight). With ``row_op_device`` (a CPU
    device; the graph loads the kernel library) and the head's packed copy among
    ``packed``, the fused Mojo op computes and reduces the logits block by block from that
    copy; otherwise the graph computes all [..., V] logits first (on such a CPU through the
    dense-layer op, ``linear``)."""
    copy = packed.copy_of(head) if packed is not None else None
    if row_op_device is None or copy is None:
        return token_logprobs(linear(x, head, op_device=row_op_device), targets, row_op_device)
    V, d = int(head.shape[0]), int(head.shape[1])
    mats, offset = copy
    rows = rounded_to_weights(ops.reshape(x, [-1, d]), head.dtype)
    head_at = const(np.array([offset, V], np.int64), DType.int64, row_op_device)
    return _reduced(OP_SCORE_HEAD, [rows, mats, head_at], rows.shape[0], V, targets, row_op_device)


def token_logprobs(logits: TensorValue, targets: TensorValue,
                   row_op_device: DeviceRef | None = None) -> tuple[TensorValue, TensorValue, TensorValue]:
    """logits [..., V] f32, targets [...] int64 -> (log-probability of each target [...],
    top values [..., K] (descending), top ids [..., K] int64); K = ``top_width(V)``.

    log_softmax of the raw logits (no temperature): logits - logsumexp, with the
    logsumexp shifted by the row's maximum so that nothing overflows. With
    ``row_op_device`` (a CPU device; the graph must load the kernel library) the Mojo op
    does it, else the graph's ops.
    """
    if row_op_device is not None:
        return _by_row_op(logits, targets, row_op_device)
    V = int(logits.shape[-1])
    top = ops.max(logits, axis=-1)  # [..., 1]
    lse = ops.log(ops.sum(ops.exp(logits - top), axis=-1)) + top  # [..., 1]
    picked = ops.gather_nd(logits, ops.unsqueeze(targets, -1), batch_dims=targets.rank)  # [...]
    values, ids = ops.top_k(logits, k=top_width(V), axis=-1)
    return picked - ops.squeeze(lse, -1), values - lse, ids


def _by_row_op(logits: TensorValue, targets: TensorValue,
               device: DeviceRef) -> tuple[TensorValue, TensorValue, TensorValue]:
    """``token_logprobs`` through ``srm_score_rows`` on the logits as rows [R, V]."""
    V = int(logits.shape[-1])
    rows = ops.reshape(logits, [-1, V])
    return _reduced(OP_SCORE_ROWS, [rows], rows.shape[0], V, targets, device)


def _reduced(op: str, values: list[TensorValue], R, V: int, targets: TensorValue,
             device: DeviceRef) -> tuple[TensorValue, TensorValue, TensorValue]:
    """One of the Mojo ops that give [R] log-probabilities and [R, K] top values and ids,
    called on ``values`` and the targets as [R], shaped back as the targets."""
    K = top_width(V)
    picked, top_values, ids = ops.custom(
        op, device=device, values=[*values, ops.reshape(targets, [-1])],
        out_types=[TensorType(DType.float32, [R], device), TensorType(DType.float32, [R, K], device),
                   TensorType(DType.int64, [R, K], device)])
    shape = list(targets.shape)
    return (ops.reshape(picked.tensor, shape), ops.reshape(top_values.tensor, shape + [K]),
            ops.reshape(ids.tensor, shape + [K]))


def score_input_types(device: DeviceRef) -> list[TensorType]:
    """The prefill graphs' last two inputs: score_at [B, R] int64, the positions to score
    (each sample's token index in the call, 0 .. T-1), and targets [B, R] int64, the token
    whose log-probability is wanted at each (R symbolic: 1 for a plain prefill)."""
    return [TensorType(DType.int64, ["batch", "scored"], device), TensorType(DType.int64, ["batch", "scored"], device)]


def rows_logprobs(x: TensorValue, score_at: TensorValue, head: TensorValue, targets: TensorValue,
                  row_op_device: DeviceRef | None = None,
                  packed: PackedWeights | None = None) -> tuple[TensorValue, TensorValue, TensorValue]:
    """``head_logprobs`` at the positions ``score_at`` [B, R] of x [B, ..., d] (the last
    layer's output, its positions in order between the first and last axis) -> [B, R],
    [B, R, K], [B, R, K]."""
    return head_logprobs(rows_at(x, score_at), head, targets, row_op_device, packed)
