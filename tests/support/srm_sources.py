"""A small SRM and its weights written in each source layout ``srm-max convert`` reads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from srm_max.checkpoints.parity import reference_model
from srm_max.models.srm.config import SRMConfig
from srm_max.reference.srm import SRM

CONFIG = SRMConfig(48, 12, 2, 2, 40)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def snapshot(path: Path) -> dict:
    """Every file under path with its bytes: to prove nothing changed."""
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def logits_of(weights: dict, ids, dtype=torch.float32):
    with torch.no_grad():
        return reference_model(CONFIG, weights, dtype)(ids)


def write_source(kind: str, model: SRM, root: Path) -> Path:
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if kind == "pt":
        torch.save(sd, root / "model.pt")
        return root / "model.pt"
    if kind == "bin":
        torch.save(sd, root / "pytorch_model.bin")
        return root / "pytorch_model.bin"
    if kind == "safetensors":
        save_file(sd, str(root / "weights.safetensors"))
        return root / "weights.safetensors"
    if kind == "trainer_checkpoint":
        (root / "checkpoint-500").mkdir()
        save_file(sd, str(root / "checkpoint-500" / "model.safetensors"))
        return root / "checkpoint-500"
    if kind == "trainer_output":  # the highest checkpoint-N wins
        for step in (100, 1000):
            (root / f"checkpoint-{step}").mkdir()
            scaled = {k: v * (1 if step == 1000 else 2) for k, v in sd.items()}
            save_file(scaled, str(root / f"checkpoint-{step}" / "model.safetensors"))
        return root
    if kind == "dropout_variant":  # channel MLP with dropout: .2 moves to .3, plus DDP prefix
        moved = {("module." + k).replace(".channel_mixing_layer.2.", ".channel_mixing_layer.3."): v for k, v in sd.items()}
        torch.save(moved, root / "dropout.pt")
        return root / "dropout.pt"
    raise ValueError(kind)


KINDS = ["pt", "bin", "safetensors", "trainer_checkpoint", "trainer_output", "dropout_variant"]
