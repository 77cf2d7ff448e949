"""The output directory of a run (``--out``): the files a run writes there, and when it may.

A run writes into a directory that is absent or empty, or into one it is told to
continue (``resume``: the run there goes on from its newest checkpoint) or to start
over in (``force``: the old run's files are removed first). A directory holding
anything else is refused before any work, so one run never replaces another's model
or mixes its metrics into another's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..files import atomic_write_text
from .checkpoints import CHECKPOINTS_DIR, LATEST_FILE, latest_checkpoint
from .errors import TrainError

FINAL_MODEL_FILE = "model.pt"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
RESULTS_FILE = "results.json"
RUN_FILES = (FINAL_MODEL_FILE, CONFIG_FILE, METRICS_FILE, RESULTS_FILE)  # besides CHECKPOINTS_DIR


def _nearest_existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())


def check_out(out: str | Path, resume: bool = False, force: bool = False) -> None:
    """``TrainError`` unless a run may write into ``out`` (see the module's docstring); with
    ``resume``, also when the checkpoint it would continue from is incomplete, or when ``out``
    holds the results of a run but no checkpoint (resuming would start a new run over them).
    A run killed before its first checkpoint left only its config and metrics: resuming
    starts it over, as it would in an empty directory."""
    out = Path(out)
    if resume and force:
        raise TrainError("--resume and --force exclude each other: continue the run in --out, or start it over")
    try:
        existing = _nearest_existing(out)
    except OSError as e:  # a folder on the way that this user may not look into
        raise TrainError(f"--out {out}: {e.strerror} ({e.filename})") from None
    if not existing.is_dir():
        raise TrainError(f"--out {out}: " + ("exists and is not a directory" if existing == out
                                             else f"{existing} is not a directory"))
    if not os.access(existing, os.R_OK | os.W_OK | os.X_OK):
        raise TrainError(f"--out {out}: {existing} is not writable")
    if existing != out:
        return
    if any(out.iterdir()) and not (resume or force):
        raise TrainError(f"{out}: already exists (use --force to overwrite, or --resume to continue the run in it)")
    if resume and latest_checkpoint(out) is None:
        found = [name for name in RUN_FILES if (out / name).exists()]
        if FINAL_MODEL_FILE in found or RESULTS_FILE in found:
            raise TrainError(f"{out}: holds a run's files ({', '.join(found)}) but no checkpoint to resume from; "
                             "use --force to start over")


def start_over(out: str | Path) -> None:
    """Remove the run in ``out``: its checkpoints first (the ``latest`` marker before them, so
    that a kill midway leaves nothing ``--resume`` would continue), then its files. Files that
    are not the trainer's stay."""
    out = Path(out)
    checkpoints = out / CHECKPOINTS_DIR
    try:
        if checkpoints.is_dir() and not checkpoints.is_symlink():
            (checkpoints / LATEST_FILE).unlink(missing_ok=True)
            shutil.rmtree(checkpoints)
        else:
            checkpoints.unlink(missing_ok=True)
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
    except OSError as e:
        raise TrainError(f"--force: cannot remove the old run's {e.filename} ({e.strerror})") from None


def keep_metrics_through(out: str | Path, step: int) -> None:
    """Drop the events of ``metrics.jsonl`` after ``step``, where a resumed run goes on: it
    logs those steps again, and a killed run may have logged some after its last checkpoint
    (or cut its last line short)."""
    path = Path(out) / METRICS_FILE
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and isinstance(event.get("step"), int) and event["step"] <= step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))


__all__ = ["CONFIG_FILE", "FINAL_MODEL_FILE", "METRICS_FILE", "RESULTS_FILE", "RUN_FILES", "check_out",
           "keep_metrics_through", "start_over"]
