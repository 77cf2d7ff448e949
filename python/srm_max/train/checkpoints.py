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

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..files import atomic_file, atomic_write_text, check_regular_file
from .errors import TrainError

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
MODEL_FILE = "model.pt"
STATE_FILE = "trainer_state.pt"
# What ``latest`` may name: a folder beside it, as ``save_training_state`` names them (never a
# path, so that a marker cannot send --resume into another run or anywhere else).
_STEP_NAME = re.compile(r"step-(\d{6,10})")
# ``latest`` holds one short name; a bigger file is not a marker, and is not read whole.
_MARKER_LIMIT = 4096


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
    """The checkpoint ``checkpoints/latest`` names, None without one, or ``TrainError`` when the
    folder, the marker or the checkpoint it names is not what a run writes there: a run writes
    ``latest`` last, so only a damaged or hand-edited folder gets there, and continuing anyway
    would start the run over (dropping its metrics and checkpoints) or load a foreign one."""
    root = Path(out) / CHECKPOINTS_DIR
    marker = root / LATEST_FILE
    if not path_exists(root):
        return None
    if not root.is_dir():
        raise TrainError(f"{root}: is not a directory (a run keeps its checkpoints in one); move it away, or use "
                         "--force to start over")
    if not path_exists(marker):
        return None
    check_regular_file(marker, TrainError)
    try:
        with open(marker, "rb") as f:
            text = f.read(_MARKER_LIMIT + 1)
    except OSError as e:
        raise TrainError(f"{marker}: cannot be read ({e.strerror or e})") from None
    name = text.decode("utf-8", errors="replace").strip()
    if not _STEP_NAME.fullmatch(name):
        shown = ascii(name[:60]) + ("..." if len(name) > 60 else "")
        raise TrainError(f"{marker}: names {shown}, not a checkpoint of this run (a step-NNNNNN folder beside it)")
    ckpt = root / name
    if path_exists(ckpt) and ckpt.resolve().parent != root.resolve():
        raise TrainError(f"{ckpt}: a link out of {root}, not a checkpoint of this run")
    if path_exists(ckpt) and not ckpt.is_dir():
        raise TrainError(f"{marker} points at {ckpt}, which is not a directory")
    for path in (ckpt / MODEL_FILE, ckpt / STATE_FILE):
        check_regular_file(path, TrainError)
    if not (ckpt / STATE_FILE).is_file() or not (ckpt / MODEL_FILE).is_file():
        raise TrainError(f"{marker} points at {ckpt}, which is incomplete")
    return ckpt


def path_exists(path: Path) -> bool:
    """Whether ``path`` exists (a link to nothing does); ``TrainError`` when that cannot be told.
    ``os.path.lexists`` says False for a path in a folder this user may not look into, which
    would make a run's files look absent: its checkpoints (``--resume`` would start it over) or
    its config (the arguments would go unchecked against it)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except NotADirectoryError:  # a file where a folder on the way should be: checked by the caller
        return False
    except OSError as e:
        raise TrainError(f"{path}: cannot be looked up ({e.strerror or e})") from None
    return True


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
    except OSError as e:  # not the file's content: a permission, an I/O error
        raise TrainError(f"{path}: cannot be read ({e.strerror or e})") from None
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
    when a file cannot be read, its weights are not this model's (a run resumed with other
    model arguments) or its trainer state is not one this trainer wrote for them."""
    weights = _load(ckpt / MODEL_FILE, device)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise TrainError(f"{ckpt}: its weights do not fit this model ({_first_mismatch(e)}); "
                         f"resume with the model arguments the run started with") from None
    path = ckpt / STATE_FILE
    state = _load(path, "cpu")
    try:
        step = _checked_state(state, optimizer, int(_STEP_NAME.fullmatch(ckpt.name).group(1)))
        resumed = Resumed(step, float(state.get("elapsed_s", 0.0)), int(state.get("tokens_seen", 0)))
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        _numpy_rng_restored(state["numpy_rng"])
    except TrainError as e:
        raise TrainError(f"{path}: not a trainer state of this run ({e})") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError) as e:
        # A file that torch reads but this trainer did not write: keys missing, values of other kinds.
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
        raise TrainError(f"{path}: not a trainer state of this run ({reason})") from None
    return resumed


def _checked_state(state: dict, optimizer, step: int) -> int:
    """The step of a trainer state, after checking that it is the one its folder names and that
    its optimizer state fits ``optimizer``'s parameters. ``load_state_dict`` checks only the
    number of parameters, so moments of another model size would load and fail at the first
    step, after the run's later metrics were dropped."""
    saved_step = state["step"]
    if type(saved_step) is not int or saved_step != step:
        raise TrainError(f"it holds step {saved_step!r}, its folder names step {step}")
    saved = state["optimizer"]
    groups, params = saved["param_groups"], [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in groups for i in group["params"]]
    if len(groups) != len(optimizer.param_groups) or len(ids) != len(params):
        raise TrainError(f"its optimizer state holds {len(ids)} parameters in {len(groups)} groups, this model "
                         f"{len(params)} in {len(optimizer.param_groups)}")
    for i, param in zip(ids, params):
        for name, value in saved["state"].get(i, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise TrainError(f"optimizer {name!r} of parameter {i} has shape {list(value.shape)}, the model's "
                                 f"{list(param.shape)}")
    return saved_step


def save_final_model(model: nn.Module, path: Path) -> None:
    """The trained model as an fp32 ``state_dict`` on the CPU (what ``srm-max convert`` reads)."""
    save_atomic({k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                 for k, v in unwrap(model).state_dict().items()}, path)
