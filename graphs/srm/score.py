"""Score graph: the log-probability of every target token of right-padded texts, in the
parallel form (the prefill graph's layers, ``prefill.srm_layers``), and the top
alternatives at every position (``graphs/scoring.py``).

Inputs: ids, pos, last, start, init as in the prefill graph (``prefill.py``), then
    targets      [B, N, C] int64   the token whose log-probability is wanted after
                                   reading ids up to the same place (padding: any id)
Outputs (B and N symbolic, K = ``scoring.top_width(V)``):
    logprobs     [B, N, C] f32     log_softmax(logits)[target] at every position
    top_values   [B, N, C, K] f32  the K largest log-probabilities, descending
    top_ids      [B, N, C, K] int64 their tokens
    states       [L, B, H, hd] f32 the state after each sample's last real token
"""

from __future__ import annotations

from pathlib import Path

from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from ..ops import I64, cpu_ops_run
from ..scoring import head_logprobs
from .blocks import SRMWeights
from .prefill import CHUNK, prefix_input_types, srm_layers


def build_score_graph(config, schema, wdtype: DType = DType.float32, device: DeviceRef | None = None,
                      name: str | None = None, kernel_library: Path | None = None) -> Graph:
    """As ``build_prefill_graph``, but the output layer runs at every position; with the
    kernel library on a CPU the Mojo ops compute and reduce each position's logits."""
    device = device or DeviceRef.CPU()
    kernels = kernel_library is not None
    dt = "bf16" if wdtype == DType.bfloat16 else "f32"
    name = name or f"srm_score_{dt}" + ("_kernels" if kernels else "")
    input_types = prefix_input_types(config, device) + [TensorType(I64, ["batch", "chunks", CHUNK], device)]
    with Graph(name, input_types=input_types, custom_extensions=[kernel_library] if kernels else []) as g:
        ids, pos, last, start, init, targets = (v.tensor for v in g.inputs)
        W = SRMWeights(config, schema, wdtype, device)
        x, states = srm_layers(W, ids, pos, last, start, init, device, kernels)
        row_op = device if cpu_ops_run(kernels, device) else None  # the Mojo ops are CPU code
        logprobs, top_values, top_ids = head_logprobs(x, W.output(), targets, row_op)  # logits [B, N, C, V]
        g.output(logprobs, top_values, top_ids, states)
    return g
