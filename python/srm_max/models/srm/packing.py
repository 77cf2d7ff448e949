"""Weights laid out for the whole-step decode op (mojo/decode_step.mojo), made once at load.

The op streams each matrix as panels of PANEL output columns: a [N, K] matrix
(torch layout, out x in) gets its rows padded with zeros to a multiple of PAD and
is stored panel after panel, each panel its [K, width] transpose, row-major. The
layers' small tensors are stacked into one array each, so the op takes a fixed
number of inputs whatever the depth.
"""

from __future__ import annotations

import numpy as np

from ...runtime.precompile import OP_WEIGHTS
from . import schema

PANEL = 64
PAD = 16
PREFIX = OP_WEIGHTS + "decode_step."
# the packed (big) matrices: stored in the engine's weight dtype
MATRICES = ("fc1", "fc2", "proj", "out", "head")


def padded(n: int) -> int:
    return -(-n // PAD) * PAD


def pack_matrix(w: np.ndarray) -> np.ndarray:
    """[N, K] -> flat [padded(N) * K] in panels of PANEL columns (see the module doc)."""
    N, K = w.shape
    full = np.zeros((padded(N), K), np.float32)
    full[:N] = w
    return np.concatenate([full[q:q + PANEL].T.reshape(-1) for q in range(0, len(full), PANEL)])


# the layer matrices the op packs, by the role ``schema.layer_tensors`` gives each
LAYER_MATRICES = {"fc1": "fc1_w", "fc2": "fc2_w", "proj": "proj_w", "out": "out_w"}


def packed_copies(config) -> dict[str, tuple[str, list[int], int]]:
    """Where the op's packed copy of each matrix lies, by the matrix's own weight name:
    (the packed weight's name, its shape, the copy's offset in it flattened). The prefill's
    dense layers and its scored rows' output layer read them there (graphs/ops.py
    ``PackedWeights``)."""
    shape_of = shapes(config)
    copies = {}
    for l in range(config.n_layers):
        tensors = schema.layer_tensors(config, l)
        for kind, role in LAYER_MATRICES.items():
            name = PREFIX + kind
            copies[tensors[role].name] = (name, shape_of[name], l * shape_of[name][1])
    copies[schema.OUTPUT] = (PREFIX + "head", shape_of[PREFIX + "head"], 0)
    return copies


# the op's weight inputs, in its argument order
INPUTS = ("norms", "fc1_b", "biases", "w", "beta", "lam", "fc1", "fc2", "proj", "out", "head")


def shapes(config) -> dict[str, list[int]]:
    """name -> shape of every tensor the op reads besides the activations and states,
    in INPUTS order."""
    c = config
    L, d, f, H, n = c.n_layers, c.d_model, c.ffn_dim, c.n_heads, c.context_length
    D = padded(d)
    by_input = {"norms": [L, 4, d], "fc1_b": [L, f], "biases": [L, 3, d],
                "w": [L, H, n], "beta": [L, H, n], "lam": [L, H],
                "fc1": [L, padded(f) * d], "fc2": [L, D * f], "proj": [L, D * d], "out": [L, D * d],
                "head": [padded(c.vocab_size) * d]}
    return {PREFIX + k: by_input[k] for k in INPUTS}


def matrix_names() -> set[str]:
    return {PREFIX + k for k in MATRICES}


def step_tensors(layers: list[dict], head_w: np.ndarray) -> dict[str, np.ndarray]:
    """The op's tensors (float32, keyed by INPUTS) from one dict per layer: cn_w, cn_b,
    fc1_w, fc1_b, fc2_w, fc2_b, tn_w, tn_b, proj_w, proj_b, out_w, out_b (torch layout),
    w, beta [H, n] and lam [H] (the decay per step); head_w [V, d]."""
    def stack(fn):
        return np.stack([fn(p) for p in layers])

    out = {
        "norms": stack(lambda p: np.stack([p["cn_w"], p["cn_b"], p["tn_w"], p["tn_b"]])),
        "fc1_b": stack(lambda p: p["fc1_b"]),
        "biases": stack(lambda p: np.stack([p["fc2_b"], p["proj_b"], p["out_b"]])),
        "w": stack(lambda p: p["w"]), "beta": stack(lambda p: p["beta"]), "lam": stack(lambda p: p["lam"]),
        **{kind: stack(lambda p, role=role: pack_matrix(p[role])) for kind, role in LAYER_MATRICES.items()},
        "head": pack_matrix(np.asarray(head_w, np.float32)),
    }
    return {k: np.ascontiguousarray(out[k], dtype=np.float32) for k in INPUTS}


def decode_step_weights(config, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The op's tensors (named as the graph's weights) from ``schema.graph_weights``."""
    def layer(l):
        t = {role: full[tensor.name] for role, tensor in schema.layer_tensors(config, l).items()}
        return t | {"w": t["w"].T, "beta": t["beta"].T, "lam": np.exp(t["loglam"].astype(np.float64))}

    tensors = step_tensors([layer(l) for l in range(config.n_layers)], full[schema.OUTPUT])
    return {PREFIX + k: v for k, v in tensors.items()}


def packed_inputs(config) -> list[tuple[str, list[int], bool]]:
    """(name, shape, big matrix?) of the op's weight inputs, in its argument order."""
    matrices = matrix_names()
    return [(name, shape, name in matrices) for name, shape in shapes(config).items()]
