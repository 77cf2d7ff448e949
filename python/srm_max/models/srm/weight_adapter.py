"""The SRM's weight adapter: the paper code's (``blbadger/mrm`` ``MLPMixer``) checkpoint
keys -> this project's names, the paper's token mixers that cannot be served, the config
read off the shapes, and the source's own module layout for the parity certificate.

``checkpoints/convert.py`` asks the registry for an architecture's adapter and calls these;
wrapper prefixes (DDP's ``module.``, torch.compile's ``_orig_mod.``) are not the SRM's
business and stay there.

Key mapping (``normalize``):
  * a dropout layer in the channel MLP moves ``channel_mixing_layer.2`` to ``.3``: mapped back;
  * no ``decay_value`` keys means a model without decay (lam = 1).

Only the paper code's mixed heads with per-head projections can be served. Its other
token mixers (``parallel_heads``, ``use_projections=False``, ``combined_heads``,
``heads=None``, ``kernel>1``) are recognised by their keys and refused by name
(``check_supported``). Its default ``RepeatHeads`` (every head column-repeat, no decay)
has exactly the keys and shapes of mixed heads without decay, so nothing tells them
apart: a checkpoint without decay is taken to be mixed heads.
"""

from __future__ import annotations

import re

import numpy as np

from ...errors import CheckpointError, ConvertError
from .config import SRMConfig

_BLOCK = re.compile(r"^mixer_blocks\.(\d+)\.")
_TOKEN_MIXER = re.compile(r"^mixer_blocks\.(\d+)\.token_mixing_layer\.(.+)$")
_HEAD = re.compile(r"^mixer_blocks\.0\.token_mixing_layer\.proj_head\.(\d+)\.weight$")
_DROPOUT_MLP = ".channel_mixing_layer.3."


def recognizes(keys) -> bool:
    """Whether these (prefix-free) keys look like an SRM checkpoint's."""
    return any(_BLOCK.match(k) for k in keys) or "input_layer.weight" in keys


def normalize(tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """The paper code's channel MLP with dropout (Linear, SiLU, Dropout, Linear) mapped to
    the project's (Linear, SiLU, Linear)."""
    if not any(_DROPOUT_MLP in k for k in tensors):
        return tensors
    if any(".channel_mixing_layer.2." in k for k in tensors):
        raise ConvertError(f"{source}: both channel_mixing_layer.2 and .3 present; cannot map the channel MLP")
    return {k.replace(_DROPOUT_MLP, ".channel_mixing_layer.2."): v for k, v in tensors.items()}


def check_supported(tensors: dict[str, np.ndarray], source: str) -> None:
    """Refuse, by name, the paper code's token mixers that are not mixed heads with projections.

    Their keys (``mixer_blocks.{l}.token_mixing_layer.*``, after ``normalize``):
      parallel_heads          in_proj.*, mixer_heads.weight [H, n] (one module for all heads)
      combined_heads          mixer_heads.{h}.weight [2, n] (a row and a column vector per head)
      use_projections=False   mixer_heads.{h}.* without proj_head.* (heads are channel slices)
      heads=None              weight [1, n], bias [n] (one row-repeat mixer over all channels)
      kernel>1 (heads=None)   weight [k, n], k > 1 (KernelRepeatLinear)
    """
    found: dict[str, str] = {}  # variant -> the first key that shows it
    with_projections = {  # layers that have per-head input projections
        m.group(1) for k in tensors if (m := _TOKEN_MIXER.match(k)) and m.group(2).startswith("proj_head.")
    }
    for key, value in tensors.items():
        if not (m := _TOKEN_MIXER.match(key)):
            continue
        layer, rest = m.groups()
        if rest.startswith("in_proj.") or rest in ("mixer_heads.weight", "mixer_heads.bias", "mixer_heads.decay_value"):
            found.setdefault("parallel_heads", key)
        elif re.fullmatch(r"mixer_heads\.\d+\.weight", rest):
            if value.ndim == 2 and value.shape[0] == 2:
                found.setdefault("combined_heads", key)
            if layer not in with_projections:
                found.setdefault("use_projections=False", key)
        elif rest == "weight":
            found.setdefault("kernel>1" if value.ndim == 2 and value.shape[0] > 1 else "heads=None", key)
    if found:
        named = ", ".join(f"{variant} (key {key!r})" for variant, key in found.items())
        verb = "variants are" if len(found) > 1 else "variant is"
        raise ConvertError(
            f"{source}: the paper code's {named} {verb} not supported: only mixed heads with per-head "
            "projections (proj_head.{h}, mixer_heads.{h}, out_proj) can be converted"
        )


def infer_config(tensors: dict[str, np.ndarray], source: str, overrides: dict | None = None) -> SRMConfig:
    """V, d, L, H, n, FFN expansion and decay from the shapes; ``overrides`` win."""

    def shape(key: str, rank: int) -> tuple[int, ...]:
        if key not in tensors:
            raise ConvertError(f"{source}: missing key {key!r}; cannot infer the model's size")
        if tensors[key].ndim != rank or 0 in tensors[key].shape:
            raise ConvertError(f"{source}: {key!r} has shape {list(tensors[key].shape)}; expected {rank} non-empty dims")
        return tensors[key].shape

    vocab, d = shape("input_layer.weight", 2)
    layers = {int(m.group(1)) for k in tensors if (m := _BLOCK.match(k))}
    heads = {int(m.group(1)) for k in tensors if (m := _HEAD.match(k))}
    if not layers:
        raise ConvertError(f"{source}: no mixer_blocks.* keys; not an SRM checkpoint")
    if not heads:
        raise ConvertError(f"{source}: missing key 'mixer_blocks.0.token_mixing_layer.proj_head.0.weight'")
    ffn = shape("mixer_blocks.0.channel_mixing_layer.0.weight", 2)[0]
    n = shape("mixer_blocks.0.token_mixing_layer.mixer_heads.0.weight", 2)[-1]
    values = {
        "vocab_size": vocab,
        "d_model": d,
        "n_layers": max(layers) + 1,
        "n_heads": max(heads) + 1,
        "context_length": n,
        "ffn_expansion": max(1, ffn // d),
        "decay": any(k.endswith(".decay_value") for k in tensors),
    }
    values |= overrides or {}
    try:
        return SRMConfig(**values)
    except (CheckpointError, TypeError) as e:
        raise ConvertError(f"{source}: {e}") from None


def source_layout(model, config: SRMConfig, raw_keys) -> str:
    """Rebuild ``model`` (the reference, on the meta device) in the source's module layout
    where it differs from ours: the dropout channel MLP. Returns what was changed ("" for
    nothing), for the parity certificate's description."""
    if not any(_DROPOUT_MLP in key for key in raw_keys):
        return ""
    import torch.nn as nn

    for block in model.mixer_blocks:
        block.channel_mixing_layer = nn.Sequential(
            nn.Linear(config.d_model, config.ffn_dim), nn.SiLU(), nn.Dropout(0.0),
            nn.Linear(config.ffn_dim, config.d_model))
    return " with the dropout channel MLP (Linear, SiLU, Dropout, Linear)"


__all__ = ["check_supported", "infer_config", "normalize", "recognizes", "source_layout"]
