"""The PHA score graph: the log-probability of every target token of right-padded
texts, from a fresh start, over the prefill graph's layers (``prefill.pha_layers``),
and the top alternatives at every position (``graphs/scoring.py``).

Inputs:  ids, pos, pos_cols, lengths as in the prefill graph, then
         targets [B, M, C] int64 (the token to score after reading ids to the same place).
Outputs: logprobs [B, M, C] f32, top_values [B, M, C, K] f32 (descending), top_ids
         [B, M, C, K] int64 (K = ``scoring.top_width(V)``), states [L, B, X] after each
         sample's last token.
"""

from __future__ import annotations

from pathlib import Path

from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, ops

from ..ops import I64, cpu_ops_run
from ..scoring import head_logprobs
from .gss import CHUNK
from .model import PHAWeights
from .prefill import pha_layers, prefix_input_types


def build_pha_score_graph(config, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                          name: str | None = None, kernel_library: Path | None = None) -> Graph:
    """As ``build_pha_prefill_graph``, but the output layer runs at every position; with
    ``kernel_library`` on a CPU the attention is the tiled Mojo op and the Mojo ops compute
    and reduce each position's logits."""
    device = device or DeviceRef.CPU()
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    row_op = device if cpu_ops_run(kernel_library is not None, device) else None  # the Mojo ops are CPU code
    input_types = prefix_input_types(device) + [TensorType(I64, ["batch", "chunks", CHUNK], device)]
    extensions = [kernel_library] if row_op is not None else []
    with Graph(name or f"pha_score_{dt}" + ("_kernels" if row_op is not None else ""), input_types=input_types,
               custom_extensions=extensions) as g:
        ids, pos, pos_cols, lengths, targets = (v.tensor for v in g.inputs)
        W = PHAWeights(config, wdtype, device)
        x, states = pha_layers(W, ids, pos, pos_cols, lengths, device, tiled=row_op is not None)
        logprobs, top_values, top_ids = head_logprobs(x, W.output(), targets, row_op)  # logits [B, M, C, V]
        g.output(logprobs, top_values, top_ids, ops.stack(states, axis=0))
    return g
