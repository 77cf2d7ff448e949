"""The trainer's settings: one dataclass, its defaults the CLI's defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    context_length: int = 512
    batch_size: int = 8  # sequences per step and per process
    steps: int = 1000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    seed: int = 0
    log_every: int = 10
    eval_every: int = 250  # 0: only at the end
    eval_max_windows: int = 0  # 0: the whole validation set
    save_every: int = 250  # 0: only at the end
    keep_checkpoints: int = 2
    stop_at_step: int = 0  # stop (after checkpointing) at this step; 0: run to `steps`
