"""PHA hybrid graphs: prefill (whole prompts) and decode (S steps in one ``execute``).

The math is ``reference/pha.py`` (GSS, GQA, FFN branches, RMSNorm per branch,
softplus mixing, DeepNorm post-LN), written with plain MAX ops.

Per-sample state, one float32 tensor ``[L, B, X]`` (so a sample is a column
block the host can copy, as for the SRM). Per layer and sample, X holds, flat
and in this order (a branch that is off takes no room):

    gss    [2, H, N]          the DSS state as real pairs: real parts, then imaginary
    keys   [Hkv, n, dh]       normalised, rotated keys, preallocated to the context n
    values [Hkv, n, dh]

(one unused column if the model has neither GSS nor attention). ``StateLayout``
splits it; ``PHAEngine.split_states`` gives the reference's ``PHACache`` layout.

MAX 26.7 CPU workarounds (see graphs/srm/decode.py, docs/avx2_crash.md): nothing
broadcasts a size-1 head axis against a reshaped matmul result, and no small
one-hot or outer-product matmul runs (inside the decode loop they crash MAX's
AVX2 code). Per-head quantities are spread per channel by a gather
(``ops.per_channel``) and summed per head by a reshape and a sum, attention
runs one rank-3 matmul pair per head on channel slices, the KV-cache write
selects the new row with explicitly broadcast 0/1 factors, and the causal mask
is applied by multiplication in a written-out softmax (``_masked_softmax``).

The prefill takes the positions twice (``pos``, ``pos_cols``): with one vector on
both sides, ``pos[:, None] - pos[None, :]`` and ``pos[None, :] > pos[:, None]``
came out of the compiled graph as all zeros / all False (the Toeplitz matrix was
constant, the causal mask had no effect), although a small graph of just those
ops computes them right: it depends on what they fuse with. Built from two
distinct inputs, both are right (tests/test_pha_engine.py).
"""

from .decode import build_pha_decode_graph
from .model import PHAWeights, StateLayout, derived_name, derived_weights, graph_weight_names, matrix_names
from .prefill import build_pha_prefill_graph

__all__ = ["PHAWeights", "StateLayout", "build_pha_decode_graph", "build_pha_prefill_graph", "derived_name",
           "derived_weights", "graph_weight_names", "matrix_names"]
