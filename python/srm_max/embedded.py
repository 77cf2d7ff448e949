"""The embedded default model: shipped inside the package, used when no path is given."""

from __future__ import annotations

from pathlib import Path

from .checkpoints.format import CONFIG_FILE, PARITY_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from .errors import CheckpointError

EMBEDDED_MODEL_DIR = Path(__file__).parent / "model"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, PARITY_FILE)


def default_model_path(directory: Path = EMBEDDED_MODEL_DIR) -> Path:
    """The embedded model's directory, after checking that all its files are there."""
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(
            f"embedded model: {directory / missing[0]} is missing; reinstall srm-max "
            "or pass a model directory explicitly"
        )
    return directory


def model_dir(path: str | Path | None) -> Path:
    """The checkpoint directory a command or ``Generator.from_pretrained`` loads: ``path``,
    or the embedded model's when it is None (the one place that fallback is decided)."""
    return default_model_path() if path is None else Path(path)
