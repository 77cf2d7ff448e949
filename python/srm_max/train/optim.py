"""Optimisation and precision: AdamW, the learning-rate schedule, autocast.

AdamW with weight decay on matrices only; linear warmup then cosine decay to
``min_lr_ratio * lr``. Precision ``auto`` is bf16 autocast on GPUs that support
it (fp16 with loss scaling on older ones); on CPU bf16 autocast where the CPU
has bf16 instructions (AMX, AVX512-BF16), else fp32. Weights and optimizer
state stay fp32.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch import nn

from .config import PRECISIONS, TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): warmup, then cosine to min_lr."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * progress))


def _is_matrix(p: torch.Tensor) -> bool:
    # Weight decay on true matrices only: not on biases, norms, or [1, n] vectors.
    return p.dim() >= 2 and min(p.shape) > 1


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and _is_matrix(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not _is_matrix(p)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kwargs)


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {precision!r}")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 matrix instructions (AMX or AVX512-BF16).

    On such a CPU bf16 autocast trains faster than fp32; without these
    instructions bf16 is emulated and slower, so ``auto`` stays in fp32.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def autocast_context(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; bf16 and fp32 do not."""
    return torch.amp.GradScaler("cuda") if precision == "fp16" else None
