"""The Structured Recurrent Mixer in plain PyTorch: the ground truth.

Reads like ``docs/srm.md``. Parameter names are those of the paper's
code (``blbadger/mrm``, ``MLPMixer`` with mixed heads), so its checkpoints
load without renaming:

    x = input_layer[ids]
    for each block:
        x = x + channel_mixing_layer(channel_norm(x))     # Linear, SiLU, Linear
        x = x + token_mixing_layer(token_norm(x))         # heads, mixer, out_proj
    logits = output_layer(x)

Three ways to run the token mixer (see ``mixer.py``): ``naive`` (dense n x n),
``parallel`` (chunked O(n) scan, also yields the recurrent state) and
``recurrent`` (one step at a time). ``forward`` runs the whole sequence;
``prefill`` + ``step`` are the decode path.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..models.srm.config import SRMConfig
from .mixer import MIXERS, recurrent_mixer_step


class MixerHead(nn.Module):
    """One head's per-position vectors: weight [1, n], bias [n], decay_value [1]."""

    def __init__(self, context_length: int, decay: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, context_length))
        self.bias = nn.Parameter(torch.zeros(context_length))
        self.decay_value = nn.Parameter(torch.ones(1)) if decay else None


class TokenMixer(nn.Module):
    """Mixed heads: per-head input projections, the structured mixer, out_proj."""

    def __init__(self, config: SRMConfig):
        super().__init__()
        d, H = config.d_model, config.n_heads
        self.n_heads = H
        self.decay_constant = config.decay_constant
        self.proj_head = nn.ModuleList(nn.Linear(d, config.head_dim) for _ in range(H))
        self.out_proj = nn.Linear(d, d)
        self.mixer_heads = nn.ModuleList(MixerHead(config.context_length, config.decay) for _ in range(H))

    def mixer_params(self):
        """(w [H, n], beta [H, n], lam [H]) with lam = clip(decay, 0.9, 1) ** (1 / c)."""
        w = torch.cat([h.weight for h in self.mixer_heads], 0)
        beta = torch.stack([h.bias for h in self.mixer_heads], 0)
        if self.mixer_heads[0].decay_value is None:
            lam = torch.ones(self.n_heads, dtype=w.dtype, device=w.device)
        else:
            decay = torch.cat([h.decay_value for h in self.mixer_heads], 0)
            lam = torch.clamp(decay, 0.9, 1.0) ** (1.0 / self.decay_constant)
        return w, beta, lam

    def project(self, z: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., H, hd]"""
        return torch.stack([proj(z) for proj in self.proj_head], dim=-2)

    def forward(self, z, mixer: str = "parallel", lengths=None):
        """z [B, T, d] -> (out [B, T, d], final state [B, H, hd])."""
        u = self.project(z)
        y, state = MIXERS[mixer](u, *self.mixer_params(), lengths=lengths)
        return self.out_proj(y.flatten(-2)), state

    def step(self, z, positions, state):
        """z [B, d] at absolute positions [B] -> (out [B, d], new state)."""
        y, state = recurrent_mixer_step(self.project(z), positions, state, *self.mixer_params())
        return self.out_proj(y.flatten(-2)), state


class MixerBlock(nn.Module):
    def __init__(self, config: SRMConfig):
        super().__init__()
        d = config.d_model
        self.channel_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.channel_mixing_layer = nn.Sequential(
            nn.Linear(d, config.ffn_dim), nn.SiLU(), nn.Linear(config.ffn_dim, d)
        )
        self.token_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.token_mixing_layer = TokenMixer(config)

    def forward(self, x, mixer: str = "parallel", lengths=None):
        x = x + self.channel_mixing_layer(self.channel_norm(x))
        mixed, state = self.token_mixing_layer(self.token_norm(x), mixer, lengths)
        return x + mixed, state

    def step(self, x, positions, state):
        x = x + self.channel_mixing_layer(self.channel_norm(x))
        mixed, state = self.token_mixing_layer.step(self.token_norm(x), positions, state)
        return x + mixed, state


class SRM(nn.Module):
    def __init__(self, config: SRMConfig):
        super().__init__()
        self.config = config
        self.input_layer = nn.Embedding(config.vocab_size, config.d_model)
        self.mixer_blocks = nn.ModuleList(MixerBlock(config) for _ in range(config.n_layers))
        self.output_layer = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self):
        # As the paper's code: Kaiming normal for linear and mixer weights, zero biases.
        for module in self.modules():
            if isinstance(module, (nn.Linear, MixerHead)):
                nn.init.kaiming_normal_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.shape[-1] > self.config.context_length:
            raise ValueError(
                f"sequence of {input_ids.shape[-1]} tokens exceeds the context length "
                f"{self.config.context_length}"
            )

    def forward(self, input_ids: torch.Tensor, mixer: str = "parallel") -> torch.Tensor:
        """input_ids [B, T] -> next-token logits [B, T, V] at every position."""
        return self.prefill(input_ids, mixer=mixer)[0]

    def prefill(self, input_ids, lengths=None, mixer: str = "parallel"):
        """Whole prompts at once.

        Returns (logits [B, T, V], states [L, B, H, hd]); with ``lengths`` [B],
        each sample's state is taken after its last real token (right padding
        never changes earlier positions, by causality).
        """
        self._check_ids(input_ids)
        x = self.input_layer(input_ids)
        states = []
        for block in self.mixer_blocks:
            x, state = block(x, mixer, lengths)
            states.append(state)
        return self.output_layer(x), torch.stack(states)

    def empty_state(self, batch_size: int, dtype=None, device=None) -> torch.Tensor:
        c = self.config
        dtype = dtype or self.output_layer.weight.dtype
        return torch.zeros(c.n_layers, batch_size, c.n_heads, c.head_dim, dtype=dtype, device=device)

    def step(self, token_ids, positions, states):
        """One recurrent step: token_ids [B] at positions [B] -> (logits [B, V], states)."""
        if int(positions.max()) >= self.config.context_length:
            raise ValueError(f"position {int(positions.max())} is past the context length {self.config.context_length}")
        x = self.input_layer(token_ids)
        new_states = []
        for block, state in zip(self.mixer_blocks, states):
            x, state = block.step(x, positions, state)
            new_states.append(state)
        return self.output_layer(x), torch.stack(new_states)

    @torch.no_grad()
    def generate_greedy(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decode of one prompt [T] via prefill + recurrent steps: returns new ids."""
        logits, states = self.prefill(prompt.view(1, -1))
        token = logits[:, -1].argmax(-1)
        out = [token]
        for t in range(prompt.numel(), prompt.numel() + max_new_tokens - 1):
            logits, states = self.step(token, torch.tensor([t]), states)
            token = logits.argmax(-1)
            out.append(token)
        return torch.cat(out)


def random_srm(config: SRMConfig, seed: int = 0, decay_low: float = 0.85, bias_scale: float = 0.1) -> SRM:
    """A reference SRM with random weights that exercise every path: decay values in
    [decay_low, 1) and biases and norms away from their defaults (tests, benchmarks)."""
    torch.manual_seed(seed)
    model = SRM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("decay_value"):
                p.copy_(decay_low + (1 - decay_low) * torch.rand(p.shape, generator=g))
            elif name.endswith("bias") or "norm" in name:
                p.add_(bias_scale * torch.randn(p.shape, generator=g))
    return model
