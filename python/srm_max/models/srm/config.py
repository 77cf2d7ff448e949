"""Model configuration, saved as an HF-style ``config.json``.

The ``architecture`` field selects the model family (``models.registry``), so every
architecture shares the checkpoint format.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import CheckpointError
from ...scalars import is_plain_int, is_plain_real
from ..config_io import dataclass_from_dict, read_json, write_config

SRM_ARCHITECTURE = "srm"
# Far above any real SRM; they stop a hostile config.json from asking for absurd work.
LIMITS = {
    "vocab_size": 1 << 24,
    "d_model": 1 << 16,
    "n_layers": 1024,
    "n_heads": 256,
    "context_length": 1 << 20,
    "ffn_expansion": 64,
}


@dataclass(frozen=True)
class SRMConfig:
    """Sizes of a Structured Recurrent Mixer (see ``docs/srm.md``).

    ``context_length`` is n: the number of positions the mixer vectors cover.
    A prompt plus its completion can never be longer.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    context_length: int
    ffn_expansion: int = 4
    decay: bool = True
    layer_norm_eps: float = 1e-5
    architecture: str = SRM_ARCHITECTURE

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "context_length", "ffn_expansion"):
            value = getattr(self, name)
            if not is_plain_int(value) or value < 1:
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
            if value > LIMITS[name]:
                raise CheckpointError(f"config: {name} = {value} is above the supported maximum {LIMITS[name]}")
        if not isinstance(self.decay, bool):
            raise CheckpointError(f"config: decay must be true or false, got {self.decay!r}")
        eps = self.layer_norm_eps
        if not is_plain_real(eps) or not (0 < eps < 1):
            raise CheckpointError(f"config: layer_norm_eps must be in (0, 1), got {self.layer_norm_eps!r}")
        if self.architecture != SRM_ARCHITECTURE:
            raise CheckpointError(f"config: architecture {self.architecture!r} is not {SRM_ARCHITECTURE!r}")
        if self.n_heads % 2:
            # Half the heads are column-repeat, half row-repeat.
            raise CheckpointError(f"config: n_heads must be even (column + row heads), got {self.n_heads}")
        if self.d_model % self.n_heads:
            raise CheckpointError(
                f"config: d_model {self.d_model} is not divisible by n_heads {self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def decay_constant(self) -> int:
        """c in lam = clip(decay, 0.9, 1) ** (1 / c).

        The reference code uses n // 512, which is 0 (division by zero) for
        n < 512; max(1, .) keeps n >= 512 bit-compatible and makes small n work.
        """
        return max(1, self.context_length // 512)

    @property
    def ffn_dim(self) -> int:
        return self.d_model * self.ffn_expansion

    def num_parameters(self) -> int:
        d, V, L, n, H = self.d_model, self.vocab_size, self.n_layers, self.context_length, self.n_heads
        per_layer = (
            4 * d  # two LayerNorms
            + (d * self.ffn_dim + self.ffn_dim) + (self.ffn_dim * d + d)  # channel MLP
            + (d * d + d)  # head projections, all heads together
            + (d * d + d)  # out_proj
            + H * (2 * n + (1 if self.decay else 0))  # w, beta, decay per head
        )
        return 2 * V * d + L * per_layer

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "SRMConfig":
        return dataclass_from_dict(cls, data, source)

    def save(self, path: str | Path) -> None:
        write_config(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "SRMConfig":
        return cls.from_dict(read_json(path), source=str(path))


def decay_lambda(decay_value: float, decay_constant: int) -> float:
    """The per-step decay lam = clip(decay_value, 0.9, 1) ** (1 / c)."""
    return min(max(decay_value, 0.9), 1.0) ** (1.0 / decay_constant)


__all__ = ["SRMConfig", "SRM_ARCHITECTURE", "decay_lambda"]
