"""The PHA prefill graph: right-padded prompts in chunks of ``gss.CHUNK`` tokens.

The positions come in twice (``pos``, ``pos_cols``): with one vector on both sides,
``pos[:, None] - pos[None, :]`` and ``pos[None, :] > pos[:, None]`` came out of a
compiled graph as all zeros / all False (depending on what they fused with), although
a small graph of just those ops computes them right. Built from two distinct inputs,
both are right (tests/models/pha/test_pha_engine.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from ..ops import F32, I64, Dense, KeptRows, PackedWeights, cpu_ops_run, floor_div_nonnegative, linear
from ..scoring import head_logprobs, score_input_types
from .attention import attn_prefill
from .gss import CHUNK, gss_prefill
from .model import PHAWeights, PrefillStates, _Consts, _block, _embed, _ffn


def prefix_input_types(device: DeviceRef) -> list[TensorType]:
    """The prefill graph's first inputs: ids, pos, pos_cols, lengths (see below)."""
    C = CHUNK
    return [
        TensorType(I64, ["batch", "chunks", C], device),  # ids
        TensorType(I64, ["chunks", C], device),  # pos
        TensorType(I64, ["chunks", C], device),  # pos_cols: pos again (see the module docs)
        TensorType(I64, ["batch"], device),  # lengths
    ]


def dense_op_device(wdtype: DType, tiled: bool, device: DeviceRef) -> DeviceRef | None:
    """Where a prefill's dense layers run through the linear op (``graphs.ops.linear``;
    None: MAX's matmul) when the graph reads no packed copies of them: with bfloat16 weights
    in a graph with the Mojo ops, where MAX's bfloat16 matmul on a CPU is far slower than
    the op's float32 product over the widened weights. With float32 weights the matmul
    stays: the op packs each weight on every call, which costs the PHA's prefill more than
    its product saves (docs/pha_engine.md); the packed-weight op does not."""
    return device if tiled and wdtype == DType.bfloat16 else None


def pha_layers(W: PHAWeights, ids: TensorValue, pos: TensorValue, pos_cols: TensorValue, lengths: TensorValue,
               device: DeviceRef, tiled: bool = False, dense_op: Dense = None,
               out_at: TensorValue | None = None) -> tuple[TensorValue, TensorValue]:
    """Every layer over right-padded prompts -> (x after the last block, every layer's state
    [L, B, X] after each prompt's last token). x is [B, M, C, E], or with ``out_at`` [B, R]
    (positions 0 .. T-1) [B, R, E] at those positions alone: the last block computes only what
    its state and those rows need (``model._block``'s ``kept``), as a prefill that wants the
    last token's logits and a few scored rows needs (in a model of L blocks, most of a
    1/L share of the prefill's products). ``tiled``: the attention and the GSS's scan across
    chunks are the Mojo ops (``attention.attn_prefill``, ``gss.gss_prefill``; the graph needs
    the kernel library); ``dense_op``: the dense layers through the linear op
    (``dense_op_device``) or the packed-weight one."""
    c, C = W.config, CHUNK
    K = _Consts(c, device)
    B, M = ids.shape[0], ids.shape[1]
    chunk_rows, chunk_cols = floor_div_nonnegative(pos[:, 0], C), floor_div_nonnegative(pos_cols[:, 0], C)
    flat_pos, flat_cols = ops.reshape(pos, [-1]), ops.reshape(pos_cols, [-1])
    layer_state = PrefillStates(c, flat_pos, B, device, by_op=tiled)
    # the attention op's query positions where a block keeps every row: one tensor for all blocks
    every_position = ops.broadcast_to(ops.unsqueeze(flat_pos, 0), [B, flat_pos.shape[0]]) if tiled else None
    x = _embed(W, ids)  # [B, M, C, E]
    E = x.shape[-1]
    found_by_layer = []
    for l in range(c.n_layers):
        found: dict = {}

        def run(name, h, kept, l=l, found=found):
            if name == "gss":
                out, found["gss"] = gss_prefill(h, chunk_rows, chunk_cols, lengths, W.gss(l), c, device, tiled,
                                                dense_op, kept)
            elif name == "attn":
                out, found["attn"] = attn_prefill(ops.reshape(h, [B, -1, E]), flat_pos, flat_cols, lengths,
                                                  W.attn(l), c, K, tiled, dense_op, kept,
                                                  kept.at if kept else every_position)
                out = out if kept else ops.reshape(out, [B, M, C, E])
            else:
                out = _ffn(h, W.ffn(l, int(name.removeprefix("ffn_"))), dense_op)
            return out

        last_block = l == c.n_layers - 1
        kept = KeptRows(out_at) if last_block and out_at is not None else None
        x = _block(x, l, W, run, kept)
        found_by_layer.append(found)
    return x, layer_state.stacked(found_by_layer)


def build_pha_prefill_graph(config, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                            name: str | None = None, kernel_library: Path | None = None,
                            packed: Mapping[str, int] | None = None) -> Graph:
    """Prefill of right-padded prompts (B and the number of chunks M symbolic; T = M C).
    With ``kernel_library`` on a CPU the attention is the tiled Mojo op
    (mojo/pha_prefill_attention.mojo), the GSS state crosses the chunks by the scan op
    (mojo/pha_gss_scan.mojo), the Mojo ops compute and reduce the scored positions'
    logits, and the dense layers are the linear op on packed copies of the weights (in
    their dtype) with ``packed`` (each weight's offset in them, by name: the graph then
    takes the copies as its last input), or without them with bfloat16 weights the linear
    op on the weights (``dense_op_device``); else plain ops with a [T, T] score matrix and an [M, M]
    decay matrix per mode.

    Inputs:  ids [B, M, C] int64, pos [M, C] and pos_cols [M, C] int64 (both 0 .. T-1),
             lengths [B] int64, score_at [B, R] int64 positions to score (0 .. T-1; R
             symbolic: 1 in a prefill) and targets [B, R] int64 the token to score at each;
             with ``packed``, the packed copies [S] in the weights' dtype (graphs/ops.py
             ``PackedWeights``).
    Outputs: logits [B, V] at each prompt's last token (the engine draws the first new
             token from them with the sample graph), states [L, B, X], then at each
             scored position log_softmax(logits)[target] [B, R] and the K likeliest
             tokens' values [B, R, K] and ids [B, R, K] (``graphs/scoring.py``). The last block
             runs its output rows only at those positions (``pha_layers``' ``out_at``).
    """
    device = device or DeviceRef.CPU()
    c = config
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    tiled = cpu_ops_run(kernel_library is not None, device)  # the op is CPU code
    if packed is not None and not tiled:
        raise ValueError("packed weights are for a prefill with the Mojo ops on a CPU")
    input_types = prefix_input_types(device) + score_input_types(device)
    if packed is not None:
        input_types.append(TensorType(wdtype, ["packed"], device))
    with Graph(name or f"pha_prefill_{dt}" + ("_kernels" if tiled else ""), input_types=input_types,
               custom_extensions=[kernel_library] if tiled else []) as g:
        ids, pos, pos_cols, lengths, score_at, targets, *mats = (v.tensor for v in g.inputs)
        W = PHAWeights(c, wdtype, device)
        copies = PackedWeights.in_one_array(mats[0], packed, device) if mats else None
        dense_op = copies if copies is not None else dense_op_device(wdtype, tiled, device)
        # the last block's output only at each prompt's last token (its logits) and the scored rows
        out_at = ops.concat([ops.unsqueeze(lengths - 1, 1), score_at], axis=1)  # [B, 1 + R]
        x, states = pha_layers(W, ids, pos, pos_cols, lengths, device, tiled, dense_op, out_at)
        logits = linear(x[:, 0], W.output(), op_device=dense_op)
        row_op = device if tiled else None  # the Mojo row op is CPU code, as the attention op
        g.output(logits, states, *head_logprobs(x[:, 1:], W.output(), targets, row_op, copies))
    return g
