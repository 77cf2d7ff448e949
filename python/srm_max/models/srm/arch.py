"""The SRM's entry in the model registry."""

from __future__ import annotations

from ..architecture import Architecture
from . import build, schema, weight_adapter
from .config import SRMConfig
from .engine import Engine

def reference_logits(model, ids, form: str):
    """The reference SRM's logits with its token mixer in ``form`` (naive, parallel, recurrent)."""
    return model(ids, mixer=form)


def sample_footprint(config: SRMConfig) -> tuple[int, int]:
    """float32 state + position; the widest activation is the channel MLP's."""
    return config.n_layers * config.d_model * 4 + 8, config.ffn_dim


SRM_ARCH = Architecture(
    name="srm",
    config=SRMConfig,
    checkpoint_shapes=schema.checkpoint_shapes,
    engine=Engine,
    reference="srm_max.reference.srm:SRM",
    build_graph=build.build_graph,
    graph_salt=build.GRAPH_SALT,
    parity_forms=("naive", "parallel", "recurrent"),
    reference_logits=reference_logits,
    sample_footprint=sample_footprint,
    weight_adapter=weight_adapter,
)
