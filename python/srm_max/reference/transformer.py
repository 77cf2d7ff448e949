"""A small GPT-style causal Transformer: the baseline the SRM is compared with.

Plain PyTorch, written to be read. Pre-LayerNorm blocks (attention, then a GELU
MLP), learned absolute position embeddings, a final LayerNorm, and an untied
output layer (the SRM's output layer is untied too). ``model(ids)`` with ids
``[B, T]`` (T <= context_length) returns next-token logits ``[B, T, V]``, the
same contract as :class:`srm_max.reference.srm.SRM`, so one training loop
trains both.

:func:`matched_config` sizes a Transformer to the parameter count of a given
SRM: same vocabulary, width, depth, heads and context, with the MLP width
chosen so that the totals agree (to within a few hundred parameters).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config_io import write_config
from ..scalars import is_plain_int

TRANSFORMER_ARCHITECTURE = "transformer"


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    context_length: int
    ffn_dim: int
    layer_norm_eps: float = 1e-5
    architecture: str = TRANSFORMER_ARCHITECTURE

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "context_length", "ffn_dim"):
            value = getattr(self, name)
            if not is_plain_int(value) or value < 1:
                raise ValueError(f"config: {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"config: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")

    def num_parameters(self) -> int:
        d, f, V, L, n = self.d_model, self.ffn_dim, self.vocab_size, self.n_layers, self.context_length
        per_layer = (
            4 * d  # two LayerNorms
            + (d * 3 * d + 3 * d) + (d * d + d)  # qkv and output projection
            + (d * f + f) + (f * d + d)  # MLP
        )
        return V * d + n * d + L * per_layer + 2 * d + V * d  # embeddings, blocks, final LN, output

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        write_config(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "TransformerConfig":
        return cls(**json.loads(Path(path).read_text()))


def matched_config(srm_config, ffn_multiple: int = 8) -> TransformerConfig:
    """A Transformer with the SRM's V, d, L, H and n, and an MLP width giving the same parameter count."""
    c = srm_config
    base = TransformerConfig(c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.context_length, ffn_dim=1)
    per_unit_f = c.n_layers * (2 * c.d_model + 1)  # parameters added per unit of ffn_dim
    target = c.num_parameters()
    f = (target - base.num_parameters() + per_unit_f) / per_unit_f
    f = max(ffn_multiple, int(round(f / ffn_multiple)) * ffn_multiple)
    return TransformerConfig(c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.context_length, ffn_dim=f,
                             layer_norm_eps=c.layer_norm_eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # [B, T, d] -> [B, H, T, d/H]
        q, k, v = (t.view(B, T, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.ffn_dim), nn.GELU(), nn.Linear(cfg.ffn_dim, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embedding = nn.Embedding(cfg.context_length, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.output_layer = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2L).
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.out_proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layers))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[-1]
        if T > self.config.context_length:
            raise ValueError(f"sequence of {T} tokens exceeds context_length {self.config.context_length}")
        pos = torch.arange(T, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(pos)
        for block in self.blocks:
            x = block(x)
        return self.output_layer(self.final_norm(x))


__all__ = ["TransformerConfig", "Transformer", "matched_config", "TRANSFORMER_ARCHITECTURE"]
