"""The test PHA: one config with every branch on, its random float32 reference, and
comparisons of a MAX PHA engine's prefill, decode and states with that reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from srm_max.models.pha.config import PHAConfig
from srm_max.reference.pha import PHA
from tests.support.checks import assert_close_rel, assert_prefill_matches_reference
from tests.support.prompts import random_prompts, reference_prefill
from tests.support.tiny import TINY


def randomized(config: PHAConfig, dtype=torch.float64, seed=0) -> PHA:
    """A model with unequal mixing weights, varied logit scales, non-trivial norms, O(1) logits."""
    torch.manual_seed(seed)
    model = PHA(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ("embed.weight", "lm_head.weight"):
                p.normal_()
            elif name.endswith("mixing"):
                p.normal_()
            elif name.endswith("logit_scale"):
                p.uniform_(1.0, 3.0)
            elif "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


# Every branch on, GQA with 2 query heads per KV head, context 160 = 2.5 chunks. The SRM test
# config's vocabulary (tests/support/tiny.py): the sample graph depends on it alone, so the
# two engines' sample graphs are one graph, which MAX compiles once per cold run.
CONFIG = PHAConfig(vocab_size=TINY.vocab_size, d_model=16, n_layers=2, context_length=160, n_q_heads=4, n_kv_heads=2,
                   dss_state_size=8)

# The ablations through the MAX engines, each on a config of its own (one graph per kind
# each): the GSS branch alone, and attention alone, each with the FFNs. Attention alone has
# 4 query heads of width 32 on one KV head: a head width that is a multiple of the vector
# width, where the decode op reads each cached row once for the group's query heads
# together (its grouped loop; CONFIG's head width of 4 takes the loop of one head at a time).
GSS_ALONE = dataclasses.replace(CONFIG, branches=("gss", "ffn"))
ATTENTION_ALONE = dataclasses.replace(CONFIG, branches=("attn", "ffn"), d_model=128, n_q_heads=4, n_kv_heads=1)


def random_pha(config: PHAConfig = CONFIG, seed: int = 0) -> PHA:
    """Float32 reference with unequal mixing weights, varied logit scales, non-trivial
    norms and biases, O(1) logits (``randomized``), and DSS modes
    decaying from about 0.1 to 0.995 per token, so states carry across chunks."""
    model = randomized(config, torch.float32, seed)
    with torch.no_grad():
        for block in model.blocks:
            if "gss" in block.branches:
                block.branches["gss"].dss.Lambda_real.copy_(torch.linspace(-5.3, 0.8, config.dss_state_size))
    return model.eval()


def bf16_rounded(model: PHA) -> PHA:
    """``model`` with the matrices the engine keeps in bfloat16 rounded to it, in place:
    what is left between it and a bfloat16 engine is the rounding of the activations
    entering and leaving each product."""
    from srm_max.graphs.pha import matrix_names

    names = set(matrix_names(model.config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in names:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def _to_bfloat16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def bf16_products(model: PHA) -> PHA:
    """``model`` (``bf16_rounded``) computing each product of a bfloat16 matrix as a
    bfloat16 engine does (``graphs.ops.linear``): its input rounded to bfloat16, the product
    summed in float32, its output rounded to bfloat16, then the bias added. So it rounds
    where the engines round, and what is left between them is the order of each product's
    float32 sums."""
    from srm_max.graphs.pha import matrix_names

    names = set(matrix_names(model.config))

    def rounding(module: nn.Linear):
        def forward(x):
            y = _to_bfloat16(F.linear(_to_bfloat16(x), module.weight))
            return y if module.bias is None else y + module.bias
        return forward

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and f"{name}.weight" in names:
            module.forward = rounding(module)
    if model.lm_head is None:  # the output layer is the embedding's product
        model.logits = lambda x: _to_bfloat16(_to_bfloat16(x) @ model.embed.weight.T)
    return model


def cpu_engine(weights: dict, dtype: str = "float32", plain: bool = False):
    """The test PHA's engine on the CPU: its default, the whole-step decode op, or with
    ``plain`` the plain-op graphs (``kernels=False``); checked to be the one asked for."""
    from srm_max.models.pha.engine import PHAEngine

    engine = PHAEngine(CONFIG, weights, dtype=dtype, device="cpu", **({"kernels": False} if plain else {}))
    assert engine.steps_in_one_op != plain
    return engine


def prompts_of(lengths, seed=0, config: PHAConfig = CONFIG):
    return random_prompts(lengths, config.vocab_size, seed)


def assert_states_close(engine, states, cache, filled, rel=1e-4):
    """MAX states against a reference PHACache: GSS states, and the KV caches up to
    each sample's ``filled`` positions (later rows are padding or unused)."""
    got = engine.split_states(states)
    assert (got["gss_state"] is None) == (cache.gss_state is None)
    if cache.gss_state is not None:
        assert_close_rel(got["gss_state"], cache.gss_state.numpy(), rel)
    for name, ref in (("keys", cache.keys), ("values", cache.values)):
        assert (got[name] is None) == (ref is None)
        for b, f in enumerate(filled if ref is not None else []):
            assert_close_rel(got[name][:, b, :, :f], ref[:, b, :, :f].numpy(), rel)


def ref_greedy(reference, prompts, new_tokens):
    """Reference: padded prefill, then batched steps at per-sample positions (greedy)."""
    logits, cache = reference_prefill(reference, prompts)
    tok = torch.tensor(logits.argmax(-1))
    pos = torch.tensor([len(p) for p in prompts])
    out = [tok]
    with torch.no_grad():
        for _ in range(new_tokens - 1):
            logits, cache = reference.step(tok, pos, cache)
            tok, pos = logits.argmax(-1), pos + 1
            out.append(tok)
    return torch.stack(out, 1).numpy(), cache



def reference_start(reference, prompts, engine):
    """The reference's prefill of ``prompts``: (first tokens, its cache as the engine's
    states [L, B, X] on the device), so a decode test needs no prefill graph."""
    logits, cache = reference_prefill(reference, prompts)
    L, B = engine.config.n_layers, len(prompts)
    parts = []
    if cache.gss_state is not None:
        gss = cache.gss_state.numpy()
        parts += [gss.real.reshape(L, B, -1), gss.imag.reshape(L, B, -1)]
    if cache.keys is not None:
        parts += [cache.keys.numpy().reshape(L, B, -1), cache.values.numpy().reshape(L, B, -1)]
    states = np.ascontiguousarray(np.concatenate(parts, axis=2), dtype=np.float32)
    assert states.shape[2] == engine.layout.width
    return logits.argmax(-1), engine.to_device(states)


def assert_prefill_equals_plain_and_reference(engine, plain, reference, prompts, lengths):
    """``engine``'s prefill (through the Mojo ops) against the reference (logits and
    states) and against ``plain``'s (the plain-op graph: logits, next tokens, GSS states);
    -> both engines' states, split by name, for the caller's further checks."""
    res, logits, cache = assert_prefill_matches_reference(engine, reference, prompts, engine.config.vocab_size)
    assert_states_close(engine, res.states, cache, lengths)
    base = plain.prefill(prompts)
    assert_close_rel(logits, plain.host(base.logits), rel=1e-4)
    np.testing.assert_array_equal(res.next_ids, base.next_ids)
    got, want = engine.split_states(res.states), plain.split_states(base.states)
    assert_close_rel(got["gss_state"], want["gss_state"], rel=1e-4)
    return got, want
