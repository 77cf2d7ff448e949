"""The PHA's weight adapter: its checkpoints already use this project's key names (the
paper code's, ``models/pha/schema.py``), so nothing is renamed or refused; its size cannot
be read off the shapes alone (the DSS state size, the branch mix and the heads' split
need the config), so a conversion needs its ``config.json``."""

from __future__ import annotations

import numpy as np

from ...errors import ConvertError


def recognizes(keys) -> bool:
    """Whether these (prefix-free) keys look like a PHA checkpoint's."""
    return "embed.weight" in keys or any(k.startswith("blocks.") for k in keys)


def normalize(tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    return tensors


def check_supported(tensors: dict[str, np.ndarray], source: str) -> None:
    return None


def infer_config(tensors: dict[str, np.ndarray], source: str, overrides: dict | None = None):
    raise ConvertError(f"{source}: a PHA checkpoint; pass its config.json with --config")


def source_layout(model, config, raw_keys) -> str:
    return ""


__all__ = ["check_supported", "infer_config", "normalize", "recognizes", "source_layout"]
