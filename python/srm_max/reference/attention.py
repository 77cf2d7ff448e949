"""The GQA branch: grouped-query attention with RoPE and scaled-cosine logits.

    q = rope(normalize(W_q x)),  k = rope(normalize(W_k x)),  v = W_v x
    logits[h, i, j] = exp(min(s_h, log cap)) * q[h, i] . k[h // G, j]    (j <= i; no 1/sqrt(d))
    out = W_o concat_h(softmax(logits) v)

Hq query heads, Hkv key/value heads, G = Hq / Hkv. Rotation preserves length, so
normalising before or after RoPE is the same; the KV cache holds normalised,
rotated keys. Two forms side by side: ``causal_attention`` (whole sequence) and
``decode_attention_step`` (one token against a preallocated cache [B, Hkv, n, dh]
filled up to each sample's own position).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate x [B, heads, T, dh] at positions [B, T]; pairs are (i, i + dh/2) (GPT-NeoX layout)."""
    half = x.shape[-1] // 2
    real = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(half, dtype=real, device=x.device) / half)
    angles = positions.to(real)[:, None, :, None] * inv_freq  # [B, 1, T, half]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax in at least float32."""
    return logits.float().softmax(-1).to(logits.dtype) if logits.dtype in (torch.float16, torch.bfloat16) else logits.softmax(-1)


def causal_attention(q, k, v, scale):
    """q [B, Hq, T, dh], k, v [B, Hkv, T, dh], scale [Hq] -> out [B, Hq, T, dh]."""
    T, G = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # query head h reads h // G
    logits = scale.view(1, -1, 1, 1) * (q @ k.transpose(-1, -2))
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return _softmax(logits.masked_fill(future, float("-inf"))) @ v


def decode_attention_step(q, k, v, positions, k_cache, v_cache, scale):
    """One token per sample. q [B, Hq, dh], k, v [B, Hkv, dh], positions [B].

    Writes k, v into the caches [B, Hkv, n, dh] at each sample's position (in place),
    then attends over positions 0..position. Returns out [B, Hq, dh].
    """
    B, Hq, dh = q.shape
    G = Hq // k.shape[1]
    batch = torch.arange(B, device=q.device)
    k_cache[batch, :, positions] = k
    v_cache[batch, :, positions] = v
    span = int(positions.max()) + 1  # nothing past the furthest sample is read
    keys = k_cache[:, :, :span].repeat_interleave(G, dim=1)  # [B, Hq, span, dh]
    values = v_cache[:, :, :span].repeat_interleave(G, dim=1)
    logits = scale.view(1, Hq, 1) * torch.einsum("bhd,bhjd->bhj", q, keys)
    future = torch.arange(span, device=q.device).view(1, span) > positions.view(B, 1)
    weights = _softmax(logits.masked_fill(future.view(B, 1, span), float("-inf")))
    return torch.einsum("bhj,bhjd->bhd", weights, values)


class GQA(nn.Module):
    def __init__(self, d_model, n_q_heads, n_kv_heads, rope_base=10000.0, logit_scale_init=10.0, logit_scale_max=100.0):
        super().__init__()
        self.n_q_heads, self.n_kv_heads = n_q_heads, n_kv_heads
        self.head_dim = d_model // n_q_heads
        self.rope_base = rope_base
        self.log_scale_max = math.log(logit_scale_max)
        self.q_proj = nn.Linear(d_model, n_q_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_q_heads * self.head_dim, d_model, bias=False)
        self.logit_scale = nn.Parameter(torch.full((n_q_heads,), math.log(logit_scale_init)))

    def scale(self) -> torch.Tensor:
        """exp(min(s, log cap)) per query head."""
        return self.logit_scale.clamp(max=self.log_scale_max).exp()

    def _qkv(self, x, positions):
        """x [B, T, E], positions [B, T] -> normalised rotated q, k and v, heads first."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_q_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = rope(F.normalize(q, dim=-1), positions, self.rope_base)
        k = rope(F.normalize(k, dim=-1), positions, self.rope_base)
        return q, k, v

    def forward(self, x):
        """x [B, T, E] at positions 0..T-1 -> (out [B, T, E], (k, v) [B, Hkv, T, dh] for the cache)."""
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device).expand(B, T)
        q, k, v = self._qkv(x, positions)
        out = causal_attention(q, k, v, self.scale())
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)

    def step(self, x, positions, k_cache, v_cache):
        """x [B, E] at positions [B]; writes this token into the caches in place -> out [B, E]."""
        q, k, v = self._qkv(x.unsqueeze(1), positions.view(-1, 1))
        out = decode_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], positions, k_cache, v_cache, self.scale())
        return self.o_proj(out.flatten(1))
