"""Configuration of the Parallel Hybrid Architecture (``architecture = "pha"``).

See ``docs/pha.md``. Every choice the paper leaves open is a field here,
so a checkpoint's ``config.json`` says exactly which model it holds. Sizes left
as ``None`` are resolved in ``__post_init__`` (F = 4E, H = E/4, FFNs = 2 x 2E),
so a saved config always holds explicit numbers.

Branch names, in block order (sequential mode runs them in this order, and the
columns of ``PHA.mixing_weights()`` follow it): ``gss``, ``attn``, ``ffn_0``,
``ffn_1``, ... ``branches`` lists the kinds enabled; ``"ffn"`` stands for all
the FFN branches, one per entry of ``ffn_dims``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import CheckpointError
from ...scalars import is_plain_int, is_plain_real
from ..config_io import dataclass_from_dict, read_json, write_config
from .schema import checkpoint_shapes

PHA_ARCHITECTURE = "pha"
BRANCH_KINDS = ("gss", "attn", "ffn")
MODES = ("parallel", "sequential")
# Far above any real PHA; they stop a hostile config.json from asking for absurd work.
LIMITS = {
    "vocab_size": 1 << 24,
    "d_model": 1 << 16,
    "n_layers": 1024,
    "context_length": 1 << 20,
    "gss_expansion_dim": 1 << 20,
    "gss_hidden_dim": 1 << 18,
    "dss_state_size": 1 << 14,
    "n_q_heads": 1024,
    "n_kv_heads": 1024,
    "ffn_dims": 1 << 20,
    "n_ffn": 16,
}


def _is_number(value) -> bool:
    return is_plain_real(value) and math.isfinite(value)


@dataclass(frozen=True)
class PHAConfig:
    """Sizes and choices of a PHA model.

    vocab_size, d_model (E), n_layers (L blocks), context_length (n: the KV
    cache length; prompt + completion never longer), n_q_heads, n_kv_heads
        Required.
    gss_expansion_dim
        F, width of the GSS gate u = gelu(W_u x). None -> 4 E (GSS paper).
    gss_hidden_dim
        H, channels the DSS mixes, v = gelu(W_v x). None -> max(1, E // 4).
    dss_state_size
        N, complex states per DSS channel (Lambda is shared over channels).
    n_q_heads, n_kv_heads
        GQA: query head h reads KV head h // (n_q_heads / n_kv_heads);
        head_dim = E / n_q_heads, even (RoPE rotates pairs).
    rope_base
        RoPE base; rotation of the two halves of a head (GPT-NeoX layout).
    logit_scale_init, logit_scale_max
        Scaled-cosine attention (Swin v2): logits = cos(q, k) * exp(min(s, log max)),
        s a learnable per-head scalar initialised to log(logit_scale_init).
    ffn_dims
        Hidden width of each FFN branch (Linear, GELU, Linear, with biases);
        its length is the number of FFN branches (Dual-FFN: 2). None -> (2E, 2E):
        together as wide as one standard 4E FFN. Must be () when "ffn" is off.
    deepnorm
        True: x = LN(alpha x + mix), alpha = (2L)**0.25, and value/output/FFN
        projections initialised with gain beta = (8L)**-0.25 (torchscale).
        False: plain post-LN, alpha = beta = 1. Same parameters either way.
    branches
        The branch kinds enabled, a subset of ("gss", "attn", "ffn") in that
        order (ablations: drop one; its parameters are then absent).
    mode
        "parallel": the paper's block, branches on the same input, mixed with
        softplus-normalised weights, one residual + post-norm per block.
        "sequential" (ablation): each branch is its own residual sub-layer,
        x = LN_i(alpha x + RMSNorm_i(branch_i(x))), no mixing weights.
    norm_eps
        eps of every RMSNorm and LayerNorm.
    tie_embeddings
        True: logits = x @ embed.weight.T and there is no ``lm_head.weight``.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    context_length: int
    n_q_heads: int
    n_kv_heads: int
    gss_expansion_dim: int | None = None
    gss_hidden_dim: int | None = None
    dss_state_size: int = 512
    rope_base: float = 10000.0
    logit_scale_init: float = 10.0
    logit_scale_max: float = 100.0
    ffn_dims: tuple[int, ...] | None = None
    deepnorm: bool = True
    branches: tuple[str, ...] = BRANCH_KINDS
    mode: str = "parallel"
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    architecture: str = PHA_ARCHITECTURE

    def __post_init__(self) -> None:
        if self.architecture != PHA_ARCHITECTURE:
            raise CheckpointError(f"config: architecture {self.architecture!r} is not {PHA_ARCHITECTURE!r}")
        for name in ("vocab_size", "d_model", "n_layers", "context_length", "n_q_heads", "n_kv_heads", "dss_state_size"):
            self._check_size(name, getattr(self, name))
        # None sizes resolve against d_model; set through object.__setattr__ (frozen).
        E = self.d_model
        if self.gss_expansion_dim is None:
            object.__setattr__(self, "gss_expansion_dim", 4 * E)
        if self.gss_hidden_dim is None:
            object.__setattr__(self, "gss_hidden_dim", max(1, E // 4))
        self._check_size("gss_expansion_dim", self.gss_expansion_dim)
        self._check_size("gss_hidden_dim", self.gss_hidden_dim)

        branches = self.branches
        if isinstance(branches, list):  # from JSON
            branches = tuple(branches)
            object.__setattr__(self, "branches", branches)
        if not isinstance(branches, tuple) or not branches:
            raise CheckpointError(f"config: branches must be a non-empty list drawn from {list(BRANCH_KINDS)}, got {self.branches!r}")
        unknown = [b for b in branches if b not in BRANCH_KINDS]
        if unknown:
            raise CheckpointError(f"config: branches has unknown branch {unknown[0]!r} (known: {list(BRANCH_KINDS)})")
        if tuple(b for b in BRANCH_KINDS if b in branches) != branches:
            raise CheckpointError(f"config: branches must list each kind once, in the order {list(BRANCH_KINDS)}, got {list(branches)}")

        dims = self.ffn_dims
        if dims is None:
            dims = (2 * E, 2 * E) if "ffn" in branches else ()
        if isinstance(dims, list):
            dims = tuple(dims)
        if not isinstance(dims, tuple):
            raise CheckpointError(f"config: ffn_dims must be a list of positive integers, got {self.ffn_dims!r}")
        object.__setattr__(self, "ffn_dims", dims)
        if len(dims) > LIMITS["n_ffn"]:
            raise CheckpointError(f"config: ffn_dims has {len(dims)} FFN branches, above the supported maximum {LIMITS['n_ffn']}")
        for value in dims:
            self._check_size("ffn_dims", value)
        if ("ffn" in branches) != bool(dims):
            raise CheckpointError(
                f"config: ffn_dims {list(dims)} disagrees with branches {list(branches)} "
                f"(FFN branches need ffn_dims, and ffn_dims need 'ffn' in branches)"
            )

        for name in ("rope_base", "logit_scale_init", "logit_scale_max"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise CheckpointError(f"config: {name} must be a positive number, got {value!r}")
        if self.logit_scale_max < self.logit_scale_init:
            raise CheckpointError(
                f"config: logit_scale_max {self.logit_scale_max} is below logit_scale_init {self.logit_scale_init}"
            )
        for name in ("deepnorm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointError(f"config: {name} must be true or false, got {getattr(self, name)!r}")
        if self.mode not in MODES:
            raise CheckpointError(f"config: mode must be one of {list(MODES)}, got {self.mode!r}")
        if not _is_number(self.norm_eps) or not (0 < self.norm_eps < 1):
            raise CheckpointError(f"config: norm_eps must be in (0, 1), got {self.norm_eps!r}")
        if self.n_q_heads % self.n_kv_heads:
            raise CheckpointError(f"config: n_q_heads {self.n_q_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.d_model % self.n_q_heads:
            raise CheckpointError(f"config: d_model {self.d_model} is not divisible by n_q_heads {self.n_q_heads}")
        if self.head_dim % 2:
            raise CheckpointError(
                f"config: head_dim = d_model / n_q_heads = {self.head_dim} must be even (RoPE rotates pairs)"
            )

    @staticmethod
    def _check_size(name: str, value) -> None:
        if not is_plain_int(value) or value < 1:
            raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
        if value > LIMITS[name]:
            raise CheckpointError(f"config: {name} = {value} is above the supported maximum {LIMITS[name]}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_q_heads

    @property
    def branch_names(self) -> tuple[str, ...]:
        """Branches of every block, in order: gss, attn, ffn_0, ffn_1, ..."""
        names = [b for b in ("gss", "attn") if b in self.branches]
        return tuple(names + [f"ffn_{i}" for i in range(len(self.ffn_dims))])

    @property
    def n_branches(self) -> int:
        return len(self.branch_names)

    @property
    def deepnorm_alpha(self) -> float:
        return (2 * self.n_layers) ** 0.25 if self.deepnorm else 1.0

    @property
    def deepnorm_beta(self) -> float:
        return (8 * self.n_layers) ** -0.25 if self.deepnorm else 1.0

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in checkpoint_shapes(self).values())

    def to_dict(self) -> dict:
        data = asdict(self)
        data["branches"] = list(self.branches)
        data["ffn_dims"] = list(self.ffn_dims)
        return data

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "PHAConfig":
        return dataclass_from_dict(cls, data, source)

    def save(self, path: str | Path) -> None:
        write_config(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "PHAConfig":
        return cls.from_dict(read_json(path), source=str(path))


__all__ = ["PHAConfig", "PHA_ARCHITECTURE"]
