"""Weights laid out for the PHA's whole-step decode op (mojo/pha_decode_step.mojo), made
once at load; the prefill with the Mojo ops reads its dense layers and its output layer
from the same packed matrices (mojo/linear_packed.mojo and mojo/score_head.mojo at
``matrix_offsets``).

Every matrix the op multiplies by is packed as the SRM's op packs them
(``srm.packing.pack_matrix``: panels of 64 output columns, each its [K, width]
transpose) into one flat array, ``MATS``; every vector and table it reads goes into
another, ``VECS`` (float32). ``MATS`` takes the engine's weight dtype, float32 or
bfloat16 (``matrix_names``: ``session_weights`` rounds it once at load), and the op
rounds its products as the plain bfloat16 graph does (mojo/pha_decode_step.mojo).
``layout(config)`` gives, per block, each one's element offset in its array (-1 where
a branch is off), in the op's slot order, and ``dims`` the sizes; both depend on the config only and enter the graph as constants, so one
compiled graph serves any weights of its config.
"""

from __future__ import annotations

import numpy as np

from ...graphs.pha.model import derived_name
from ...runtime.precompile import OP_WEIGHTS
from ..srm.packing import pack_matrix, padded

PREFIX = OP_WEIGHTS + "pha_step."
MATS = PREFIX + "mats"
VECS = PREFIX + "vecs"
MAX_FFN = 4
ALIGN = 32  # elements: every array starts on a cache line (64 bytes in bfloat16, two in float32)

# the op's slots per block (mojo/pha_decode_step.mojo M_* and V_*)
M_SLOTS = ["to_u", "to_v", "q", "k", "va"] + [f"fc{i}" for i in range(MAX_FFN)] + ["gate", "out", "o"] + [
    f"proj{i}" for i in range(MAX_FFN)]
V_SLOTS = ["to_v_b", "norm_w", "norm_b", "D", "out_b", "abar_re", "abar_im", "ct_re", "ct_im", "scale"] + [
    f"fc_b{i}" for i in range(MAX_FFN)] + [f"proj_b{i}" for i in range(MAX_FFN)] + [
    f"branch_norm{i}" for i in range(2 + MAX_FFN)] + ["post_w", "post_b"]
SLOTS = M_SLOTS + V_SLOTS
# dims (the op's D_*)
DIMS = ["E", "L", "V", "F", "H", "N", "Hq", "Hkv", "dh", "n", "nffn"] + [f"f{i}" for i in range(MAX_FFN)] + [
    "gss", "attn", "head", "rope"]


def supported(config) -> str | None:
    """Why the op cannot run ``config`` (None: it can)."""
    if config.mode != "parallel":
        return "the op runs the parallel block only"
    if len(config.ffn_dims) > MAX_FFN:
        return f"the op runs at most {MAX_FFN} FFN branches"
    return None


def _block(config, l: int) -> str:
    return f"blocks.{l}.branches."


# each matrix slot's checkpoint key in its block (after ``_block``)
_MATRIX_KEYS = {"to_u": "gss.to_u.weight", "to_v": "gss.to_v.weight", "gate": "gss.to_gate.weight",
                "out": "gss.to_out.weight", "q": "attn.q_proj.weight", "k": "attn.k_proj.weight",
                "va": "attn.v_proj.weight", "o": "attn.o_proj.weight"}
_MATRIX_KEYS |= {f"fc{i}": f"ffn_{i}.fc.weight" for i in range(MAX_FFN)}
_MATRIX_KEYS |= {f"proj{i}": f"ffn_{i}.proj.weight" for i in range(MAX_FFN)}


def _head_key(config) -> str:
    return "embed.weight" if config.tie_embeddings else "lm_head.weight"


def _tensors(config, l: int, full: dict) -> dict[str, np.ndarray]:
    """Block l's arrays by slot name: matrices [out, in] (torch layout), vectors flat."""
    c, b = config, _block(config, l)
    t: dict[str, np.ndarray] = {slot: full[b + key] for slot, key in _MATRIX_KEYS.items() if _present(c, slot)}
    if "gss" in c.branches:
        g = b + "gss."
        N = c.dss_state_size

        def derived(k):
            return full[derived_name(l, "gss." + k)]

        t |= {"to_v_b": full[g + "to_v.bias"], "norm_w": full[g + "dss.norm.weight"],
              "norm_b": full[g + "dss.norm.bias"], "D": full[g + "dss.param_D"], "out_b": full[g + "to_out.bias"],
              # Abar depends on the mode only: the derived tables repeat it per channel
              "abar_re": derived("abar_re")[:N], "abar_im": derived("abar_im")[:N],
              "ct_re": derived("ct_re_flat"), "ct_im": derived("ct_im_flat")}
    if "attn" in c.branches:
        t["scale"] = full[derived_name(l, "attn.scale")]
    for i in range(len(c.ffn_dims)):
        f = b + f"ffn_{i}."
        t |= {f"fc_b{i}": full[f + "fc.bias"], f"proj_b{i}": full[f + "proj.bias"]}
    for i, name in enumerate(c.branch_names):
        t[f"branch_norm{i}"] = full[derived_name(l, f"branch_norm.{name}")]
    p = f"blocks.{l}."
    t |= {"post_w": full[p + "post_norm.weight"], "post_b": full[p + "post_norm.bias"]}
    return t


def _size(config, slot: str) -> int:
    """Elements of a slot's packed array (matrices padded as ``pack_matrix`` pads them)."""
    c = config
    E, F, H, N = c.d_model, c.gss_expansion_dim, c.gss_hidden_dim, c.dss_state_size
    dq, dk = c.n_q_heads * c.head_dim, c.n_kv_heads * c.head_dim
    f = dict(enumerate(c.ffn_dims))
    shapes = {"to_u": (F, E), "to_v": (H, E), "q": (dq, E), "k": (dk, E), "va": (dk, E), "gate": (F, H),
              "out": (E, F), "o": (E, dq)}
    shapes |= {f"fc{i}": (f[i], E) for i in f} | {f"proj{i}": (E, f[i]) for i in f}
    if slot in shapes:
        out, inp = shapes[slot]
        return padded(out) * inp
    vectors = {"to_v_b": H, "norm_w": H, "norm_b": H, "D": H, "out_b": E, "abar_re": N, "abar_im": N,
               "ct_re": H * N, "ct_im": H * N, "scale": dq, "post_w": E, "post_b": E}
    vectors |= {f"fc_b{i}": f[i] for i in f} | {f"proj_b{i}": E for i in f}
    vectors |= {f"branch_norm{i}": E for i in range(c.n_branches)}
    return vectors[slot]


def _present(config, slot: str) -> bool:
    c = config
    gss = {"to_u", "to_v", "gate", "out", "to_v_b", "norm_w", "norm_b", "D", "out_b", "abar_re", "abar_im",
           "ct_re", "ct_im"}
    attn = {"q", "k", "va", "o", "scale"}
    if slot in gss:
        return "gss" in c.branches
    if slot in attn:
        return "attn" in c.branches
    for prefix in ("fc_b", "proj_b", "fc", "proj"):
        if slot.startswith(prefix) and slot[len(prefix):].isdigit():
            return int(slot[len(prefix):]) < len(c.ffn_dims)
    if slot.startswith("branch_norm"):
        return int(slot.removeprefix("branch_norm")) < c.n_branches
    return True


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(config) -> tuple[np.ndarray, np.ndarray, int, int]:
    """-> (layout [L, len(SLOTS)] int64 offsets, dims [len(DIMS)] int64, MATS size, VECS size)."""
    c = config
    lay = np.full((c.n_layers, len(SLOTS)), -1, np.int64)
    m = v = 0
    for l in range(c.n_layers):
        for j, slot in enumerate(SLOTS):
            if not _present(c, slot):
                continue
            if slot in M_SLOTS:
                lay[l, j], m = m, m + _aligned(_size(c, slot))
            else:
                lay[l, j], v = v, v + _aligned(_size(c, slot))
    head, m = m, m + _aligned(padded(c.vocab_size) * c.d_model)
    rope, v = v, v + _aligned(c.head_dim // 2)
    ffn = list(c.ffn_dims) + [0] * (MAX_FFN - len(c.ffn_dims))
    dims = [c.d_model, c.n_layers, c.vocab_size, c.gss_expansion_dim, c.gss_hidden_dim, c.dss_state_size,
            c.n_q_heads, c.n_kv_heads, c.head_dim, c.context_length, len(c.ffn_dims), *ffn,
            int("gss" in c.branches), int("attn" in c.branches), head, rope]
    return lay, np.array(dims, np.int64), m, v


def scalars(config) -> np.ndarray:
    """[eps, alpha] float32."""
    return np.array([config.norm_eps, config.deepnorm_alpha], np.float32)


def rope_frequencies(config) -> np.ndarray:
    """RoPE's inverse frequencies [dh / 2], float32 as graphs/pha/model.py's ``_Consts``."""
    half = config.head_dim // 2
    return (config.rope_base ** (-np.arange(half, dtype=np.float32) / half)).astype(np.float32)


def decode_step_weights(config, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{MATS: flat packed matrices, VECS: flat vectors} from the graphs' weights
    (checkpoint keys and ``derived_weights``), float32."""
    c = config
    lay, dims, m_size, v_size = layout(c)
    mats = np.zeros(m_size, np.float32)
    vecs = np.zeros(v_size, np.float32)
    for l in range(c.n_layers):
        t = _tensors(c, l, full)
        for j, slot in enumerate(SLOTS):
            at = int(lay[l, j])
            if at < 0:
                continue
            if slot in M_SLOTS:
                packed = pack_matrix(np.asarray(t[slot], np.float32))
                mats[at:at + packed.size] = packed
            else:
                flat = np.asarray(t[slot], np.float32).reshape(-1)
                assert flat.size == _size(c, slot), slot
                vecs[at:at + flat.size] = flat
    head = full[_head_key(c)]
    packed = pack_matrix(np.asarray(head, np.float32))
    mats[dims[DIMS.index("head")]:][:packed.size] = packed
    freq = rope_frequencies(c)
    vecs[dims[DIMS.index("rope")]:][:freq.size] = freq
    return {MATS: mats, VECS: vecs}


def matrix_offsets(config) -> dict[str, int]:
    """Where each matrix's packed copy starts in ``MATS``, by the weight's name (checkpoint
    key): what the prefill with the Mojo ops reads its dense layers and output layer from
    (graphs/ops.py ``PackedWeights``)."""
    lay, dims, _, _ = layout(config)
    offsets = {_head_key(config): int(dims[DIMS.index("head")])}
    for l in range(config.n_layers):
        for j, slot in enumerate(SLOTS):
            if slot in _MATRIX_KEYS and lay[l, j] >= 0:
                offsets[_block(config, l) + _MATRIX_KEYS[slot]] = int(lay[l, j])
    return offsets


def matrix_names() -> set[str]:
    """The packed arrays stored in the engine's weight dtype."""
    return {MATS}


# where ``op_arrays`` puts MATS
MATS_ARRAY = 1


def op_arrays(config, registry: dict) -> list:
    """The model inputs of graphs/pha/decode.py's ``build_pha_decode_steps_graph``, in its
    order: from ``registry`` (``PHAEngine``'s weights, each in its dtype there) the
    embedding and the packed matrices (at ``MATS_ARRAY``) and vectors; then the layout,
    dims and scalars."""
    offsets, dims, _, _ = layout(config)
    arrays = [registry["embed.weight"], registry[VECS], offsets, dims, scalars(config)]
    arrays.insert(MATS_ARRAY, registry[MATS])
    return arrays


__all__ = ["DIMS", "MATS", "MATS_ARRAY", "SLOTS", "VECS", "decode_step_weights", "layout", "matrix_names",
           "matrix_offsets", "op_arrays", "rope_frequencies", "scalars", "supported"]
