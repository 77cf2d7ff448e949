"""Graph pieces shared by the prefill and decode graphs (plain MAX ops).

Weights are named ``max.graph.Weight`` objects bound at load time, so one
compiled graph serves every checkpoint of the same shape. Names are the
checkpoint's keys, plus a few tensors derived on the host at load time (see
``derived_weights``): the stacked head projection and the mixer vectors laid
out per position.

Precision: the residual stream, layer norms, the mixer and its state are
float32. ``wdtype`` (float32 or bfloat16) is the dtype of the big matrices
(embedding, channel MLP, projections, output layer); with bfloat16 the
matmul inputs are cast to bfloat16 and the results back to float32.
"""

from __future__ import annotations

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops

F32 = DType.float32
I64 = DType.int64
U64 = DType.uint64

# Mixer chunk length of the prefill scan. lam >= 0.9, so lam**(C-1) >= 0.9**31 ~ 0.04:
# no under- or overflow inside a chunk; between chunks decay only shrinks.
CHUNK = 32


def derived_name(layer: int, what: str) -> str:
    return f"mixer_blocks.{layer}.token_mixing_layer.{what}"


class NamedWeights:
    """A graph's named weights for one config (created once per graph): each name
    becomes one ``Weight``; the big matrices take ``wdtype``."""

    def __init__(self, config, wdtype: DType, device: DeviceRef):
        self.config = config
        self.wdtype = wdtype
        self.device = device
        self._cache: dict[str, Weight] = {}

    def get(self, name: str, shape, dtype: DType = F32) -> Weight:
        if name not in self._cache:
            self._cache[name] = Weight(name, dtype, list(shape), self.device)
        return self._cache[name]

    def matrix(self, name: str, shape) -> Weight:
        return self.get(name, shape, self.wdtype)


class ModelWeights(NamedWeights):
    """The SRM graph's named weights."""

    def layer(self, l: int) -> dict[str, Weight]:
        c = self.config
        d, f, n, H = c.d_model, c.ffn_dim, c.context_length, c.n_heads
        p = f"mixer_blocks.{l}."
        return {
            "cn_w": self.get(p + "channel_norm.weight", [d]),
            "cn_b": self.get(p + "channel_norm.bias", [d]),
            "fc1_w": self.matrix(p + "channel_mixing_layer.0.weight", [f, d]),
            "fc1_b": self.get(p + "channel_mixing_layer.0.bias", [f]),
            "fc2_w": self.matrix(p + "channel_mixing_layer.2.weight", [d, f]),
            "fc2_b": self.get(p + "channel_mixing_layer.2.bias", [d]),
            "tn_w": self.get(p + "token_norm.weight", [d]),
            "tn_b": self.get(p + "token_norm.bias", [d]),
            "proj_w": self.matrix(derived_name(l, "proj.weight"), [d, d]),
            "proj_b": self.get(derived_name(l, "proj.bias"), [d]),
            "out_w": self.matrix(p + "token_mixing_layer.out_proj.weight", [d, d]),
            "out_b": self.get(p + "token_mixing_layer.out_proj.bias", [d]),
            "w": self.get(derived_name(l, "mixer.w"), [n, H]),
            "beta": self.get(derived_name(l, "mixer.beta"), [n, H]),
            "loglam": self.get(derived_name(l, "mixer.loglam"), [H]),
        }

    def embedding(self) -> Weight:
        c = self.config
        return self.matrix("input_layer.weight", [c.vocab_size, c.d_model])

    def output(self) -> Weight:
        c = self.config
        return self.matrix("output_layer.weight", [c.vocab_size, c.d_model])


def derived_weights(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host-side tensors computed from the checkpoint at load time (float32).

    proj.weight [d, d]: the H head projections stacked (torch layout, out x in);
    mixer.w / mixer.beta [n, H]: per-position vectors, one column per head;
    mixer.loglam [H]: log(clip(decay, 0.9, 1) ** (1 / c)) (0 without decay).
    """
    c = config
    out = {}
    for l in range(c.n_layers):
        p = f"mixer_blocks.{l}.token_mixing_layer."
        heads = range(c.n_heads)
        out[derived_name(l, "proj.weight")] = np.concatenate(
            [weights[f"{p}proj_head.{h}.weight"] for h in heads], 0)
        out[derived_name(l, "proj.bias")] = np.concatenate(
            [weights[f"{p}proj_head.{h}.bias"] for h in heads], 0)
        out[derived_name(l, "mixer.w")] = np.stack(
            [weights[f"{p}mixer_heads.{h}.weight"].reshape(-1) for h in heads], 1)
        out[derived_name(l, "mixer.beta")] = np.stack(
            [weights[f"{p}mixer_heads.{h}.bias"].reshape(-1) for h in heads], 1)
        if c.decay:
            decay = np.array([float(weights[f"{p}mixer_heads.{h}.decay_value"].reshape(-1)[0]) for h in heads])
            lam = np.clip(decay, 0.9, 1.0) ** (1.0 / c.decay_constant)
            loglam = np.log(lam)
        else:
            loglam = np.zeros(c.n_heads)
        out[derived_name(l, "mixer.loglam")] = loglam
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def graph_weight_names(config) -> list[str]:
    """Every checkpoint key a graph reads (derived ones excluded)."""
    names = ["input_layer.weight", "output_layer.weight"]
    for l in range(config.n_layers):
        p = f"mixer_blocks.{l}."
        for k in ("channel_norm.weight", "channel_norm.bias", "channel_mixing_layer.0.weight",
                  "channel_mixing_layer.0.bias", "channel_mixing_layer.2.weight",
                  "channel_mixing_layer.2.bias", "token_norm.weight", "token_norm.bias",
                  "token_mixing_layer.out_proj.weight", "token_mixing_layer.out_proj.bias"):
            names.append(p + k)
    return names


def linear(x: TensorValue, w: TensorValue, b: TensorValue | None = None) -> TensorValue:
    """x [..., in] @ w[out, in]^T + b, computed in w's dtype, returned as float32."""
    h = x if x.dtype == w.dtype else ops.cast(x, w.dtype)
    y = ops.matmul(h, ops.transpose(w, 0, 1))
    if y.dtype != F32:
        y = ops.cast(y, F32)
    return y if b is None else y + b


def embed(weights: ModelWeights, ids: TensorValue) -> TensorValue:
    x = ops.gather(weights.embedding(), ids, axis=0)
    return x if x.dtype == F32 else ops.cast(x, F32)


def channel_mlp(x: TensorValue, p: dict, eps: float) -> TensorValue:
    """x + W2 silu(W1 LN_c(x) + b1) + b2."""
    h = ops.layer_norm(x, p["cn_w"], p["cn_b"], epsilon=eps)
    h = ops.silu(linear(h, p["fc1_w"], p["fc1_b"]))
    return x + linear(h, p["fc2_w"], p["fc2_b"])


_KEEPALIVE: list[np.ndarray] = []


def const(array: np.ndarray, dtype: DType, device: DeviceRef) -> TensorValue:
    """A numpy array as a graph constant (kept referenced, as a precaution).

    While chasing a miscompile (see ``decode._mixer_step``) constant lifetime was
    suspected; it was not the cause (the MLIR embeds the values), but keeping
    the arrays costs nothing.
    """
    array = np.ascontiguousarray(array)
    _KEEPALIVE.append(array)
    return ops.constant(array, dtype, device=device)


def column_mask(n_heads: int, device: DeviceRef) -> TensorValue:
    """[H, 1] float32: 1 for column-repeat heads (the first half), 0 for row heads.

    Used by multiplication (``select_heads``), not ``ops.where``.
    """
    m = (np.arange(n_heads) < n_heads // 2).astype(np.float32).reshape(n_heads, 1)
    return const(m, F32, device)


def clamp_max(x: TensorValue, hi: int) -> TensorValue:
    """min(x, hi) for an int64 tensor, by arithmetic (see ``floor_at``)."""
    over = ops.cast(x > hi, x.dtype)
    return x - over * (x - hi)


def floor_at(x: TensorValue, lo: float) -> TensorValue:
    """max(x, lo) for a float tensor, by arithmetic.

    (Written out instead of the two-argument ``ops.max`` while chasing the
    miscompile of ``decode._mixer_step``; ``ops.max`` was not shown to be at fault.)
    """
    under = ops.cast(x < lo, x.dtype)
    return x + under * (lo - x)


def head_expander(n_heads: int, head_dim: int, device: DeviceRef) -> TensorValue:
    """[H, d] one-hot: x[..., H] @ E -> the per-head value repeated over its channels.

    Outside loops only: inside ``ops.while_loop`` such a small matmul crashes MAX 26.7's
    AVX2 code (docs/avx2_crash.md); loop bodies use ``per_channel``.
    """
    e = np.repeat(np.eye(n_heads, dtype=np.float32), head_dim, axis=1)
    return const(e, F32, device)


def per_channel(x: TensorValue, n_groups: int, width: int, device: DeviceRef) -> TensorValue:
    """x [..., G] -> [..., G * width]: each group's value repeated over its channels (a gather
    along the last axis; no matmul, no broadcast of a size-1 axis)."""
    index = const(np.repeat(np.arange(n_groups, dtype=np.int64), width), I64, device)
    return ops.gather(x, index, axis=x.rank - 1)


def channel_column_mask(n_heads: int, head_dim: int, device: DeviceRef) -> TensorValue:
    """[d] float32: 1 on the channels of column-repeat heads, 0 on row heads."""
    m = np.repeat((np.arange(n_heads) < n_heads // 2).astype(np.float32), head_dim)
    return const(m, F32, device)


def select_heads(col: TensorValue, on_column: TensorValue, on_row: TensorValue) -> TensorValue:
    """col * on_column + (1 - col) * on_row (col: the 0/1 column_mask)."""
    return col * on_column + (1.0 - col) * on_row


def logits_of(weights: ModelWeights, x: TensorValue) -> TensorValue:
    return linear(x, weights.output())


# --------------------------------------------------------------------- sampling
# Counter-based randomness: every sample's noise is a function of (its seed,
# the position of the token being drawn, the rank of the candidate), so a
# sample's tokens depend on nothing else in the batch. The generator is
# Widynski's "Squares" counter-based RNG (arXiv 2004.06278), written with
# wrapping uint64 multiply/add and 32-bit rotations as floor division +
# multiplication (MAX has no bitwise ops). ``sampling.uniform_np`` mirrors it
# exactly in numpy.
_K0 = 0xC8E4FD154CE32F6D
_K1 = 0x9B2D67A3E8F15C47
_2_32 = 1 << 32


def _u64(v, device: DeviceRef) -> TensorValue:
    return ops.constant(v, U64, device=device)


def _rot32(x: TensorValue, device: DeviceRef) -> TensorValue:
    return ops.floor_div(x, _u64(_2_32, device)) + x * _u64(_2_32, device)


def _squares(ctr: TensorValue, key: TensorValue, device: DeviceRef) -> TensorValue:
    """32 random bits (in a uint64) per (counter, key)."""
    x = ctr * key
    y = x
    z = y + key
    x = _rot32(x * x + y, device)
    x = _rot32(x * x + z, device)
    x = _rot32(x * x + y, device)
    return ops.floor_div(x * x + z, _u64(_2_32, device))


def _key_of(seed: TensorValue, device: DeviceRef) -> TensorValue:
    k = _squares(seed, _u64(_K0, device), device) * _u64(_2_32, device) + _squares(seed, _u64(_K1, device), device)
    return ops.floor_div(k, _u64(2, device)) * _u64(2, device) + _u64(1, device)  # odd


def hash_uniform(seed: TensorValue, counter: TensorValue, n: int, device: DeviceRef) -> TensorValue:
    """[B] uint64 seed, [B] int64 counter -> [B, n] float32 uniforms in (0, 1)."""
    key = ops.unsqueeze(_key_of(seed, device), -1)  # [B, 1]
    r = const(np.arange(n, dtype=np.uint64).reshape(1, n), U64, device)
    ctr = ops.unsqueeze(ops.cast(counter, U64) * _u64(n, device), -1) + r  # [B, n]
    bits = _squares(ctr, key, device)
    top = ops.cast(ops.floor_div(bits, _u64(256, device)), F32)  # 24 bits
    return (top + 0.5) * (1.0 / (1 << 24))


# Sampling modes, chosen per call on the host from the batch's parameters: each
# mode runs only the work it needs, and a sample draws the same token in every
# mode that serves it (the draw below does not depend on the mode).
MODE_GREEDY, MODE_PLAIN, MODE_FILTERED = 0, 1, 2


def sample(logits: TensorValue, temperature: TensorValue, top_k: TensorValue,
           top_p: TensorValue, seed: TensorValue, counter: TensorValue, mode: TensorValue,
           device: DeviceRef) -> TensorValue:
    """Per-sample sampling in the graph: logits [B, V] -> ids [B] int64.

    temperature [B] f32 (0 = greedy), top_k [B] int64 (0 = off), top_p [B] f32
    (1 = off), seed [B] uint64, counter [B] int64 (position of the new token),
    mode [] int64 on the host (``MODE_*``: all greedy / no filters / filters).
    Order as in HF: temperature, then top-k, then top-p on the renormalised rest.
    The draw is the inverse CDF in token-id order with ONE uniform per sample, so
    no sort is needed unless a filter is on (a full sort of [B, V] and V random
    numbers per sample were most of a decode step at batch 64).
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

    top-k keeps the k largest, top-p the smallest prefix (in descending order) of
    those whose mass before it is < p; ties with the last kept value are kept too
    (as in HF's top-k).
    """
    scaled = _scaled(logits, temperature)
    V = int(scaled.shape[-1])
    vals, _ = ops.top_k(scaled, k=V, axis=-1)  # descending
    rank = const(np.arange(V, dtype=np.int64).reshape(1, V), I64, device)
    k_eff = top_k + ops.cast(top_k <= 0, I64) * V
    keep = ops.cast(rank < ops.unsqueeze(k_eff, -1), F32)
    w = ops.exp(vals - vals[:, :1]) * keep
    before = ops.cumsum(w, axis=-1, exclusive=True)
    total = ops.sum(w, axis=-1)
    keep = keep * ops.cast(before < ops.unsqueeze(top_p, -1) * total, F32)
    m = ops.cast(ops.sum(keep, axis=-1), I64)  # >= 1: the first has nothing before it
    threshold = ops.gather_nd(vals, m - 1, batch_dims=1)  # [B]
    off = ops.cast(ops.logical_and(top_k <= 0, top_p >= 1.0), F32)
    return threshold * (1.0 - off) + off * -3.0e38


# --------------------------------------------------------------------- decode loop
def build_multistep_decode_graph(name: str, state_type: TensorType, make_step, device: DeviceRef,
                                 custom_extensions=()) -> Graph:
    """S decode steps for a batch in one ``execute`` (B and S symbolic), any model.

    Inputs: ids [B], positions [B], states (``state_type``), temperature / top_k /
    top_p / seed [B], mode [] (host), steps [S] (0 .. S-1), n_steps [] (host).
    Outputs: tokens [B, S], states, ids = tokens[:, -1], positions + S.
    ``make_step()`` is called inside the graph and returns ``step(ids, pos, states)
    -> (logits [B, V], new states)``. The token drawn after reading position p has
    position p + 1: that is its random counter.
    """
    host = DeviceRef.CPU()
    input_types = [
        TensorType(I64, ["batch"], device),  # ids
        TensorType(I64, ["batch"], device),  # positions
        state_type,  # states
        TensorType(F32, ["batch"], device),  # temperature
        TensorType(I64, ["batch"], device),  # top_k
        TensorType(F32, ["batch"], device),  # top_p
        TensorType(U64, ["batch"], device),  # seed
        TensorType(I64, [], host),  # sampling mode
        TensorType(I64, ["steps"], device),  # steps iota
        TensorType(I64, [], host),  # n_steps
    ]
    with Graph(name, input_types=input_types, custom_extensions=list(custom_extensions)) as g:
        ids, pos, states, temperature, top_k, top_p, seed, mode, steps, n_steps = (
            v.tensor for v in g.inputs)
        step = make_step()
        acc0 = ops.broadcast_to(ops.unsqueeze(ops.constant(0, I64, device=device), 0),
                                [ids.shape[0], steps.shape[0]])
        acc0 = acc0 + ops.unsqueeze(ids * 0, -1)  # [B, S] zeros
        i_host = ops.constant(0, I64, device=host)
        i_dev = ops.constant(0, I64, device=device)

        # The sampling inputs ride along unchanged: a cond inside the loop body may
        # only use values of the body (MAX 26.7 rejects graph inputs captured there).
        def pred(ih, idv, t, p, s, acc, *sampling):
            return ih < n_steps

        def body(ih, idv, t, p, s, acc, temp, k, top, sd):
            logits, s = step(t, p, s)
            nxt = sample(logits, temp, k, top, sd, p + 1, mode, device)
            hit = ops.cast(ops.equal(ops.unsqueeze(steps, 0), idv), I64)  # [1, S] one-hot
            acc = acc + hit * ops.unsqueeze(nxt, -1)  # each slot written once
            return ih + 1, idv + 1, nxt, p + 1, s, acc, temp, k, top, sd

        _, _, last, pos_out, s_out, toks, *_ = ops.while_loop(
            [i_host, i_dev, ids, pos, states, acc0, temperature, top_k, top_p, seed], pred, body)
        g.output(toks, s_out, last, pos_out)
    return g
