"""How the PHA's graphs are built from ``graphs/pha``."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, Graph

from ...graphs import pha
from ...graphs.pha.decode import build_pha_decode_steps_graph
from ...graphs.sampler import build_sample_graph
from ...graphs.slots import build_regroup_graph
from ...runtime.kernels import kernel_library
from . import packing
from .config import PHAConfig

# bumped when a compiled model must not be reused although its MLIR text is the same
GRAPH_SALT = b"pha-graphs-v2"


def prefill_reads_packed(config: PHAConfig, cpu_ops: bool) -> bool:
    """Whether the prefill graph runs its dense layers on the decode op's packed copies of
    the matrices, in the weights' dtype (mojo/linear_packed.mojo, a graph input;
    ``PHAEngine`` packs them at load wherever the op runs the model): with the Mojo ops on
    a CPU (``cpu_ops``), for a model the decode op runs."""
    return cpu_ops and packing.supported(config) is None


def build_graph(kind: str, config: PHAConfig, wdtype: DType, device: DeviceRef, kernels: bool) -> Graph:
    """The graph ``kind`` ("prefill", which also scores, "decode", "sample" or "regroup"). The decode graph
    always uses one Mojo op (its in-place state write). With the Mojo ops (``kernels``) on a
    CPU there is "decode_steps" too: every step of a decode call in one op
    (mojo/pha_decode_step.mojo), and the prefill graph's attention and GSS scan are Mojo ops
    (mojo/pha_prefill_attention.mojo with mojo/pha_qk_rope.mojo, mojo/pha_gss_scan.mojo), as is the reduction of its
    scored logits (mojo/score_head.mojo, mojo/score_rows.mojo) and the dense layers
    (``prefill_reads_packed``, else with bfloat16 weights mojo/linear.mojo); ``kernels``
    changes no other graph."""
    cpu_ops = kernel_library() if kernels and device.is_cpu() else None
    if kind == "sample":
        return build_sample_graph(config.vocab_size, device, kernel_library=cpu_ops)
    if kind == "regroup":
        return build_regroup_graph("pha_regroup", config.n_layers, [pha.StateLayout.of(config).width], device)
    if kind == "prefill":
        packed = packing.matrix_offsets(config) if prefill_reads_packed(config, cpu_ops is not None) else None
        return pha.build_pha_prefill_graph(config, wdtype, device, kernel_library=cpu_ops, packed=packed)
    if kind == "decode":
        return pha.build_pha_decode_graph(config, wdtype, device, kernel_library=kernel_library())
    if kind == "decode_steps" and kernels and device.is_cpu() and packing.supported(config) is None:
        return build_pha_decode_steps_graph(kernel_library(), wdtype)
    raise ValueError(f"unknown PHA graph kind {kind!r} (kernels={kernels}, device {device})")


__all__ = ["GRAPH_SALT", "build_graph", "prefill_reads_packed"]
