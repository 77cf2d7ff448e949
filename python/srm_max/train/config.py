"""The trainer's settings: one dataclass, its defaults the CLI's defaults, and the values it accepts."""

from __future__ import annotations

from dataclasses import dataclass

from ..scalars import out_of_range
from .errors import TrainError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# np.random.seed takes seeds below 2**32; with them the per-step generator seeds of
# data.batch_generator also stay below the 2**64 torch accepts.
MAX_SEED = 2**32 - 1

# The smallest value of each integer setting.
_INT_MINIMA = {"context_length": 1, "batch_size": 1, "steps": 1, "warmup_steps": 0, "seed": 0, "log_every": 1,
               "eval_every": 0, "eval_max_windows": 0, "save_every": 0, "keep_checkpoints": 0, "stop_at_step": 0}
# The largest value of the integer settings that have a natural one: a step count an int32
# holds (more would never finish) and a batch of about a million sequences per process (beyond
# that torch fails with an allocation error or an overflow rather than a message).
MAX_STEPS = 2**31 - 1
MAX_BATCH_SIZE = 2**20
_INT_MAXIMA = {"batch_size": MAX_BATCH_SIZE, "steps": MAX_STEPS}
# Above this a learning rate or weight decay overflows AdamW's float32 arithmetic long before
# it could train anything; the bound is far above any useful value.
MAX_LR = MAX_WEIGHT_DECAY = 1e3
# The finite values each real setting accepts, and how the message words them.
_REAL_RANGES = {
    "lr": (lambda v: 0 < v <= MAX_LR, f"a number > 0 and <= {MAX_LR:g}"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "a number from 0 to 1"),
    "weight_decay": (lambda v: 0 <= v <= MAX_WEIGHT_DECAY, f"a number from 0 to {MAX_WEIGHT_DECAY:g}"),
    "grad_clip": (lambda v: v >= 0, "a number >= 0 (0: no clipping)"),
}


def flag(name: str) -> str:
    """The command-line flag of a setting: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


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

    def check(self) -> TrainConfig:
        """This config, or ``TrainError`` naming the first setting out of range by its flag.

        The optimizer's betas are left to ``torch.optim.AdamW``, which checks them.
        """
        bad = out_of_range(self, int_minima=_INT_MINIMA)
        if bad is None and self.seed > MAX_SEED:
            bad = "seed", f"an integer from 0 to {MAX_SEED}", self.seed
        for name, largest in _INT_MAXIMA.items():
            if bad is None and getattr(self, name) > largest:
                bad = name, f"an integer from {_INT_MINIMA[name]} to {largest}", getattr(self, name)
        bad = bad or out_of_range(self, real_ranges=_REAL_RANGES)
        if bad is not None:
            name, wording, value = bad
            raise TrainError(f"{flag(name)} must be {wording}, got {value!r}")
        if self.precision not in PRECISIONS:
            raise TrainError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        return self
