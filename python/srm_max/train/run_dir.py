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

from ..errors import CheckpointError
from ..files import atomic_write_bytes, check_regular_file
from ..models.config_io import read_json
from ..models.registry import config_from_dict
from .checkpoints import CHECKPOINTS_DIR, LATEST_FILE, latest_checkpoint, path_exists
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
    for name in RUN_FILES:
        # --resume appends to, reads or replaces these, and --force removes them: a named pipe
        # would block the run, a device swallow its output, a folder fail it after the training.
        check_regular_file(out / name, TrainError)
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
    (or cut its last line short). Every other line stays as it was, byte for byte: a line that
    is not an event of a step (junk, a note) is dropped only when it comes after the last kept
    event, so nothing between good lines is lost."""
    path = Path(out) / METRICS_FILE
    check_regular_file(path, TrainError)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    except OSError as e:
        raise TrainError(f"{path}: cannot be read ({e.strerror or e})") from None
    lines = data.splitlines(keepends=True)
    steps = [_event_step(line) for line in lines]
    last = max((i for i, s in enumerate(steps) if s is not None and s <= step), default=-1)
    kept = [line if line.endswith(b"\n") else line + b"\n"
            for line, s in zip(lines[:last + 1], steps) if s is None or s <= step]
    if b"".join(kept) != data:
        atomic_write_bytes(path, b"".join(kept))


def _event_step(line: bytes) -> int | None:
    """The step of a metrics line, or None for a line that is no event of one."""
    try:  # decoded leniently: a stray byte in a note does not make the step unknown (the bytes stay as they were)
        event = json.loads(line.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return None
    step = event.get("step") if isinstance(event, dict) else None
    return step if type(step) is int else None


def check_run_config(out: str | Path, model_config) -> None:
    """``TrainError`` unless the ``config.json`` of the run in ``out`` is ``model_config``: a resumed
    run writes its config there, so arguments of another model whose weights still load (another
    context length, no decay) would replace the run's config silently. A run without one (removed
    by hand) passes: the weights' own check is what is left."""
    path = Path(out) / CONFIG_FILE
    if not path_exists(path):
        return
    try:
        saved = read_json(path, TrainError)
    except TrainError as e:  # unreadable, not a regular file, not JSON
        raise TrainError(f"{e}; repair or remove it to resume") from None
    if isinstance(saved, dict):
        try:  # read as a config, so that a field this version added (at its default) is no difference
            saved = config_from_dict(saved, str(path)).to_dict()
        except CheckpointError:  # another architecture's, say: compared as written, field by field
            pass
    if not isinstance(saved, dict):
        raise TrainError(f"{path}: not a config of this trainer (a JSON object), so these arguments cannot be "
                         "checked against the run's model; repair or remove it to resume")
    saved = json.loads(json.dumps(saved))
    given = json.loads(json.dumps(model_config.to_dict()))  # tuples as the lists the file holds
    missing = object()
    differ = [k for k in sorted(saved.keys() | given.keys()) if saved.get(k, missing) != given.get(k, missing)]
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r} (the arguments give {given.get(k)!r})" for k in differ[:4])
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise TrainError(f"{path}: the run was started with another model: {shown}{more}; resume with the model "
                         "arguments the run started with")


__all__ = ["CONFIG_FILE", "FINAL_MODEL_FILE", "METRICS_FILE", "RESULTS_FILE", "RUN_FILES", "check_out",
           "check_run_config", "keep_metrics_through", "start_over"]
