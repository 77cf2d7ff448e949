"""The PHA's entry in the model registry."""

from __future__ import annotations

from ...graphs.pha import StateLayout
from ..architecture import Architecture
from . import build, schema, weight_adapter
from .config import PHAConfig
from .engine import PHAEngine

def reference_logits(model, ids, form: str):
    """The reference PHA's logits with its GSS branch as an FFT convolution or a recurrence,
    or ("decode") the first token by prefill, then one step at a time with its cache."""
    if form != "decode":
        return model(ids, gss_form=form)
    import torch  # the reference needs torch, the package does not

    logits, cache = model.prefill(ids[:, :1])
    out = [logits[:, 0]]
    for t in range(1, ids.shape[1]):
        step_logits, cache = model.step(ids[:, t], torch.full((ids.shape[0],), t), cache)
        out.append(step_logits)
    return torch.stack(out, 1)


def sample_footprint(config: PHAConfig) -> tuple[int, int]:
    """GSS state + KV caches + position; the widest activation: an FFN, the GSS gate,
    or the attention scores."""
    state = config.n_layers * StateLayout.of(config).width * 4 + 8
    return state, max(*config.ffn_dims, config.gss_expansion_dim, config.n_q_heads * config.context_length)


PHA_ARCH = Architecture(
    name="pha",
    config=PHAConfig,
    checkpoint_shapes=schema.checkpoint_shapes,
    engine=PHAEngine,
    reference="srm_max.reference.pha:PHA",
    build_graph=build.build_graph,
    graph_salt=build.GRAPH_SALT,
    parity_forms=("fft", "recurrent", "decode"),
    reference_logits=reference_logits,
    sample_footprint=sample_footprint,
    weight_adapter=weight_adapter,
)
