"""Weights laid out for the whole-step decode op (mojo/decode_step.mojo), made once at load.

The op streams each matrix as panels of PANEL output columns: a [N, K] matrix
(torch layout, out x in) gets its rows padded with zeros to a multiple of PAD and
is stored panel after panel, each panel its [K, width] transpose, row-major. The
layers' small tensors are stacked into one array each, so the op takes a fixed
number of inputs whatever the depth.
"""

from __future__ import annotations

import numpy as np

from .graphs.layers import derived_name

PANEL = 64
PAD = 16
PREFIX = "decode_step."
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


def shapes(config) -> dict[str, list[int]]:
    """name -> shape of every tensor the op reads besides the activations and states."""
    c = config
    L, d, f, H, n = c.n_layers, c.d_model, c.ffn_dim, c.n_heads, c.context_length
    D = padded(d)
    return {PREFIX + k: s for k, s in {
        "norms": [L, 4, d], "fc1_b": [L, f], "biases": [L, 3, d],
        "w": [L, H, n], "beta": [L, H, n], "lam": [L, H],
        "fc1": [L, padded(f) * d], "fc2": [L, D * f], "proj": [L, D * d], "out": [L, D * d],
        "head": [padded(c.vocab_size) * d]}.items()}


def matrix_names() -> set[str]:
    return {PREFIX + k for k in MATRICES}


def decode_step_weights(config, weights: dict[str, np.ndarray], derived: dict[str, np.ndarray]
                        ) -> dict[str, np.ndarray]:
    """The op's tensors (float32) from the checkpoint and ``layers.derived_weights``."""
    c = config
    L = range(c.n_layers)

    def key(l, k):
        return f"mixer_blocks.{l}.{k}"

    def stack(fn):
        return np.stack([fn(l) for l in L])

    out = {
        "norms": stack(lambda l: np.stack([weights[key(l, k)] for k in (
            "channel_norm.weight", "channel_norm.bias", "token_norm.weight", "token_norm.bias")])),
        "fc1_b": stack(lambda l: weights[key(l, "channel_mixing_layer.0.bias")]),
        "biases": stack(lambda l: np.stack([weights[key(l, "channel_mixing_layer.2.bias")],
                                            derived[derived_name(l, "proj.bias")],
                                            weights[key(l, "token_mixing_layer.out_proj.bias")]])),
        "w": stack(lambda l: derived[derived_name(l, "mixer.w")].T),
        "beta": stack(lambda l: derived[derived_name(l, "mixer.beta")].T),
        "lam": stack(lambda l: np.exp(derived[derived_name(l, "mixer.loglam")].astype(np.float64))),
        "fc1": stack(lambda l: pack_matrix(weights[key(l, "channel_mixing_layer.0.weight")])),
        "fc2": stack(lambda l: pack_matrix(weights[key(l, "channel_mixing_layer.2.weight")])),
        "proj": stack(lambda l: pack_matrix(derived[derived_name(l, "proj.weight")])),
        "out": stack(lambda l: pack_matrix(weights[key(l, "token_mixing_layer.out_proj.weight")])),
        "head": pack_matrix(weights["output_layer.weight"]),
    }
    return {PREFIX + k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
