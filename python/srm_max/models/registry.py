"""The model registry: an architecture name -> everything the package needs for it.

Every choice that depends on the architecture is a lookup here; a new architecture
is a folder ``models/<name>/`` with an ``arch.py`` and one line below.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from .architecture import Architecture
from .config_io import read_json
from .pha.arch import PHA_ARCH
from .srm.arch import SRM_ARCH

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (SRM_ARCH, PHA_ARCH)}
DEFAULT = SRM_ARCH.name  # config.json files without an ``architecture`` field are the paper's SRMs


def get(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unknown architecture {name!r} (known: {', '.join(ARCHITECTURES)})") from None


def of(config) -> Architecture:
    """The architecture of a config object."""
    return get(config.architecture)


def recognize(keys) -> Architecture | None:
    """The architecture whose checkpoints have keys like these (wrapper prefixes removed),
    or None."""
    keys = set(keys)
    return next((arch for arch in ARCHITECTURES.values() if arch.weight_adapter.recognizes(keys)), None)


def names() -> tuple[str, ...]:
    """Every architecture's name, as config.json spells it."""
    return tuple(ARCHITECTURES)


def config_from_dict(data, source: str = "config"):
    """The config of the architecture named by the ``architecture`` field (default: srm)."""
    name = data.get("architecture", DEFAULT) if isinstance(data, dict) else DEFAULT
    try:
        arch = get(name)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None
    return arch.config.from_dict(data, source)


def load_config(path: str | Path):
    """Read any architecture's ``config.json``."""
    return config_from_dict(read_json(path), source=str(path))


__all__ = ["ARCHITECTURES", "DEFAULT", "config_from_dict", "get", "load_config", "names", "of", "recognize"]
