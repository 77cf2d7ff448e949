"""Decode graph: S recurrent steps for a batch inside one ``execute``.

Inputs (B and S symbolic):
    ids          [B]            int64  the current tokens
    positions    [B]            int64  their absolute positions
    states       [L, B, H, hd]  f32    recurrent state before ``ids``
    temperature  [B] f32, top_k [B] int64, top_p [B] f32, seed [B] uint64
    steps        [S]            int64  0 .. S-1 (its length is the step count)
    n_steps      []             int64  S, on the host (the loop predicate)
Outputs:
    tokens       [B, S]         int64  the S new tokens per sample
    states       [L, B, H, hd]  f32    state after feeding the last new token but one
                                       (i.e. ready to take ``tokens[:, -1]`` next)
    ids          [B]            int64  = tokens[:, -1]
    positions    [B]            int64  = positions + S

The new token drawn after reading position p has position p + 1: that is its
random counter, so a sample's tokens depend only on its seed, prompt and
parameters. Positions past the context are clamped (the host discards those
tokens; a sequence never really goes past n).
"""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from . import layers
from .layers import F32, I64, U64, ModelWeights


def _mixer_step(u: TensorValue, pos: TensorValue, state: TensorValue, p: dict, config,
                device: DeviceRef):
    """u [B, d], pos [B] (clamped), state [B, H, hd] -> (y [B, d], new state)."""
    H, hd = config.n_heads, config.head_dim
    B = u.shape[0]
    u = ops.reshape(u, [B, H, hd])
    is_col = layers.column_mask(H, device)
    wt = ops.unsqueeze(ops.gather(p["w"], pos, axis=0), -1)  # [B, H, 1]
    bt = ops.unsqueeze(ops.gather(p["beta"], pos, axis=0), -1)
    lam = ops.reshape(ops.exp(p["loglam"]), [H, 1])
    new = u * layers.select_heads(is_col, 1.0, wt) + lam * state
    y = new * layers.select_heads(is_col, wt, 1.0) + bt
    return ops.reshape(y, [B, H * hd]), new


def step(W: ModelWeights, config, ids: TensorValue, pos: TensorValue, states: TensorValue,
         device: DeviceRef):
    """One token for the whole batch: -> (logits [B, V], new states [L, B, H, hd])."""
    c = config
    posc = ops.min(pos, ops.constant(c.context_length - 1, I64, device=device))
    x = layers.embed(W, ids)  # [B, d]
    new_states = []
    for l in range(c.n_layers):
        p = W.layer(l)
        x = layers.channel_mlp(x, p, c.layer_norm_eps)
        z = ops.layer_norm(x, p["tn_w"], p["tn_b"], epsilon=c.layer_norm_eps)
        u = layers.linear(z, p["proj_w"], p["proj_b"])
        y, st = _mixer_step(u, posc, states[l], p, c, device)
        new_states.append(st)
        x = x + layers.linear(y, p["out_w"], p["out_b"])
    return layers.logits_of(W, x), ops.stack(new_states, axis=0)


def build_decode_graph(config, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                       name: str | None = None) -> Graph:
    device = device or DeviceRef.CPU()
    host = DeviceRef.CPU()
    c = config
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    name = name or f"srm_decode_{dt}"
    state_shape = [c.n_layers, "batch", c.n_heads, c.head_dim]
    input_types = [
        TensorType(I64, ["batch"], device),  # ids
        TensorType(I64, ["batch"], device),  # positions
        TensorType(F32, state_shape, device),  # states
        TensorType(F32, ["batch"], device),  # temperature
        TensorType(I64, ["batch"], device),  # top_k
        TensorType(F32, ["batch"], device),  # top_p
        TensorType(U64, ["batch"], device),  # seed
        TensorType(I64, ["steps"], device),  # steps iota
        TensorType(I64, [], host),  # n_steps
    ]
    with Graph(name, input_types=input_types) as g:
        ids, pos, states, temperature, top_k, top_p, seed, steps, n_steps = (v.tensor for v in g.inputs)
        W = ModelWeights(c, wdtype, device)
        acc0 = ops.broadcast_to(ops.unsqueeze(ops.constant(0, I64, device=device), 0),
                                [ids.shape[0], steps.shape[0]])
        acc0 = acc0 + ops.unsqueeze(ids * 0, -1)  # [B, S] zeros
        i_host = ops.constant(0, I64, device=host)
        i_dev = ops.constant(0, I64, device=device)

        def pred(ih, idv, t, p, s, acc):
            return ih < n_steps

        def body(ih, idv, t, p, s, acc):
            logits, s = step(W, c, t, p, s, device)
            nxt = layers.sample(logits, temperature, top_k, top_p, seed, p + 1, device)
            hit = ops.cast(ops.equal(ops.unsqueeze(steps, 0), idv), I64)  # [1, S] one-hot
            acc = acc + hit * ops.unsqueeze(nxt, -1)  # each slot written once
            return ih + 1, idv + 1, nxt, p + 1, s, acc

        _, _, last, pos_out, s_out, toks = ops.while_loop(
            [i_host, i_dev, ids, pos, states, acc0], pred, body)
        g.output(toks, s_out, last, pos_out)
    return g
