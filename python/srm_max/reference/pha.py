"""The Parallel Hybrid Architecture (PHA) in plain PyTorch: the ground truth.

Reads like ``docs/pha.md``:

    x = embed[ids]
    for each block:
        b = [gss(x), attn(x), ffn_0(x), ffn_1(x)]        # the enabled branches
        b = [RMSNorm_i(b_i) for each branch]
        w = softplus(p) / sum(softplus(p))                # learnable, equal at init
        x = LayerNorm(alpha * x + sum_i w_i b_i)          # DeepNorm, alpha = (2L)**0.25
    logits = x @ embed.T                                  # or lm_head, if untied

``mode = "sequential"`` (ablation) runs the branches one after another instead,
each its own residual sub-layer: x = LayerNorm_i(alpha x + RMSNorm_i(branch_i(x))).
In both modes alpha and beta count blocks (L), as DeepNet counts a block of two
sub-layers as one layer.

``forward`` runs whole sequences (GSS as an FFT convolution, causal attention);
``prefill`` + ``step`` are the decode path, with a :class:`PHACache`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.pha.config import PHAConfig
from .attention import GQA
from .gss import GSS, state_dtypes


@dataclass
class PHACache:
    """Decode state of every layer, as explicit buffers (None where the branch is off).

    gss_state  [L, B, H, N]        complex64 (complex128 for a float64 model): s after
                                   the last token seen, whatever the model's dtype
    keys       [L, B, Hkv, n, dh]  normalised, rotated keys, preallocated to the
                                   context length n; valid up to each sample's position
    values     [L, B, Hkv, n, dh]
    ``PHA.step`` writes into these in place.
    """

    gss_state: torch.Tensor | None
    keys: torch.Tensor | None
    values: torch.Tensor | None


class FFN(nn.Module):
    def __init__(self, d_model: int, hidden_dim: int):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden_dim)
        self.proj = nn.Linear(hidden_dim, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def make_branch(config: PHAConfig, name: str) -> nn.Module:
    c = config
    if name == "gss":
        return GSS(c.d_model, c.gss_expansion_dim, c.gss_hidden_dim, c.dss_state_size, c.norm_eps)
    if name == "attn":
        return GQA(c.d_model, c.n_q_heads, c.n_kv_heads, c.rope_base, c.logit_scale_init, c.logit_scale_max)
    return FFN(c.d_model, c.ffn_dims[int(name.removeprefix("ffn_"))])


class PHABlock(nn.Module):
    def __init__(self, config: PHAConfig):
        super().__init__()
        E, eps = config.d_model, config.norm_eps
        self.names = config.branch_names
        self.parallel = config.mode == "parallel"
        self.alpha = config.deepnorm_alpha
        self.branches = nn.ModuleDict({name: make_branch(config, name) for name in self.names})
        self.branch_norms = nn.ModuleDict({name: nn.RMSNorm(E, eps=eps) for name in self.names})
        if self.parallel:
            # softplus(log(e - 1)) = 1: equal weights at init.
            self.mixing = nn.Parameter(torch.full((len(self.names),), math.log(math.e - 1)))
            self.post_norm = nn.LayerNorm(E, eps=eps)
        else:
            self.post_norms = nn.ModuleDict({name: nn.LayerNorm(E, eps=eps) for name in self.names})

    def mixing_weights(self) -> torch.Tensor:
        """w = softplus(p) / sum(softplus(p)): [n_branches], positive, summing to 1."""
        w = F.softplus(self.mixing)
        return w / w.sum()

    def _combine(self, x, run):
        """The block around ``run(name, h) -> branch output``: norms, mixing, residual."""
        if self.parallel:
            w = self.mixing_weights()
            mixed = sum(w[i] * self.branch_norms[name](run(name, x)) for i, name in enumerate(self.names))
            return self.post_norm(self.alpha * x + mixed)
        for name in self.names:
            x = self.post_norms[name](self.alpha * x + self.branch_norms[name](run(name, x)))
        return x

    def forward(self, x, lengths=None, gss_form: str = "fft"):
        """x [B, T, E] -> (x, GSS state [B, H, N] or None, (k, v) [B, Hkv, T, dh] or None)."""
        found = {}

        def run(name, h):
            if name == "gss":
                out, found["gss"] = self.branches[name](h, gss_form, lengths=lengths)
            elif name == "attn":
                out, found["attn"] = self.branches[name](h)
            else:
                out = self.branches[name](h)
            return out

        x = self._combine(x, run)
        return x, found.get("gss"), found.get("attn")

    def step(self, x, positions, gss_state, k_cache, v_cache):
        """x [B, E] at positions [B] -> (x, new GSS state); writes the KV caches in place."""
        found = {"gss": gss_state}

        def run(name, h):
            if name == "gss":
                out, found["gss"] = self.branches[name].step(h, gss_state)
            elif name == "attn":
                out = self.branches[name].step(h, positions, k_cache, v_cache)
            else:
                out = self.branches[name](h)
            return out

        x = self._combine(x, run)
        return x, found["gss"]


class PHA(nn.Module):
    def __init__(self, config: PHAConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(PHABlock(config) for _ in range(config.n_layers))
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self):
        # DeepNorm (torchscale): Xavier normal, gain beta on value/output/FFN projections.
        beta = self.config.deepnorm_beta
        nn.init.normal_(self.embed.weight, std=0.02)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=0.02)
        for block in self.blocks:
            for name, branch in block.branches.items():
                if name == "gss":
                    # to_u, to_gate, to_out carry the value path; to_v feeds a LayerNorm.
                    scaled = {branch.to_u, branch.to_gate, branch.to_out}
                elif name == "attn":
                    scaled = {branch.v_proj, branch.o_proj}
                else:
                    scaled = {branch.fc, branch.proj}
                for module in branch.modules():
                    if isinstance(module, nn.Linear):
                        nn.init.xavier_normal_(module.weight, gain=beta if module in scaled else 1.0)
                        if module.bias is not None:
                            nn.init.zeros_(module.bias)

    def _check_length(self, T: int) -> None:
        if T > self.config.context_length:
            raise ValueError(f"sequence of {T} tokens exceeds the context length {self.config.context_length}")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.embed.weight.T if self.lm_head is None else self.lm_head(x)

    def mixing_weights(self) -> torch.Tensor:
        """[L, n_branches], columns in ``config.branch_names`` order (parallel mode only)."""
        if not self.blocks[0].parallel:
            raise ValueError("sequential mode has no mixing weights")
        return torch.stack([block.mixing_weights() for block in self.blocks]).detach()

    def forward(self, input_ids: torch.Tensor, gss_form: str = "fft") -> torch.Tensor:
        """input_ids [B, T] -> next-token logits [B, T, V] at every position."""
        self._check_length(input_ids.shape[-1])
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, gss_form=gss_form)[0]
        return self.logits(x)

    def empty_cache(self, batch_size: int, dtype=None, device=None) -> PHACache:
        c = self.config
        dtype = dtype or self.embed.weight.dtype
        device = device or self.embed.weight.device
        L, B = c.n_layers, batch_size
        gss = keys = values = None
        if "gss" in c.branches:
            gss = torch.zeros(L, B, c.gss_hidden_dim, c.dss_state_size, dtype=state_dtypes(dtype)[1], device=device)
        if "attn" in c.branches:
            keys = torch.zeros(L, B, c.n_kv_heads, c.context_length, c.head_dim, dtype=dtype, device=device)
            values = torch.zeros_like(keys)
        return PHACache(gss, keys, values)

    def prefill(self, input_ids, lengths=None):
        """Whole prompts at once: (logits [B, T, V], cache).

        With ``lengths`` [B] (right padding), each sample's GSS state is taken after
        its last real token; its keys past that are padding, overwritten by ``step``
        before they are ever read. The next step of sample b is at position lengths[b].
        """
        B, T = input_ids.shape
        self._check_length(T)
        x = self.embed(input_ids)
        cache = self.empty_cache(B, x.dtype, x.device)
        for l, block in enumerate(self.blocks):
            x, gss_state, kv = block(x, lengths=lengths)
            if gss_state is not None:
                cache.gss_state[l] = gss_state
            if kv is not None:
                cache.keys[l, :, :, :T] = kv[0]
                cache.values[l, :, :, :T] = kv[1]
        return self.logits(x), cache

    def step(self, token_ids, positions, cache: PHACache):
        """One token per sample: token_ids [B] at positions [B] -> (logits [B, V], cache).

        The cache is updated in place (and returned).
        """
        if int(positions.max()) >= self.config.context_length:
            raise ValueError(f"position {int(positions.max())} is past the context length {self.config.context_length}")
        x = self.embed(token_ids)
        for l, block in enumerate(self.blocks):
            gss_state = None if cache.gss_state is None else cache.gss_state[l]
            keys = None if cache.keys is None else cache.keys[l]
            values = None if cache.values is None else cache.values[l]
            x, gss_state = block.step(x, positions, gss_state, keys, values)
            if gss_state is not None:
                cache.gss_state[l] = gss_state
        return self.logits(x), cache

    @torch.no_grad()
    def generate_greedy(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decode of one prompt [T] via prefill + steps: returns the new ids."""
        logits, cache = self.prefill(prompt.view(1, -1))
        token = logits[:, -1].argmax(-1)
        out = [token]
        for t in range(prompt.numel(), prompt.numel() + max_new_tokens - 1):
            logits, cache = self.step(token, torch.tensor([t]), cache)
            token = logits.argmax(-1)
            out.append(token)
        return torch.cat(out)
