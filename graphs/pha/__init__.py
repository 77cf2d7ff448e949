"""PHA hybrid graphs: prefill, which also scores (whole prompts), and decode.

The math is ``reference/pha.py`` (GSS, GQA, FFN branches, RMSNorm per branch,
softplus mixing, DeepNorm post-LN). On a CPU with the kernel library the prefill's
attention, queries and keys, GSS scan, dense layers and scored rows are Mojo ops, and a
decode call runs every step in one op (``decode.build_pha_decode_steps_graph``,
mojo/pha_decode_step.mojo); elsewhere (a GPU, ``PHAEngine(kernels=False)``, a block
the op cannot run) the graphs are plain MAX ops, and the decode graph runs one step per
``execute``, the state written in place.

Per-sample state, one float32 tensor ``[L, B, X]`` (so a sample is a column
block the host can copy, as for the SRM). Per layer and sample, X holds, flat
and in this order (a branch that is off takes no room):

    gss    [2, H, N]          the DSS state as real pairs: real parts, then imaginary
    keys   [Hkv, n, dh]       normalised, rotated keys, preallocated to the context n
    values [Hkv, n, dh]

(one unused column if the model has neither GSS nor attention). ``StateLayout``
splits it; ``PHAEngine.split_states`` gives the reference's ``PHACache`` layout.

Modules: ``model`` (weights, state layout, the pieces both graphs share), ``gss``
(the GSS branch: load-time tables, chunked-scan prefill, decode step), ``attention``
(the GQA branch), ``prefill`` and ``decode`` (the graphs).

MAX 26.7 CPU workarounds (see graphs/srm/decode.py, docs/avx2_crash.md): nothing
broadcasts a size-1 head axis against a reshaped matmul result, and no small
one-hot or outer-product matmul runs inside a loop (they crash MAX's AVX2 code;
the decode graph has no loop, the rule keeps it safe to wrap in one). Per-head quantities are spread per channel by a gather and summed per
head by a reshape and a sum, and the causal mask is applied by multiplication in a
written-out softmax (``model._masked_softmax``).
"""

from .decode import build_pha_decode_graph
from .gss import CHUNK
from .model import PHAWeights, StateLayout, derived_name, derived_weights, graph_weight_names, matrix_names
from .prefill import build_pha_prefill_graph

__all__ = ["CHUNK", "PHAWeights", "StateLayout", "build_pha_decode_graph", "build_pha_prefill_graph", "derived_name",
           "derived_weights", "graph_weight_names", "matrix_names"]
