"""The reference Transformer (``srm_max.reference.transformer``) as a Hugging Face GPT-2, so it
can be served by transformers' ``generate`` with a static KV cache.

The architectures agree layer for layer: pre-LayerNorm blocks, fused q|k|v projection with
biases, 1/sqrt(head_dim) attention scaling, learned absolute positions, a GELU MLP (exact
erf GELU: GPT-2's ``activation_function="gelu"``, not its default tanh ``gelu_new``), a final
LayerNorm and an untied output layer without bias. GPT-2's ``Conv1D`` stores its weights as
[in, out], the transpose of ``nn.Linear``'s. ``max_logit_error`` checks the mapping.

``sample`` draws completions with ``generate(do_sample=True, cache_implementation="static")``.
It batches prompts of equal length only, so no row is padded (GPT-2 takes positions from the
cache length, not from an attention mask); a batch runs until its last row has stopped.
"""

from __future__ import annotations

import torch

from bench.common import sample_by_prompt_length
from srm_max.reference.transformer import Transformer


def gpt2_config(cfg):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.context_length, n_embd=cfg.d_model,
                      n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.ffn_dim, activation_function="gelu",
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=cfg.layer_norm_eps,
                      scale_attn_weights=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)


def gpt2_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The reference weights under GPT2LMHeadModel's names (Linear [out, in] -> Conv1D [in, out])."""
    sd = model.state_dict()
    out = {"transformer.wte.weight": sd["token_embedding.weight"],
           "transformer.wpe.weight": sd["position_embedding.weight"],
           "transformer.ln_f.weight": sd["final_norm.weight"], "transformer.ln_f.bias": sd["final_norm.bias"],
           "lm_head.weight": sd["output_layer.weight"]}
    for i in range(model.config.n_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[dst + theirs + ".weight"] = sd[src + ours + ".weight"]
            out[dst + theirs + ".bias"] = sd[src + ours + ".bias"]
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.out_proj", "attn.c_proj"),
                             ("mlp.0", "mlp.c_fc"), ("mlp.2", "mlp.c_proj")):
            out[dst + theirs + ".weight"] = sd[src + ours + ".weight"].t().contiguous()
            out[dst + theirs + ".bias"] = sd[src + ours + ".bias"]
    return out


def to_gpt2(model: Transformer, attn: str = "sdpa"):
    """A GPT2LMHeadModel (eval mode, float32) computing the same function as ``model``."""
    from transformers import GPT2LMHeadModel

    config = gpt2_config(model.config)
    config._attn_implementation = attn
    hf = GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict(gpt2_state_dict(model), strict=False)
    # GPT-2 keeps a causal-mask buffer in some versions; every parameter must have been set.
    missing = [m for m in missing if not m.endswith(("attn.bias", "attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"GPT-2 mapping: missing {missing}, unexpected {unexpected}")
    return hf.eval().float()


@torch.no_grad()
def max_logit_error(model: Transformer, hf, ids: torch.Tensor) -> float:
    """max |logits_ref - logits_hf| / max |logits_ref| over ``ids`` [B, T]."""
    ref = model.eval()(ids)
    got = hf(input_ids=ids).logits
    return float((ref - got).abs().max() / ref.abs().max())


@torch.no_grad()
def sample(hf, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, stop_id: int,
           seed: int, max_batch: int = 1024) -> list[list[list[int]]]:
    """``n`` sampled completions of every prompt (ids up to and including ``stop_id``, or
    ``max_new_tokens`` ids): result[prompt][sample]. Rows of one batch share a prompt length."""
    torch.manual_seed(seed)

    def generate(rows: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(rows, dtype=torch.long)
        gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                          temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                          eos_token_id=stop_id, pad_token_id=stop_id, cache_implementation="static")
        return gen[:, ids.shape[1]:].tolist()

    return sample_by_prompt_length(prompts, n, max_batch, stop_id, generate)

__all__ = ["gpt2_config", "gpt2_state_dict", "to_gpt2", "max_logit_error", "sample"]
