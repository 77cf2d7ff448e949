"""How the SRM's graphs are built from ``graphs/srm``: handed its weight schema, the
decode op's packed inputs and the Mojo kernel library."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, Graph

from ...graphs.ops import cpu_ops_run
from ...graphs.sampler import build_sample_graph
from ...graphs.slots import build_regroup_graph
from ...graphs.srm import build_decode_graph, build_decode_steps_graph, build_prefill_graph
from ...runtime.kernels import kernel_library
from . import packing, schema
from .config import SRMConfig

# bumped when a compiled model must not be reused although its MLIR text is the same
GRAPH_SALT = b"srm-graphs-v2"


def prefill_reads_packed(kernels: bool, device: DeviceRef) -> bool:
    """Whether the prefill graph runs its dense layers on the decode op's packed copies of
    the matrices, in the weights' dtype (mojo/linear_packed.mojo): wherever the engine
    loads them for the op (``cpu_ops_run``: the Mojo ops on a CPU)."""
    return cpu_ops_run(kernels, device)


def build_graph(kind: str, config: SRMConfig, wdtype: DType, device: DeviceRef, kernels: bool) -> Graph:
    """The graph ``kind``: "prefill" (also per-position log-probabilities), "decode", "sample" (``graphs.sampler.build_sample_graph``),
    "regroup" (``graphs.slots``), or with the Mojo ops on a CPU "decode_steps"."""
    library = kernel_library() if kernels else None
    if kind == "sample":
        return build_sample_graph(config.vocab_size, device, kernel_library=library)
    if kind == "regroup":
        return build_regroup_graph("srm_regroup", config.n_layers, [config.n_heads, config.head_dim], device)
    if kind == "prefill":
        packed = packing.packed_copies(config) if prefill_reads_packed(kernels, device) else None
        return build_prefill_graph(config, schema, wdtype, device, kernel_library=library, packed=packed)
    packed = packing.packed_inputs(config) if cpu_ops_run(kernels, device) else None
    if kind == "decode":
        return build_decode_graph(config, schema, wdtype, device, kernel_library=library, packed=packed)
    if kind == "decode_steps" and packed is not None:
        return build_decode_steps_graph(config, schema, packed, library, wdtype)
    raise ValueError(f"unknown SRM graph kind {kind!r} (kernels={kernels}, device {device})")


__all__ = ["GRAPH_SALT", "build_graph", "prefill_reads_packed"]
