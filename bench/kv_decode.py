"""Sampling from the reference Transformer with a hand-written KV cache in plain PyTorch: the
lean alternative to transformers' ``generate`` (no logits processors, stopping criteria or
cache objects per step), so the Transformer is served by the faster of the two.

The cache is preallocated, ``[B, H, T, hd]`` keys and values per layer; the prompt runs
once through the parallel form (causal SDPA) and fills it; each decode step embeds the new
tokens at their position, attends over the cache up to that position and draws the next
token from ``softmax(logits / temperature)``. A batch holds prompts of one length only
(no padding, so one position per step) and stops when every row has produced the stop token.
The arithmetic is the reference's (``srm_max.reference.transformer``), layer for layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import sample_by_prompt_length
from srm_max.reference.transformer import Transformer


class KVDecoder:
    def __init__(self, model: Transformer):
        self.model = model.eval()
        self.cfg = model.config

    def _attend(self, block, x, k_cache, v_cache, start: int) -> torch.Tensor:
        """Self-attention of ``x`` [B, T, d] at positions start..start+T-1, writing its keys/values."""
        B, T, d = x.shape
        H = self.cfg.n_heads
        q, k, v = block.attn.qkv(block.attn_norm(x)).split(d, dim=-1)
        q, k, v = (t.view(B, T, H, d // H).transpose(1, 2) for t in (q, k, v))
        k_cache[:, :, start:start + T] = k
        v_cache[:, :, start:start + T] = v
        end = start + T
        # a prefill attends causally within the prompt; a single decode token sees the whole cache
        y = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], is_causal=T > 1)
        return block.attn.out_proj(y.transpose(1, 2).reshape(B, T, d))

    def _forward(self, ids, caches, start: int) -> torch.Tensor:
        """Logits of the last position of ``ids`` [B, T] placed at positions start.."""
        m = self.model
        T = ids.shape[1]
        x = m.token_embedding(ids) + m.position_embedding.weight[start:start + T]
        for block, (k_cache, v_cache) in zip(m.blocks, caches):
            x = x + self._attend(block, x, k_cache, v_cache, start)
            x = x + block.mlp(block.mlp_norm(x))
        return m.output_layer(m.final_norm(x[:, -1]))

    @torch.no_grad()
    def sample_batch(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float, stop_id: int,
                     generator: torch.Generator) -> torch.Tensor:
        """New ids [B, <= max_new_tokens] for ``prompt`` [B, T0] (rows of one length)."""
        B, T0 = prompt.shape
        steps = min(max_new_tokens, self.cfg.context_length - T0)
        if steps < 1:
            raise ValueError(f"prompt of {T0} tokens leaves no room in context {self.cfg.context_length}")
        hd = self.cfg.d_model // self.cfg.n_heads
        caches = [(torch.empty(B, self.cfg.n_heads, T0 + steps, hd), torch.empty(B, self.cfg.n_heads, T0 + steps, hd))
                  for _ in self.model.blocks]
        logits = self._forward(prompt, caches, 0)
        out = torch.empty(B, steps, dtype=torch.long)
        done = torch.zeros(B, dtype=torch.bool)
        for j in range(steps):
            probs = torch.softmax(logits.float() / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            out[:, j] = nxt
            done |= nxt == stop_id
            if bool(done.all()) or j + 1 == steps:
                return out[:, : j + 1]
            logits = self._forward(nxt[:, None], caches, T0 + j)
        return out


def sample(model: Transformer, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
           stop_id: int, seed: int, max_batch: int = 1024) -> list[list[list[int]]]:
    """``n`` completions of every prompt, result[prompt][sample], each cut after its stop token
    (the same contract as ``bench.hf_transformer.sample``)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dec = KVDecoder(model)
    g = torch.Generator().manual_seed(seed)
    return sample_by_prompt_length(prompts, n, max_batch, stop_id, lambda rows: dec.sample_batch(
        torch.tensor(rows, dtype=torch.long), max_new_tokens, temperature, stop_id, g).tolist())


@torch.no_grad()
def greedy_logits(model: Transformer, prompt: list[int], steps: int) -> torch.Tensor:
    """The logits [steps, V] of greedy decoding through the cache (the check against the
    reference's full forward pass)."""
    dec = KVDecoder(model)
    T0 = len(prompt)
    H = model.config.n_heads
    hd = model.config.d_model // H
    caches = [(torch.empty(1, H, T0 + steps, hd), torch.empty(1, H, T0 + steps, hd)) for _ in model.blocks]
    logits = dec._forward(torch.tensor([prompt]), caches, 0)
    rows = [logits[0]]
    for j in range(steps - 1):
        logits = dec._forward(logits.argmax(-1)[:, None], caches, T0 + j)
        rows.append(logits[0])
    return torch.stack(rows)


__all__ = ["KVDecoder", "sample", "greedy_logits"]
