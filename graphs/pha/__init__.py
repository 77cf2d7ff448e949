"""PHA hybrid graphs: prefill (whole prompts, GSS as a chunked scan) and decode (S steps
in one ``execute``). The math is ``reference/pha.py`` (GSS, GQA, FFN branches, RMSNorm
per branch, softplus mixing, DeepNorm post-LN), written with plain MAX ops.

    weights    checkpoint keys, load-time derived tensors, ``StateLayout``, ``CHUNK``
    common     RoPE, q/k/v, FFN, masked softmax, the block around the branches
    gss        the GSS branch: chunked scan (prefill), recurrent step (decode)
    attention  the GQA branch: causal attention (prefill), a KV-cache step (decode)
    prefill    the prefill graph
    decode     the decode graph and its one-scatter state write
"""

from .decode import build_pha_decode_graph, row_width, write_rows
from .prefill import build_pha_prefill_graph
from .weights import (CHUNK, PHAWeights, StateLayout, derived_name, derived_weights, graph_weight_names,
                      gss_tables, matrix_names, n_chunks)

__all__ = ["CHUNK", "PHAWeights", "StateLayout", "build_pha_decode_graph", "build_pha_prefill_graph",
           "derived_name", "derived_weights", "graph_weight_names", "gss_tables", "matrix_names", "n_chunks",
           "row_width", "write_rows"]
