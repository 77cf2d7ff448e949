"""The SRM weight schema: the one place the model's tensor names are written.

Checkpoint keys are the paper code's (``MLPMixer``: ``mixer_blocks.{l}...``). The
graphs read most of them as they are, plus tensors derived from them on the host
at load time (``derived_weights``): the H head projections stacked into one
matrix and the mixer vectors laid out per position. ``layer_tensors`` names each
tensor a layer's graph reads by its role (``cn_w``, ``proj_w``, ``w``, ...); the
graph builders in ``graphs/srm`` and the decode op's packing take names from it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

EMBEDDING = "input_layer.weight"
OUTPUT = "output_layer.weight"


class Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]
    matrix: bool  # a big matrix: stored in the engine's weight dtype (float32 or bfloat16)


def layer_prefix(l: int) -> str:
    return f"mixer_blocks.{l}."


def _mixing(l: int) -> str:
    return layer_prefix(l) + "token_mixing_layer."


# role -> (key under the layer prefix, shape from (d, f), big matrix?): read as stored
_STORED = {
    "cn_w": ("channel_norm.weight", lambda d, f: (d,), False),
    "cn_b": ("channel_norm.bias", lambda d, f: (d,), False),
    "fc1_w": ("channel_mixing_layer.0.weight", lambda d, f: (f, d), True),
    "fc1_b": ("channel_mixing_layer.0.bias", lambda d, f: (f,), False),
    "fc2_w": ("channel_mixing_layer.2.weight", lambda d, f: (d, f), True),
    "fc2_b": ("channel_mixing_layer.2.bias", lambda d, f: (d,), False),
    "tn_w": ("token_norm.weight", lambda d, f: (d,), False),
    "tn_b": ("token_norm.bias", lambda d, f: (d,), False),
    "out_w": ("token_mixing_layer.out_proj.weight", lambda d, f: (d, d), True),
    "out_b": ("token_mixing_layer.out_proj.bias", lambda d, f: (d,), False),
}


def layer_tensors(config, l: int) -> dict[str, Tensor]:
    """Every tensor layer ``l``'s graphs read, by role (stored and derived)."""
    c = config
    d, f, n, H = c.d_model, c.ffn_dim, c.context_length, c.n_heads
    out = {role: Tensor(layer_prefix(l) + key, shape(d, f), matrix) for role, (key, shape, matrix) in _STORED.items()}
    m = _mixing(l)
    out |= {
        "proj_w": Tensor(m + "proj.weight", (d, d), True),  # the heads' projections stacked (out x in)
        "proj_b": Tensor(m + "proj.bias", (d,), False),
        "w": Tensor(m + "mixer.w", (n, H), False),  # mixer vectors per position, a column per head
        "beta": Tensor(m + "mixer.beta", (n, H), False),
        "loglam": Tensor(m + "mixer.loglam", (H,), False),  # log of the decay per step (0 without decay)
    }
    return out


def _head_shapes(config, l: int) -> dict[str, tuple[int, ...]]:
    c, m = config, _mixing(l)
    shapes = {}
    for h in range(c.n_heads):
        shapes |= {m + f"proj_head.{h}.weight": (c.head_dim, c.d_model), m + f"proj_head.{h}.bias": (c.head_dim,),
                   m + f"mixer_heads.{h}.weight": (1, c.context_length), m + f"mixer_heads.{h}.bias": (c.context_length,)}
        if c.decay:
            shapes[m + f"mixer_heads.{h}.decay_value"] = (1,)
    return shapes


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by checkpoint key, with its shape."""
    c = config
    shapes = {EMBEDDING: (c.vocab_size, c.d_model), OUTPUT: (c.vocab_size, c.d_model)}
    for l in range(c.n_layers):
        shapes |= {t.name: t.shape for role, t in layer_tensors(c, l).items() if role in _STORED}
        shapes |= _head_shapes(c, l)
    return shapes


def derived_weights(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The derived tensors of ``layer_tensors`` from the checkpoint's (float32)."""
    c = config
    out = {}
    heads = range(c.n_heads)
    for l in range(c.n_layers):
        t, m = layer_tensors(c, l), _mixing(l)
        out[t["proj_w"].name] = np.concatenate([weights[f"{m}proj_head.{h}.weight"] for h in heads], 0)
        out[t["proj_b"].name] = np.concatenate([weights[f"{m}proj_head.{h}.bias"] for h in heads], 0)
        out[t["w"].name] = np.stack([weights[f"{m}mixer_heads.{h}.weight"].reshape(-1) for h in heads], 1)
        out[t["beta"].name] = np.stack([weights[f"{m}mixer_heads.{h}.bias"].reshape(-1) for h in heads], 1)
        if c.decay:
            decay = np.array([float(weights[f"{m}mixer_heads.{h}.decay_value"].reshape(-1)[0]) for h in heads])
            loglam = np.log(np.clip(decay, 0.9, 1.0) ** (1.0 / c.decay_constant))
        else:
            loglam = np.zeros(c.n_heads)
        out[t["loglam"].name] = loglam
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def graph_weights(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """name -> array of every tensor the graphs read: stored ones and derived ones."""
    full = {k: np.asarray(weights[k]) for k in (EMBEDDING, OUTPUT)}
    for l in range(config.n_layers):
        full |= {t.name: np.asarray(weights[t.name])
                 for role, t in layer_tensors(config, l).items() if role in _STORED}
    return full | derived_weights(config, weights)


def matrix_names(config) -> set[str]:
    """The big matrices (stored in the engine's weight dtype)."""
    names = {EMBEDDING, OUTPUT}
    for l in range(config.n_layers):
        names |= {t.name for t in layer_tensors(config, l).values() if t.matrix}
    return names


__all__ = ["EMBEDDING", "OUTPUT", "Tensor", "checkpoint_shapes", "derived_weights", "graph_weights",
           "layer_prefix", "layer_tensors", "matrix_names"]
