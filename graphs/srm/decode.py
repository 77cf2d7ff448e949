"""Decode graph: S recurrent steps for a batch inside one ``execute``.

Inputs (B and S symbolic):
    ids          [B]            int64  the current tokens
    positions    [B]            int64  their absolute positions
    states       [L, B, H, hd]  f32    recurrent state before ``ids``
    temperature  [B] f32, top_k [B] int64, top_p [B] f32, seed [B] uint64
    mode         []             int64  on the host: ``sampler.MODE_*`` for this batch
    steps        [S]            int64  0 .. S-1 (its length is the step count)
    n_steps      []             int64  S, on the host (the loop predicate)
    scored       []             int64  on the host: 1 for the log-probabilities below, 0 for zeros
Outputs:
    tokens       [B, S]         int64  the S new tokens per sample
    states       [L, B, H, hd]  f32    state after feeding the last new token but one
                                       (i.e. ready to take ``tokens[:, -1]`` next)
    ids          [B]            int64  = tokens[:, -1]
    positions    [B]            int64  = positions + S
    logprobs     [B, S]         f32    each new token's raw log-probability (log_softmax of the
                                       logits, no temperature or filters)
    top values   [B, S, K]      f32    the K = ``scoring.top_width(V)`` likeliest tokens' at each
    top ids      [B, S, K]      int64  step, and their ids (``sampler.drawn_logprobs``)

With the Mojo kernels on a CPU the whole step (every layer and the logits) is one
op, ``step_fused`` (mojo/decode_step.mojo), at every batch size; and the engine
runs ``build_decode_steps_graph`` instead: all S steps in one op, the tokens
chosen (greedy or drawn) inside it, no graph loop (each of whose iterations
costs a sizeable part of a batch-1 step).

The new token drawn after reading position p has position p + 1: that is its
random counter, so a sample's tokens depend only on its seed, prompt and
parameters. Positions past the context are clamped (the host discards those
tokens; a sequence never really goes past n).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from .. import ops as gops
from ..loop import build_multistep_decode_graph
from ..op_names import OP_DECODE_STEP, OP_DECODE_STEPS, OP_STEP_FUNCTIONAL
from ..ops import F32, I64, U64, cpu_ops_run
from .blocks import SRMWeights, channel_mlp, embed, logits_of


def _mixer_step(u: TensorValue, pos: TensorValue, state: TensorValue, p: dict, config,
                device: DeviceRef):
    """u [B, d], pos [B] (clamped), state [B, H, hd] -> (y [B, d], new state [B, H, hd]).

    Per-head vectors are gathered out per channel ([.., d]), so nothing broadcasts a
    size-1 head axis and no small one-hot matmul runs inside the decode loop: MAX 26.7
    miscompiled the first pattern on the CPU, and the second crashes its AVX2 code
    (docs/avx2_crash.md).
    """
    H, hd = config.n_heads, config.head_dim
    d = H * hd
    B = u.shape[0]
    heads = gops.HeadKinds(H, hd, device)
    wt = gops.per_channel(ops.gather(p["w"], pos, axis=0), H, hd, device)  # [B, d]
    bt = gops.per_channel(ops.gather(p["beta"], pos, axis=0), H, hd, device)
    lam = gops.per_channel(ops.exp(p["loglam"]), H, hd, device)  # [d]
    s = ops.reshape(state, [B, d])
    new = u * heads.one_on_columns(wt) + lam * s
    y = new * heads.one_on_rows(wt) + bt
    return y, ops.reshape(new, [B, H, hd])


def _mixer_step_kernel(u: TensorValue, pos: TensorValue, state: TensorValue, p: dict, config,
                       device: DeviceRef):
    """The same update as ``_mixer_step`` as one Mojo custom op (mojo/mixer_step.mojo):
    the state is read and written once, y comes out of the same pass."""
    H, hd = config.n_heads, config.head_dim
    B = u.shape[0]
    head_type = TensorType(F32, [B, H, hd], device)
    y, new = ops.custom(
        OP_STEP_FUNCTIONAL, device=device,
        values=[state, ops.reshape(u, [B, H, hd]), pos, ops.transpose(p["w"], 0, 1),
                ops.transpose(p["beta"], 0, 1), ops.exp(p["loglam"])],
        out_types=[head_type, head_type])
    return ops.reshape(y.tensor, [B, H * hd]), new.tensor


def step(W: SRMWeights, config, ids: TensorValue, pos: TensorValue, states: TensorValue,
         device: DeviceRef, kernels: bool = False):
    """One token for the whole batch: -> (logits [B, V], new states [L, B, H, hd])."""
    c = config
    posc = gops.clamp_max(pos, c.context_length - 1)
    x = embed(W, ids)  # [B, d]
    new_states = []
    for l in range(c.n_layers):
        p = W.layer(l)
        x = channel_mlp(x, p, c.layer_norm_eps)
        z = ops.layer_norm(x, p["tn_w"], p["tn_b"], epsilon=c.layer_norm_eps)
        u = gops.linear(z, p["proj_w"], p["proj_b"])
        y, st = (_mixer_step_kernel if kernels else _mixer_step)(u, posc, states[l], p, c, device)
        new_states.append(st)
        x = x + gops.linear(y, p["out_w"], p["out_b"])
    return logits_of(W, x), ops.stack(new_states, axis=0)


def _op_inputs(W: SRMWeights, config, packed: list, ids, pos, states, device: DeviceRef) -> list:
    """The inputs both decode ops of mojo/decode_step.mojo start with; ``packed``: the
    (name, shape, big matrix?) of the op's packed weights in its argument order
    (``srm_max.models.srm.packing.packed_inputs``)."""
    eps = gops.const(np.array([config.layer_norm_eps], np.float32), F32, device)
    weights = [W.matrix(name, shape) if matrix else W.get(name, shape) for name, shape, matrix in packed]
    return [ids, W.embedding(), states, pos, *weights, eps]


def step_fused(W: SRMWeights, config, packed: list, ids: TensorValue, pos: TensorValue, states: TensorValue,
               device: DeviceRef):
    """``step`` as one Mojo op (mojo/decode_step.mojo): every layer and the logits,
    on weights packed at load time (``srm_max.models.srm.packing``). CPU."""
    c = config
    B = ids.shape[0]
    # the op gathers the embedding rows and clamps the positions itself: fewer ops a step
    logits, new_states, _, _ = ops.custom(
        OP_DECODE_STEP, device=device, values=_op_inputs(W, c, packed, ids, pos, states, device),
        out_types=[TensorType(F32, [B, c.vocab_size], device), TensorType(F32, states.shape, device),
                   TensorType(F32, [B, c.ffn_dim + 3 * c.d_model], device), TensorType(I64, [B], device)])
    return logits.tensor, new_states.tensor


def build_decode_steps_graph(config, schema, packed: list, kernel_library: Path, wdtype: DType = DType.float32,
                              name: str | None = None) -> Graph:
    """S steps as ONE op (mojo/decode_step.mojo ``srm_decode_steps``), CPU: each token
    the first argmax in ``sampler.MODE_GREEDY``, else drawn in the op as ``sampler.sample``
    draws it.

    Inputs: ids [B], positions [B], states, temperature / top_k / top_p / seed [B],
    mode [] (host), steps [S] (its length is the step count): ``build_decode_graph``'s
    without n_steps; then scored [] (host: 1 to compute the log-probabilities below, 0
    to leave them unwritten at no cost) and top [N] (its length is the number of
    alternatives, 0 to ``scoring.TOP_N``). Outputs as that graph's: tokens [B, S],
    states, ids = tokens[:, -1], positions + S; then each new token's raw
    log-probability [B, S] (log_softmax of the logits, no temperature or filters) and
    the N most likely tokens at each step, log-probabilities [B, S, N] and ids [B, S, N]
    (descending, ties by lower id). The same tokens and states as single steps of
    ``srm_decode_step``, each followed by graphs/sampler.py's draw, in every mode
    (tests/models/srm/test_engine.py, tests/models/srm/test_sampled_decode.py)."""
    device = DeviceRef.CPU()
    c = config
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    state_type = TensorType(F32, [c.n_layers, "batch", c.n_heads, c.head_dim], device)
    input_types = [TensorType(I64, ["batch"], device), TensorType(I64, ["batch"], device), state_type,
                   TensorType(F32, ["batch"], device), TensorType(I64, ["batch"], device),
                   TensorType(F32, ["batch"], device), TensorType(U64, ["batch"], device),
                   TensorType(I64, [], DeviceRef.CPU()), TensorType(I64, ["steps"], device),
                   TensorType(I64, [], DeviceRef.CPU()), TensorType(I64, ["top"], device)]
    with Graph(name or f"srm_decode_steps_{dt}_kernels", input_types=input_types,
               custom_extensions=[kernel_library]) as g:
        ids, pos, states, temperature, top_k, top_p, seed, mode, steps, scored, top = (v.tensor for v in g.inputs)
        W = SRMWeights(c, schema, wdtype, device)
        B, S, N = ids.shape[0], steps.shape[0], top.shape[0]
        tokens, new_states, last, next_pos, _, logprobs, top_values, top_ids = ops.custom(
            OP_DECODE_STEPS, device=device,
            values=[*_op_inputs(W, c, packed, ids, pos, states, device), steps, temperature, top_k, top_p, seed,
                    ops.reshape(mode, [1]), ops.reshape(scored, [1])],
            out_types=[TensorType(I64, [B, S], device), TensorType(F32, states.shape, device),
                       TensorType(I64, [B], device), TensorType(I64, [B], device),
                       TensorType(F32, [B, c.ffn_dim + 3 * c.d_model + c.vocab_size], device),
                       TensorType(F32, [B, S], device), TensorType(F32, [B, S, N], device),
                       TensorType(I64, [B, S, N], device)])
        g.output(tokens.tensor, new_states.tensor, last.tensor, next_pos.tensor, logprobs.tensor, top_values.tensor,
                 top_ids.tensor)
    return g


def build_decode_graph(config, schema, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                       name: str | None = None, kernel_library: Path | None = None, packed: list | None = None
                       ) -> Graph:
    """With ``kernel_library`` (the Mojo package) the mixer update is its custom op instead
    of plain ops, and on a CPU with ``packed`` (see ``_op_inputs``) the whole step is the
    one op of ``step_fused``."""
    kernels = kernel_library is not None
    device = device or DeviceRef.CPU()
    c = config
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    name = name or f"srm_decode_{dt}" + ("_kernels" if kernels else "")
    state_type = TensorType(F32, [c.n_layers, "batch", c.n_heads, c.head_dim], device)
    whole_step = packed is not None and cpu_ops_run(kernels, device)

    def make_step():
        W = SRMWeights(c, schema, wdtype, device)
        if whole_step:
            return lambda ids, pos, states: step_fused(W, c, packed, ids, pos, states, device)
        return lambda ids, pos, states: step(W, c, ids, pos, states, device, kernels)

    return build_multistep_decode_graph(name, state_type, make_step, c.vocab_size, device,
                                        [kernel_library] if kernels else [])
