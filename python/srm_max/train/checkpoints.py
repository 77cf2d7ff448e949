"""Training checkpoints: what ``--resume`` continues from.

    OUT/checkpoints/step-NNNNNN/model.pt           the model's state_dict
    OUT/checkpoints/step-NNNNNN/trainer_state.pt   step, optimizer, scaler, RNG states, extras
    OUT/checkpoints/latest                         the name of the newest complete step-N

Each file is written atomically and ``latest`` moves last, so a kill at any
moment leaves ``latest`` pointing at a complete checkpoint. These are PyTorch
files for the trainer; ``srm-max convert`` turns the final ``model.pt`` into a
served checkpoint.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..files import atomic_file, atomic_write_text
from .errors import TrainError

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
MODEL_FILE = "model.pt"
STATE_FILE = "trainer_state.pt"


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` that leaves the complete old or new file, never half of one."""
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


def save_training_state(out: Path, step: int, model: nn.Module, optimizer, scaler, extra: dict,
                    keep: int = 2) -> Path:
    """Write checkpoints/step-N/{model.pt,trainer_state.pt}, then point checkpoints/latest at it."""
    root = out / CHECKPOINTS_DIR
    ckpt = root / f"step-{step:06d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    save_atomic(unwrap(model).state_dict(), ckpt / MODEL_FILE)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy_rng": _numpy_rng_saved(),
        **extra,
    }
    save_atomic(state, ckpt / STATE_FILE)
    atomic_write_text(root / LATEST_FILE, ckpt.name + "\n")
    if keep > 0:
        old = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != ckpt.name)
        for p in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    return ckpt


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, None without one, or ``TrainError`` when it
    is incomplete (a run writes ``latest`` last, so only a hand-edited folder gets there)."""
    marker = Path(out) / CHECKPOINTS_DIR / LATEST_FILE
    if not marker.is_file():
        return None
    name = marker.read_text(encoding="utf-8", errors="replace").strip()
    ckpt = marker.parent / name
    if not name or not (ckpt / STATE_FILE).is_file() or not (ckpt / MODEL_FILE).is_file():
        raise TrainError(f"{marker} points at {ckpt}, which is incomplete")
    return ckpt


def _first_mismatch(error: RuntimeError, limit: int = 160) -> str:
    """The first line after torch's "Error(s) in loading state_dict" header, cut to ``limit``
    characters (a list of missing keys can run to thousands)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = (lines[1] if len(lines) > 1 else lines[0] if lines else "").rstrip(".")
    return detail if len(detail) <= limit else detail[:limit - 3] + "..."


@dataclass
class Resumed:
    """Where a resumed run stands: the next step, and the totals before it."""

    step: int = 0
    elapsed_s: float = 0.0
    tokens_seen: int = 0


def _load(path: Path, device) -> dict:
    """``torch.load`` of a checkpoint file (tensors and plain values only), or ``TrainError``
    naming it when it cannot be read, with the run's other checkpoints to fall back on."""
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001  (torch raises many kinds for a damaged or foreign file)
        others = sorted(p.name for p in path.parent.parent.glob("step-*") if p != path.parent)
        fallback = (f"; other checkpoints: {', '.join(others)} (name one in {path.parent.parent / LATEST_FILE} "
                    "to resume from it)" if others else "; use --force to start over")
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise TrainError(f"{path}: cannot be read, damaged or not this trainer's ({reason}){fallback}") from None
    if not isinstance(state, dict):
        raise TrainError(f"{path}: not a checkpoint of this trainer (a {type(state).__name__})")
    return state


def _numpy_rng_saved() -> tuple:
    """numpy's global RNG state with its keys as a tensor: a file ``torch.load`` reads with
    ``weights_only=True`` (no pickled numpy objects)."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    return name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached)


def _numpy_rng_restored(saved) -> None:
    name, keys, position, has_gauss, cached = saved
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))


def restore_checkpoint(ckpt: Path, model: nn.Module, optimizer, scaler, device: torch.device) -> Resumed:
    """Load the model, optimizer, scaler and every RNG state of ``ckpt`` in place; ``TrainError``
    when a file cannot be read or its weights are not this model's (a run resumed with other
    model arguments)."""
    weights = _load(ckpt / MODEL_FILE, device)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise TrainError(f"{ckpt}: its weights do not fit this model ({_first_mismatch(e)}); "
                         f"resume with the model arguments the run started with") from None
    state = _load(ckpt / STATE_FILE, "cpu")
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    _numpy_rng_restored(state["numpy_rng"])
    return Resumed(int(state["step"]), float(state.get("elapsed_s", 0.0)), int(state.get("tokens_seen", 0)))


def save_final_model(model: nn.Module, path: Path) -> None:
    """The trained model as an fp32 ``state_dict`` on the CPU (what ``srm-max convert`` reads)."""
    save_atomic({k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                 for k, v in unwrap(model).state_dict().items()}, path)
