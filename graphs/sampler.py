"""Per-sample sampling inside a graph: greedy, temperature, top-k and top-p.

Mirrored exactly in numpy by ``srm_max.serve.sampling`` (the tests' oracle)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from .ops import F32, I64, U64, const, cpu_ops_run, floor_at
from .scoring import token_logprobs, top_width

# Counter-based randomness: every sample's noise is a function of (its seed,
# the position of the token being drawn, the rank of the candidate), so a
# sample's tokens depend on nothing else in the batch. The generator is
# Widynski's "Squares" counter-based RNG (arXiv 2004.06278), written with
# wrapping uint64 multiply/add and 32-bit rotations as floor division +
# multiplication (MAX has no bitwise ops). The tests' numpy mirror
# (tests/support/sampler_mirror.py) draws exactly the same, and the whole-step op
# (mojo/row_sampler.mojo) keeps a copy of the keys that a test holds equal to these.
SQUARES_KEYS = (0xC8E4FD154CE32F6D, 0x9B2D67A3E8F15C47)  # the two keys of a seed's 64-bit key
_2_32 = 1 << 32


def _u64(v, device: DeviceRef) -> TensorValue:
    return ops.constant(v, U64, device=device)


def _rot32(x: TensorValue, device: DeviceRef) -> TensorValue:
    return ops.floor_div(x, _u64(_2_32, device)) + x * _u64(_2_32, device)


def _squares(ctr: TensorValue, key: TensorValue, device: DeviceRef, bits: int = 32) -> TensorValue:
    """The top ``bits`` of Squares' 32 random bits (in a uint64) per (counter, key),
    shifted down in one division: MAX folds a division of a quotient by a constant into
    one division by the constants' product, which it computes in a compiled subgraph of
    its own (seconds of every compile)."""
    x = ctr * key
    y = x
    z = y + key
    x = _rot32(x * x + y, device)
    x = _rot32(x * x + z, device)
    x = _rot32(x * x + y, device)
    return ops.floor_div(x * x + z, _u64(1 << (64 - bits), device))


def _key_of(seed: TensorValue, device: DeviceRef) -> TensorValue:
    k0, k1 = SQUARES_KEYS
    k = _squares(seed, _u64(k0, device), device) * _u64(_2_32, device) + _squares(seed, _u64(k1, device), device)
    return ops.floor_div(k, _u64(2, device)) * _u64(2, device) + _u64(1, device)  # odd


def hash_uniform(seed: TensorValue, counter: TensorValue, n: int, device: DeviceRef) -> TensorValue:
    """[B] uint64 seed, [B] int64 counter -> [B, n] float32 uniforms in (0, 1)."""
    key = ops.unsqueeze(_key_of(seed, device), -1)  # [B, 1]
    r = const(np.arange(n, dtype=np.uint64).reshape(1, n), U64, device)
    ctr = ops.unsqueeze(ops.cast(counter, U64) * _u64(n, device), -1) + r  # [B, n]
    top = ops.cast(_squares(ctr, key, device, bits=24), F32)
    return (top + 0.5) * (1.0 / (1 << 24))


# Sampling modes, chosen per call on the host from the batch's parameters: each
# mode runs only the work it needs, and a sample draws the same token in every
# mode that serves it (the draw below does not depend on the mode).
MODE_GREEDY, MODE_PLAIN, MODE_FILTERED = 0, 1, 2


def sample(logits: TensorValue, temperature: TensorValue, top_k: TensorValue,
           top_p: TensorValue, seed: TensorValue, counter: TensorValue, mode: TensorValue,
           device: DeviceRef) -> TensorValue:
    """Per-sample sampling in the graph: logits [B, V] -> ids [B] int64.

    temperature [B] f32 (0 = greedy), top_k [B] int64 (0 = off, as is any k >= V), top_p [B] f32
    (1 = off), seed [B] uint64, counter [B] int64 (position of the new token),
    mode [] int64 on the host (``MODE_*``: all greedy / no filters / filters).
    Order as in HF: temperature, then top-k, then top-p on the renormalised rest.
    The draw is the inverse CDF in token-id order with ONE uniform per sample, so
    no sort is needed unless a filter is on (a full sort of [B, V] and V random
    numbers per sample would cost more than the rest of a decode step).
    """
    B = logits.shape[0]
    host = DeviceRef.CPU()

    def is_mode(m: int) -> TensorValue:
        return ops.equal(mode, ops.constant(m, I64, device=host))

    # Two conds one after the other (MAX 26.7 fails to verify a cond nested in a cond).
    no_threshold = ops.broadcast_to(ops.constant(-3.0e38, F32, device=device), [B])
    threshold = ops.cond(
        is_mode(MODE_FILTERED), [TensorType(F32, [B], device)],
        lambda: _threshold(logits, temperature, top_k, top_p, device), lambda: no_threshold)[0]
    return ops.cond(
        is_mode(MODE_GREEDY), [TensorType(I64, [B], device)],
        lambda: ops.squeeze(ops.argmax(logits, axis=-1), -1),
        lambda: _draw(logits, temperature, threshold, seed, counter, device))[0]


def _scaled(logits: TensorValue, temperature: TensorValue) -> TensorValue:
    return logits / ops.unsqueeze(floor_at(temperature, 1e-6), -1)


def _draw(logits, temperature, threshold, seed, counter, device):
    """Inverse CDF over the tokens with scaled logit >= threshold [B]."""
    V = int(logits.shape[-1])
    scaled = _scaled(logits, temperature)
    weight = ops.exp(scaled - ops.max(scaled, axis=-1))  # unnormalised probabilities
    weight = weight * ops.cast(scaled >= ops.unsqueeze(threshold, -1), F32)
    cdf = ops.cumsum(weight, axis=-1)
    target = hash_uniform(seed, counter, 1, device) * cdf[:, V - 1 :]  # [B, 1]
    below = ops.sum(ops.cast(cdf <= target, I64), axis=-1)  # index of the first cdf > target
    # Rounding can put target at the total: fall back to the last token with weight.
    rank = const(np.arange(V, dtype=np.int64).reshape(1, V), I64, device)
    last = ops.max(ops.cast(weight > 0.0, I64) * rank, axis=-1)
    drawn = ops.squeeze(ops.min(below, last), -1)
    g = ops.cast(temperature <= 0, I64)
    return g * ops.squeeze(ops.argmax(logits, axis=-1), -1) + (1 - g) * drawn


def _threshold(logits, temperature, top_k, top_p, device) -> TensorValue:
    """[B] f32: the smallest scaled logit top-k then top-p keep (-3e38: no filter).

    With w = exp(s - max s) on the scaled logits s: the top-k set is the k largest (k = V
    when off or past V; of the tokens tied with the k-th largest value, the first in token-id
    order); total = the sum of w over the top-k set in token-id order; over the k largest
    values in descending order, before = the sum of w before each one; top-p keeps those
    with before < p * total (the first always). Ties with the last kept value are kept
    too (as in HF's top-k). Sums are MAX's cumsum: float64 accumulation in index order,
    rounded to float32, which the whole-step op (mojo/row_sampler.mojo) repeats bit for
    bit; a float32 ops.sum adds in the kernel's own order (SIMD lanes, then a tree). The
    total is summed in token-id order so that the op need not sort the row to find it.
    """
    scaled = _scaled(logits, temperature)
    V = int(scaled.shape[-1])
    vals, _ = ops.top_k(scaled, k=V, axis=-1)  # descending
    rank = const(np.arange(V, dtype=np.int64).reshape(1, V), I64, device)
    # k off (0) or of V or more: every token (a k past V would index past the row)
    k_eff = ops.min(top_k, ops.constant(V, I64, device=device))
    k_eff = k_eff + ops.cast(k_eff <= 0, I64) * V
    keep = ops.cast(rank < ops.unsqueeze(k_eff, -1), F32)
    w = ops.exp(vals - vals[:, :1]) * keep
    before = ops.cumsum(w, axis=-1, exclusive=True)
    total = _top_k_total(scaled, vals, k_eff, device)
    keep = keep * ops.cast(before < ops.unsqueeze(top_p, -1) * total, F32)
    m = ops.cast(ops.sum(keep, axis=-1), I64)  # >= 1: the first has nothing before it
    threshold = ops.gather_nd(vals, m - 1, batch_dims=1)  # [B]
    off = ops.cast(ops.logical_and(top_k <= 0, top_p >= 1.0), F32)
    return threshold * (1.0 - off) + off * -3.0e38


def _top_k_total(scaled, vals, k_eff, device) -> TensorValue:
    """[B, 1]: the sum of w over the top-k set in token-id order (the inclusive cumsum's
    last value): the tokens above the k-th value, and the first of those equal to it
    that make k. Counts are float32 sums of ones: exact."""
    V = int(scaled.shape[-1])
    kth = ops.unsqueeze(ops.gather_nd(vals, ops.unsqueeze(k_eff - 1, -1), batch_dims=1), -1)  # [B, 1]
    above = ops.cast(scaled > kth, F32)
    tie = ops.cast(scaled == kth, F32)
    ties_in = ops.unsqueeze(ops.cast(k_eff, F32), -1) - ops.sum(above, axis=-1)  # [B, 1]
    member = above + tie * ops.cast(ops.cumsum(tie, axis=-1) <= ties_in, F32)
    w = ops.exp(scaled - vals[:, :1]) * member
    return ops.cumsum(w, axis=-1)[:, V - 1 :]


# The sample graph reads logits and no weights, so it is one graph for every architecture
# with the same vocabulary: one name and one salt of its cache key (``compile_cache.graph_key``),
# the sampler's, so that an SRM and a PHA engine share one compiled graph.
SAMPLE_GRAPH_NAME = "sample"
# The plain-op sampler's name: a compile unit finds its graphs by name, so with a name of
# its own it compiles in one unit with the Mojo-op sampler (one compile's fixed cost less).
PLAIN_SAMPLE_GRAPH_NAME = "sample_plain"
SAMPLE_GRAPH_SALT = b"sample-graph-v1"  # bumped when a compiled sample graph must not be reused


def build_sample_graph(vocab_size: int, device: DeviceRef, kernel_library: Path | None = None) -> Graph:
    """Draw tokens from prefill logits: each prompt's first token after its prefill, and the
    samples of one prompt forked from a single prefill; and, asked for, their
    log-probabilities (with ``kernel_library`` on a CPU through the Mojo row op).

    Inputs: logits [P, V] f32 (one row per prefilled prompt), rows [N] int64 (each
    sample's row), temperature / top_k / top_p / seed [N], mode [] (host), counter [N]
    int64 (the position of the token to draw), scored [] int64 (host: 1 for the
    log-probabilities below, 0 for zeros at no cost). Outputs: ids [N] int64: for every
    sample the token ``sample`` draws from its row with its parameters (what the decode
    graphs draw at a step); its raw log-probability [N] f32 (log_softmax of the logits, no
    temperature or filters) and the K most likely tokens' [N, K] f32 with their ids [N,
    K] int64 (``scoring.token_logprobs``, K = ``scoring.top_width(V)``).
    """
    host = DeviceRef.CPU()
    input_types = [
        TensorType(F32, ["prompts", vocab_size], device),
        TensorType(I64, ["samples"], device),
        TensorType(F32, ["samples"], device),
        TensorType(I64, ["samples"], device),
        TensorType(F32, ["samples"], device),
        TensorType(U64, ["samples"], device),
        TensorType(I64, [], host),
        TensorType(I64, ["samples"], device),
        TensorType(I64, [], host),
    ]
    row_op = device if cpu_ops_run(kernel_library is not None, device) else None  # the row op is CPU code
    with Graph(SAMPLE_GRAPH_NAME if row_op is not None else PLAIN_SAMPLE_GRAPH_NAME, input_types=input_types,
               custom_extensions=[kernel_library] if row_op is not None else []) as g:
        logits, rows, temperature, top_k, top_p, seed, mode, counter, scored = (v.tensor for v in g.inputs)
        picked = ops.gather(logits, rows, axis=0)
        ids = sample(picked, temperature, top_k, top_p, seed, counter, mode, device)
        g.output(ids, *drawn_logprobs(picked, ids, scored, device, row_op))
    return g


def drawn_logprobs(logits: TensorValue, ids: TensorValue, scored: TensorValue, device: DeviceRef,
                   row_op_device: DeviceRef | None = None) -> list[TensorValue]:
    """The log-probabilities of tokens just drawn, asked for at run time: logits [N, V],
    ids [N] int64, scored [] int64 on the host. With ``scored`` 1: each token's raw
    log-probability [N] f32 (log_softmax of the logits, no temperature or filters) and the
    K likeliest tokens' [N, K] f32 with their ids [N, K] int64 (``scoring.token_logprobs``,
    K = ``scoring.top_width(V)``; ``row_op_device``: through the Mojo row op); with 0,
    zeros at no cost. So one compiled graph serves calls with and without them."""
    host = DeviceRef.CPU()
    N, K = ids.shape[0], top_width(int(logits.shape[-1]))
    types = [TensorType(F32, [N], device), TensorType(F32, [N, K], device), TensorType(I64, [N, K], device)]

    def unscored():
        return [ops.broadcast_to(ops.constant(0, t.dtype, device=device), t.shape) for t in types]

    return ops.cond(ops.equal(scored, ops.constant(1, I64, device=host)), types,
                    lambda: list(token_logprobs(logits, ids, row_op_device)), unscored)
