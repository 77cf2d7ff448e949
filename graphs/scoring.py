"""Per-position log-probabilities on the device, shared by every architecture's score graph.

Scoring outputs, per position, the log-probability of a given target token and the
``TOP_N`` most likely tokens with their log-probabilities: [.., TOP_N] values and ids
instead of [.., V] logits, so only a few numbers per position cross to the host. The
host keeps the first n <= TOP_N of them (``runtime.compiled.ScoreResult``).
"""

from __future__ import annotations

from max.graph import TensorValue, ops

# The most alternatives a caller may ask for per position (OpenAI's top_logprobs limit).
TOP_N = 20


def top_width(vocab_size: int) -> int:
    """The alternatives a score graph returns: TOP_N, or the whole vocabulary if smaller."""
    return min(TOP_N, vocab_size)


def token_logprobs(logits: TensorValue, targets: TensorValue) -> tuple[TensorValue, TensorValue, TensorValue]:
    """logits [..., V] f32, targets [...] int64 -> (log-probability of each target [...],
    top values [..., K] (descending), top ids [..., K] int64); K = ``top_width(V)``.

    log_softmax of the raw logits (no temperature): logits - logsumexp, with the
    logsumexp shifted by the row's maximum so that nothing overflows.
    """
    V = int(logits.shape[-1])
    top = ops.max(logits, axis=-1)  # [..., 1]
    lse = ops.log(ops.sum(ops.exp(logits - top), axis=-1)) + top  # [..., 1]
    picked = ops.gather_nd(logits, ops.unsqueeze(targets, -1), batch_dims=targets.rank)  # [...]
    values, ids = ops.top_k(logits, k=top_width(V), axis=-1)
    return picked - ops.squeeze(lse, -1), values - lse, ids
