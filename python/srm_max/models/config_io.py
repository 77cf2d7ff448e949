"""Reading a model's ``config.json`` into its config dataclass, with errors that name
the file and the field; and writing one, atomically."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from dataclasses import MISSING, fields
from pathlib import Path

from ..errors import CheckpointError, SRMError
from ..files import atomic_write_text, check_regular_file


def unknown_fields(cls, keys: Iterable[str]) -> str | None:
    """None when every key is a field of the config dataclass ``cls``; else the unknown ones
    named, with the nearest known field where one is close (a typo) and every known field."""
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(keys) - set(known))
    if not unknown:
        return None
    close = [match for key in unknown for match in difflib.get_close_matches(key, known, n=1)]
    hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
    return f"unknown config field(s) {unknown} ({hint}known: {', '.join(known)})"


def dataclass_from_dict(cls, data, source: str):
    """Build a config dataclass from JSON data, naming unknown, missing and bad fields."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(data).__name__}")
    problem = unknown_fields(cls, data)
    if problem:
        raise CheckpointError(f"{source}: {problem}")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
    if required:
        raise CheckpointError(f"{source}: missing config field(s) {required}")
    try:
        return cls(**data)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None


# A config.json is a few hundred bytes: a file over this is no config, and is not read whole.
CONFIG_LIMIT = 1 << 20


def read_json(path: str | Path, error: type[SRMError] = CheckpointError):
    """The JSON value in the config file ``path``; ``error`` naming the file when it is missing,
    unreadable, not a regular file, over ``CONFIG_LIMIT`` bytes or not JSON."""
    path = Path(path)
    check_regular_file(path, error)
    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_LIMIT + 1)
    except FileNotFoundError:
        raise error(f"{path}: config file not found") from None
    except OSError as e:  # no permission to read it, an I/O error
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) > CONFIG_LIMIT:
        raise error(f"{path}: over {CONFIG_LIMIT >> 20} MiB, too large for a config file")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError and Unicode
        raise error(f"{path}: not valid JSON ({e})") from None


def write_config(data: dict, path: str | Path) -> None:
    """``data`` as a config.json at ``path``, atomically: a process killed while writing leaves the
    old file or the new one (a resumed training run checks its arguments against it)."""
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


__all__ = ["CONFIG_LIMIT", "dataclass_from_dict", "read_json", "unknown_fields", "write_config"]
