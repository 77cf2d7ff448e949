"""Reading a model's ``config.json`` into its config dataclass, with errors that name
the file and the field."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

from ..errors import CheckpointError


def dataclass_from_dict(cls, data, source: str):
    """Build a config dataclass from JSON data, naming unknown, missing and bad fields."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CheckpointError(f"{source}: unknown config field(s) {unknown}")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
    if required:
        raise CheckpointError(f"{source}: missing config field(s) {required}")
    try:
        return cls(**data)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None


def read_json(path: str | Path):
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: config file not found") from None
    except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError and Unicode
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


__all__ = ["dataclass_from_dict", "read_json"]
