"""The SRM's weights as graph values, and the pieces its prefill and decode share."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, Weight, ops

from ..ops import F32, Dense, NamedWeights, linear


class SRMWeights(NamedWeights):
    """The SRM graph's named weights, as the schema names them."""

    def __init__(self, config, schema, wdtype: DType, device: DeviceRef):
        super().__init__(config, wdtype, device)
        self.schema = schema

    def layer(self, l: int) -> dict[str, Weight]:
        return {role: self.matrix(t.name, t.shape) if t.matrix else self.get(t.name, t.shape)
                for role, t in self.schema.layer_tensors(self.config, l).items()}

    def embedding(self) -> Weight:
        return self.matrix(self.schema.EMBEDDING, [self.config.vocab_size, self.config.d_model])

    def output(self) -> Weight:
        return self.matrix(self.schema.OUTPUT, [self.config.vocab_size, self.config.d_model])


def embed(weights: SRMWeights, ids: TensorValue) -> TensorValue:
    x = ops.gather(weights.embedding(), ids, axis=0)
    return x if x.dtype == F32 else ops.cast(x, F32)


def channel_mlp(x: TensorValue, p: dict, eps: float, op_device: Dense = None) -> TensorValue:
    """x + W2 silu(W1 LN_c(x) + b1) + b2; with ``op_device`` the products run through a
    Mojo linear op as ``linear`` says."""
    h = ops.layer_norm(x, p["cn_w"], p["cn_b"], epsilon=eps)
    h = linear(h, p["fc1_w"], p["fc1_b"], op_device, activation="silu")
    return x + linear(h, p["fc2_w"], p["fc2_b"], op_device)


def logits_of(weights: SRMWeights, x: TensorValue, op_device: Dense = None) -> TensorValue:
    return linear(x, weights.output(), op_device=op_device)
