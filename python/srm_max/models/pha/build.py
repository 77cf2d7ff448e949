"""How the PHA's graphs are built from ``graphs/pha``."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, Graph

from ...graphs import pha
from ...graphs.sampler import build_sample_graph
from ...graphs.slots import build_regroup_graph
from .config import PHAConfig

# bumped when a compiled model must not be reused although its MLIR text is the same
GRAPH_KEY = b"pha-graphs-v1"


def build_graph(kind: str, config: PHAConfig, wdtype: DType, device: DeviceRef, kernels: bool) -> Graph:
    """The graph ``kind`` ("prefill", "decode", "sample" or "regroup"; PHA has no Mojo ops:
    ``kernels`` is ignored)."""
    if kind == "sample":
        return build_sample_graph("pha_sample", config.vocab_size, device)
    if kind == "regroup":
        return build_regroup_graph("pha_regroup", config.n_layers, [pha.StateLayout.of(config).width], device)
    builders = {"prefill": pha.build_pha_prefill_graph, "decode": pha.build_pha_decode_graph}
    if kind not in builders:
        raise ValueError(f"unknown PHA graph kind {kind!r}")
    return builders[kind](config, wdtype, device)


__all__ = ["GRAPH_KEY", "build_graph"]
