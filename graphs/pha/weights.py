"""The PHA graphs' weights: checkpoint keys, tensors derived at load time, the state layout.

Per-sample state, one float32 tensor ``[L, B, X]`` (so a sample is a column block
the host can copy, as for the SRM). Per layer and sample, X holds, flat and in this
order (a branch that is off takes no room):

    gss    [2, H, N]          the DSS state as real pairs: real parts, then imaginary
    keys   [Hkv, n, dh]       normalised, rotated keys, preallocated to the context n
    values [Hkv, n, dh]

(one unused column if the model has neither GSS nor attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from max.graph import Weight

from ..ops import NamedWeights

# GSS prefill chunk (tokens). The chunked scan costs O(T C H) inside chunks and
# O((T / C)**2 N H) between them; 64 balances the two at T = 8192, N = 512.
CHUNK = 64


def n_chunks(config) -> int:
    """Chunks of the longest prompt: ceil(n / CHUNK)."""
    return -(-config.context_length // CHUNK)


@dataclass(frozen=True)
class StateLayout:
    """Column ranges of one layer's state in the flat ``[L, B, X]`` tensor."""

    gss: int  # 2 * H * N (0 without GSS)
    kv: int  # Hkv * n * dh per cache (0 without attention)

    @classmethod
    def of(cls, config) -> "StateLayout":
        c = config
        gss = 2 * c.gss_hidden_dim * c.dss_state_size if "gss" in c.branches else 0
        kv = c.n_kv_heads * c.context_length * c.head_dim if "attn" in c.branches else 0
        return cls(gss, kv)

    @property
    def width(self) -> int:
        return max(1, self.gss + 2 * self.kv)

    @property
    def keys(self) -> slice:
        return slice(self.gss, self.gss + self.kv)

    @property
    def values(self) -> slice:
        return slice(self.gss + self.kv, self.gss + 2 * self.kv)


def _block_prefix(l: int) -> str:
    return f"blocks.{l}."


def derived_name(l: int, what: str) -> str:
    return f"pha_derived.{l}.{what}"


def matrix_names(config) -> list[str]:
    """Checkpoint keys of the big matrices (stored in the weight dtype)."""
    c = config
    names = ["embed.weight"] + ([] if c.tie_embeddings else ["lm_head.weight"])
    for l in range(c.n_layers):
        b = _block_prefix(l) + "branches."
        if "gss" in c.branches:
            names += [b + f"gss.{m}.weight" for m in ("to_u", "to_v", "to_gate", "to_out")]
        if "attn" in c.branches:
            names += [b + f"attn.{m}_proj.weight" for m in "qkvo"]
        for i in range(len(c.ffn_dims)):
            names += [b + f"ffn_{i}.fc.weight", b + f"ffn_{i}.proj.weight"]
    return names


def graph_weight_names(config) -> list[str]:
    """Checkpoint keys the graphs read as they are (the rest enter only derived)."""
    c = config
    names = matrix_names(c)
    for l in range(c.n_layers):
        p = _block_prefix(l)
        b = p + "branches."
        if "gss" in c.branches:
            names += [b + "gss.to_v.bias", b + "gss.dss.norm.weight", b + "gss.dss.norm.bias",
                      b + "gss.dss.param_D", b + "gss.to_out.bias"]
        for i in range(len(c.ffn_dims)):
            names += [b + f"ffn_{i}.fc.bias", b + f"ffn_{i}.proj.bias"]
        if c.mode == "parallel":
            names += [p + "post_norm.weight", p + "post_norm.bias"]
        else:
            for name in c.branch_names:
                names += [p + f"branch_norms.{name}.weight", p + f"post_norms.{name}.weight",
                          p + f"post_norms.{name}.bias"]
    return names


def _pairs(z: np.ndarray) -> np.ndarray:
    """complex [..., N] -> real [..., 2N]: real parts, then imaginary parts."""
    return np.concatenate([z.real, z.imag], axis=-1)


def gss_tables(config, lam: np.ndarray, ct: np.ndarray) -> dict[str, np.ndarray]:
    """The GSS tensors of one layer, from Lambda [N] and Ct [H, N] (complex128).

    Decode (per flat (h, n) channel [H*N]): abar_re, abar_im, ct_re_flat, ct_im_flat.
    Chunked prefill (C = CHUNK, A = Abar = exp(Lambda), pairs: [re | im] on the last axis):
      ct_t_re, ct_t_im [N, H]   Ct transposed
      kin    [H, C, C]   K[i - j, h] for j <= i, else 0; K[k, h] = Re(sum_n Ct A**k)
      p_end  [C, 2N]     A**(C-1-j): a chunk's inputs -> its final local state
      p_out  [C, 2N]     (Re, -Im) of A**(j+1): the entering state's share of y at offset j
      p_chunk [K+1, 2N]  A**(C k), k < K = ceil(n / C), then a zero row
      p_step [C+2, 2N]   A**k, k <= C, then a zero row
    """
    C, H = CHUNK, ct.shape[0]
    k = np.arange(C + 1)
    powers = np.exp(np.outer(k, lam))  # [C+1, N]: A**k
    K = (powers[:C] @ ct.T).real  # [C, H]
    gap = np.arange(C)[:, None] - np.arange(C)[None, :]
    kin = np.where(gap >= 0, K[np.maximum(gap, 0)].transpose(2, 0, 1), 0.0)  # [H, C, C]
    p_out = np.concatenate([powers[1:].real, -powers[1:].imag], axis=1)
    chunk_powers = np.exp(np.outer(np.arange(n_chunks(config)) * C, lam))
    zero = np.zeros((1, 2 * lam.shape[0]))
    abar = np.exp(lam)
    return {
        "abar_re": np.tile(abar.real, H), "abar_im": np.tile(abar.imag, H),
        "ct_re_flat": ct.real.reshape(-1), "ct_im_flat": ct.imag.reshape(-1),
        "ct_t_re": ct.real.T, "ct_t_im": ct.imag.T,
        "kin": kin, "p_end": _pairs(powers[C - 1 :: -1][:C]), "p_out": p_out,
        "p_chunk": np.concatenate([_pairs(chunk_powers), zero]),
        "p_step": np.concatenate([_pairs(powers), zero]),
    }


def gss_table_shapes(config) -> dict[str, list[int]]:
    c = config
    H, N, C = c.gss_hidden_dim, c.dss_state_size, CHUNK
    return {"abar_re": [H * N], "abar_im": [H * N], "ct_re_flat": [H * N], "ct_im_flat": [H * N],
            "ct_t_re": [N, H], "ct_t_im": [N, H], "kin": [H, C, C], "p_end": [C, 2 * N],
            "p_out": [C, 2 * N], "p_chunk": [n_chunks(c) + 1, 2 * N], "p_step": [C + 2, 2 * N]}


def derived_weights(config, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host-side tensors computed from the checkpoint at load time (float64 math, float32 out).

    gss: ``gss_tables`` (Lambda = -exp(Lambda_real) + i exp(Lambda_imag), Ct = C (Abar - 1) / Lambda);
         every power of Abar the graphs use comes from here, so long-range phases keep
         float64 accuracy.
    attn: scale [Hq*dh], exp(min(logit_scale, log max)) repeated over each head's channels.
    parallel mode: branch_norm.{name} [E] = w_i * RMSNorm_i.weight, the mixing weight
         w = softplus(p) / sum(softplus(p)) folded into the branch's norm.
    """
    c = config
    out: dict[str, np.ndarray] = {}
    for l in range(c.n_layers):
        p = _block_prefix(l)
        b = p + "branches."
        if "gss" in c.branches:
            d = b + "gss.dss."
            lam = -np.exp(weights[d + "Lambda_real"].astype(np.float64)) + 1j * np.exp(
                weights[d + "Lambda_imag"].astype(np.float64))
            ct = (weights[d + "C_real"].astype(np.float64) + 1j * weights[d + "C_imag"]) * (np.exp(lam) - 1) / lam
            out |= {derived_name(l, "gss." + k): v for k, v in gss_tables(c, lam, ct).items()}
        if "attn" in c.branches:
            s = weights[b + "attn.logit_scale"].astype(np.float64)
            scale = np.exp(np.minimum(s, math.log(c.logit_scale_max)))
            out[derived_name(l, "attn.scale")] = np.repeat(scale, c.head_dim)
        if c.mode == "parallel":
            m = weights[p + "mixing"].astype(np.float64)
            soft = np.logaddexp(0.0, m)  # softplus
            mix = soft / soft.sum()
            for i, name in enumerate(c.branch_names):
                out[derived_name(l, f"branch_norm.{name}")] = mix[i] * weights[p + f"branch_norms.{name}.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


class PHAWeights(NamedWeights):
    """The PHA graph's named weights."""

    def embedding(self) -> Weight:
        c = self.config
        return self.matrix("embed.weight", [c.vocab_size, c.d_model])

    def output(self) -> Weight:
        c = self.config
        return self.embedding() if c.tie_embeddings else self.matrix("lm_head.weight", [c.vocab_size, c.d_model])

    def gss(self, l: int) -> dict:
        c = self.config
        E, F, H = c.d_model, c.gss_expansion_dim, c.gss_hidden_dim
        b = _block_prefix(l) + "branches.gss."
        g = {
            "to_u": self.matrix(b + "to_u.weight", [F, E]),
            "to_v": self.matrix(b + "to_v.weight", [H, E]),
            "to_v_b": self.get(b + "to_v.bias", [H]),
            "norm_w": self.get(b + "dss.norm.weight", [H]),
            "norm_b": self.get(b + "dss.norm.bias", [H]),
            "D": self.get(b + "dss.param_D", [H]),
            "to_gate": self.matrix(b + "to_gate.weight", [F, H]),
            "to_out": self.matrix(b + "to_out.weight", [E, F]),
            "to_out_b": self.get(b + "to_out.bias", [E]),
        }
        for k, shape in gss_table_shapes(c).items():
            g[k] = self.get(derived_name(l, "gss." + k), shape)
        return g

    def attn(self, l: int) -> dict:
        c = self.config
        E, dq, dk = c.d_model, c.n_q_heads * c.head_dim, c.n_kv_heads * c.head_dim
        b = _block_prefix(l) + "branches.attn."
        return {
            "q": self.matrix(b + "q_proj.weight", [dq, E]),
            "k": self.matrix(b + "k_proj.weight", [dk, E]),
            "v": self.matrix(b + "v_proj.weight", [dk, E]),
            "o": self.matrix(b + "o_proj.weight", [E, dq]),
            "scale": self.get(derived_name(l, "attn.scale"), [dq]),
        }

    def ffn(self, l: int, i: int) -> dict:
        c = self.config
        E, f = c.d_model, c.ffn_dims[i]
        b = _block_prefix(l) + f"branches.ffn_{i}."
        return {"fc": self.matrix(b + "fc.weight", [f, E]), "fc_b": self.get(b + "fc.bias", [f]),
                "proj": self.matrix(b + "proj.weight", [E, f]), "proj_b": self.get(b + "proj.bias", [E])}

    def branch_norm(self, l: int, name: str) -> Weight:
        E = self.config.d_model
        if self.config.mode == "parallel":
            return self.get(derived_name(l, f"branch_norm.{name}"), [E])
        return self.get(_block_prefix(l) + f"branch_norms.{name}.weight", [E])

    def post_norm(self, l: int, name: str) -> tuple[Weight, Weight]:
        E, p = self.config.d_model, _block_prefix(l)
        key = "post_norm" if self.config.mode == "parallel" else f"post_norms.{name}"
        return self.get(p + key + ".weight", [E]), self.get(p + key + ".bias", [E])
