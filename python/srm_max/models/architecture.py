"""What the package knows about one model architecture (``models.registry`` lists them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from ..runtime.precompile import GraphJob


class ModelConfig(Protocol):
    """What code outside ``models/`` may rely on in any architecture's config."""

    architecture: str  # the registry name, as config.json's ``architecture`` field
    vocab_size: int
    context_length: int

    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class Architecture:
    name: str  # the ``architecture`` field of config.json
    config: type  # the config dataclass (from_dict, load, to_dict)
    checkpoint_shapes: Callable  # config -> {checkpoint key: shape}: the weight schema
    engine: type  # (config, weights, dtype, device) -> a runtime.compiled.CompiledGraphs
    reference: str  # "module:Class" of the PyTorch reference (imported on demand: torch is optional)
    build_graph: Callable  # (kind, config, weight DType, DeviceRef, kernels) -> max.graph.Graph
    graph_salt: bytes  # salt of its compiled graphs' cache keys (compile_cache.graph_key)
    # the reference's forms that must agree (``checkpoints.parity``), and how to run one:
    # (reference model, ids [B, T], form) -> logits [B, T, V]
    parity_forms: tuple[str, ...]
    reference_logits: Callable
    # config -> (bytes of one sample's decode state, width of the widest activation of a step)
    sample_footprint: Callable
    # the module that maps a source checkpoint's keys to ours (``models/<arch>/weight_adapter.py``):
    # recognizes(keys), normalize(tensors, source), check_supported(tensors, source),
    # infer_config(tensors, source, overrides), source_layout(model, config, raw_keys)
    weight_adapter: ModuleType

    def graph_job(self, kind: str, config, dtype: str = "float32", device: str = "cpu",
                  kernels: bool = False) -> GraphJob:
        """The compile job of one of this architecture's graphs."""
        return GraphJob(kind, config, dtype, device, kernels, self.build_graph, self.graph_salt)

    def reference_class(self) -> type:
        """The PyTorch reference model class (needs torch)."""
        module, name = self.reference.split(":")
        return getattr(importlib.import_module(module), name)


__all__ = ["Architecture", "ModelConfig"]
