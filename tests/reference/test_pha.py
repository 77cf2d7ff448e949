"""The PHA hybrid: config, GSS and attention forms agree, decode == forward, ablations."""

import json
import math

import pytest
import torch

from srm_max.errors import CheckpointError
from srm_max.models.pha.config import PHAConfig
from srm_max.models.pha.schema import checkpoint_shapes as pha_expected_shapes
from srm_max.reference.attention import GQA
from srm_max.reference.gss import GSS, fft_dss, recurrent_dss
from srm_max.reference.pha import PHA
from tests.support.pha import randomized


def tiny(**overrides) -> PHAConfig:
    sizes = dict(vocab_size=37, d_model=16, n_layers=2, context_length=24, n_q_heads=4, n_kv_heads=2, dss_state_size=8)
    return PHAConfig(**(sizes | overrides))


CONFIGS = {
    "default": tiny(),
    "untied-mqa": tiny(n_kv_heads=1, tie_embeddings=False, deepnorm=False),
    "sequential": tiny(mode="sequential"),
    "one-ffn-sizes": tiny(ffn_dims=(24,), gss_expansion_dim=20, gss_hidden_dim=6, n_layers=3),
    "no-gss": tiny(branches=("attn", "ffn")),
    "no-attn": tiny(branches=("gss", "ffn")),
    "gss-attn": tiny(branches=("gss", "attn"), n_q_heads=2, n_kv_heads=2),
}


def decode_logits(model, ids, prefix: int):
    """Logits at every position via prefill(ids[:, :prefix]) and then one step per token."""
    logits, cache = model.prefill(ids[:, :prefix])
    out = [logits]
    for t in range(prefix, ids.shape[1]):
        step, cache = model.step(ids[:, t], torch.full((ids.shape[0],), t), cache)
        out.append(step.unsqueeze(1))
    return torch.cat(out, 1)


# --- config -------------------------------------------------------------------------


def test_config_resolves_defaults_and_round_trips(tmp_path):
    c = tiny()
    assert (c.gss_expansion_dim, c.gss_hidden_dim, c.ffn_dims) == (64, 4, (32, 32))
    assert c.branch_names == ("gss", "attn", "ffn_0", "ffn_1")
    assert c.deepnorm_alpha == pytest.approx(4**0.25) and c.deepnorm_beta == pytest.approx(16**-0.25)
    assert tiny(branches=("gss", "attn")).ffn_dims == ()
    c.save(tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["architecture"] == "pha"
    assert PHAConfig.load(tmp_path / "config.json") == c
    assert PHAConfig.from_dict(CONFIGS["no-gss"].to_dict()) == CONFIGS["no-gss"]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(d_model=0), "d_model"),
        (dict(n_layers=True), "n_layers"),
        (dict(dss_state_size=-1), "dss_state_size"),
        (dict(gss_hidden_dim=2.5), "gss_hidden_dim"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(n_q_heads=3, n_kv_heads=1), "n_q_heads"),
        (dict(d_model=24, n_q_heads=8, n_kv_heads=2), "head_dim"),
        (dict(rope_base=0), "rope_base"),
        (dict(logit_scale_init=float("nan")), "logit_scale_init"),
        (dict(logit_scale_max=5.0), "logit_scale_max"),
        (dict(ffn_dims=(16, 0)), "ffn_dims"),
        (dict(ffn_dims=(16,), branches=("gss", "attn")), "ffn_dims"),
        (dict(branches=()), "branches"),
        (dict(branches=("gss", "mlp")), "branches"),
        (dict(branches=("attn", "gss")), "branches"),
        (dict(mode="stacked"), "mode"),
        (dict(deepnorm="yes"), "deepnorm"),
        (dict(tie_embeddings=1), "tie_embeddings"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(architecture="srm"), "architecture"),
        (dict(vocab_size=1 << 30), "vocab_size"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(CheckpointError, match=field):
        tiny(**overrides)


def test_config_from_dict_names_unknown_and_missing_fields():
    data = tiny().to_dict()
    with pytest.raises(CheckpointError, match="unknown config field.*'heads'"):
        PHAConfig.from_dict(data | {"heads": 2})
    del data["n_q_heads"]
    with pytest.raises(CheckpointError, match="missing config field.*n_q_heads"):
        PHAConfig.from_dict(data, source="x/config.json")


@pytest.mark.parametrize("name", CONFIGS)
def test_expected_shapes_match_state_dict(name):
    config = CONFIGS[name]
    model = PHA(config)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == pha_expected_shapes(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


# --- the forms of each branch -------------------------------------------------------


def test_gss_fft_equals_recurrence_float64():
    torch.manual_seed(0)
    B, T, H, N = 3, 40, 5, 7
    gss = GSS(12, 20, H, N).double()
    with torch.no_grad():  # some slow modes (|Abar| near 1) and some fast ones
        gss.dss.Lambda_real.copy_(torch.linspace(-5, 1, N))
    Lambda, Ct = gss.dss.kernel(torch.float64)
    u = torch.randn(B, T, H, dtype=torch.float64)
    s0 = torch.randn(B, H, N, dtype=torch.complex128)
    lengths = torch.tensor([T, 0, 17])
    D = gss.dss.param_D
    for initial in (None, s0):
        y_fft, s_fft = fft_dss(u, Lambda, Ct, D, initial, lengths)
        y_rec, s_rec = recurrent_dss(u, Lambda, Ct, D, initial, lengths)
        assert y_fft.dtype == torch.float64 and s_fft.dtype == torch.complex128
        torch.testing.assert_close(y_fft, y_rec, rtol=1e-9, atol=1e-9 * y_rec.abs().max().item())
        torch.testing.assert_close(s_fft, s_rec, rtol=1e-9, atol=1e-9 * s_rec.abs().max().item())
    # The module's two forms, and its step.
    x = torch.randn(B, T, 12, dtype=torch.float64)
    out_fft, state = gss(x, "fft")
    out_rec, _ = gss(x, "recurrent")
    torch.testing.assert_close(out_fft, out_rec, rtol=1e-9, atol=1e-12)
    out_step, state_step = gss.step(x[:, -1], gss(x[:, :-1])[1])
    torch.testing.assert_close(out_step, out_fft[:, -1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(state_step, state, rtol=1e-9, atol=1e-12)


def test_gss_state_stays_complex64_in_bfloat16():
    torch.manual_seed(0)
    gss = GSS(16, 32, 4, 8).to(torch.bfloat16)
    x = torch.randn(2, 10, 16, dtype=torch.bfloat16)
    out, state = gss(x)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.complex64
    out, state = gss.step(x[:, 0], state)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.complex64
    model = PHA(tiny()).to(torch.bfloat16)
    logits, cache = model.prefill(torch.randint(0, 37, (2, 5)))
    assert cache.gss_state.dtype == torch.complex64 and cache.keys.dtype == torch.bfloat16
    logits, cache = model.step(torch.tensor([1, 2]), torch.tensor([5, 5]), cache)
    assert cache.gss_state.dtype == torch.complex64 and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
def test_attention_full_equals_decode_steps(heads):
    torch.manual_seed(0)
    B, T, E, n = 2, 11, 16, 16
    attn = GQA(E, *heads).double()
    with torch.no_grad():
        attn.logit_scale.uniform_(1.0, 5.0)  # one head past the cap: log 100 = 4.6
    x = torch.randn(B, T, E, dtype=torch.float64)
    full, (k, v) = attn(x)
    k_cache = torch.zeros(B, heads[1], n, E // heads[0], dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    steps = [attn.step(x[:, t], torch.full((B,), t), k_cache, v_cache) for t in range(T)]
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_cache[:, :, :T], k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k.norm(dim=-1), torch.ones_like(k[..., 0]))  # normalised keys
    assert attn.scale().max() <= 100.0 + 1e-9


# --- the model ----------------------------------------------------------------------


def test_mixing_weights_equal_at_init_positive_and_normalised():
    model = PHA(tiny(n_layers=3))
    w = model.mixing_weights()
    assert w.shape == (3, 4)
    torch.testing.assert_close(w, torch.full((3, 4), 0.25))
    w = randomized(tiny(n_layers=3)).mixing_weights()
    assert (w > 0).all() and not torch.allclose(w, torch.full_like(w, 0.25))
    torch.testing.assert_close(w.sum(-1), torch.ones(3, dtype=w.dtype))
    with pytest.raises(ValueError, match="sequential"):
        PHA(tiny(mode="sequential")).mixing_weights()


@pytest.mark.parametrize("name", CONFIGS)
def test_forward_equals_prefill_and_decode_float64(name):
    model = randomized(CONFIGS[name])
    ids = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        torch.testing.assert_close(model(ids, gss_form="recurrent"), full, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(decode_logits(model, ids, 4), full, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(decode_logits(model, ids[:1], 1), full[:1], rtol=1e-10, atol=1e-10)


def test_forward_equals_prefill_and_decode_float32():
    model = randomized(tiny(), dtype=torch.float32)
    ids = torch.randint(0, 37, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(decode_logits(model, ids, 9), model(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["default", "sequential"])
def test_batched_step_with_per_sample_positions(name):
    """Right-padded prompts of lengths 3, 7, 5: each sample decodes as if alone."""
    model = randomized(CONFIGS[name])
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([3, 7, 5])
    ids = torch.randint(0, 37, (3, 7), generator=g)
    ids[0, 3:] = 0  # padding, never read
    nxt = torch.randint(0, 37, (3, 3), generator=g)
    with torch.no_grad():
        logits, cache = model.prefill(ids, lengths=lengths)
        batched = []
        for i in range(nxt.shape[1]):
            step, cache = model.step(nxt[:, i], lengths + i, cache)
            batched.append(step)
        for b in range(3):
            alone = model(torch.cat([ids[b, : lengths[b]], nxt[b]]).view(1, -1))[0]
            torch.testing.assert_close(logits[b, : lengths[b]], alone[: lengths[b]], rtol=1e-10, atol=1e-10)
            for i in range(nxt.shape[1]):
                torch.testing.assert_close(batched[i][b], alone[lengths[b] + i], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dropped", ["gss", "attn", "ffn"])
def test_dropping_a_branch_removes_its_parameters_and_changes_the_output(dropped):
    full_config = tiny()
    full = randomized(full_config)
    config = tiny(branches=tuple(b for b in ("gss", "attn", "ffn") if b != dropped))
    ablated = PHA(config).double().eval()
    keys = set(ablated.state_dict())
    assert not any(f"branches.{dropped}" in k or f"norms.{dropped}" in k for k in keys)
    assert keys == set(pha_expected_shapes(config))
    # Same weights for what remains (the mixing logits of the kept branches).
    kept = [full_config.branch_names.index(n) for n in config.branch_names]
    state = {k: (v[kept] if k.endswith("mixing") else v) for k, v in full.state_dict().items() if k in keys}
    ablated.load_state_dict(state)
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (full(ids) - ablated(ids)).abs().max() > 1e-3
        torch.testing.assert_close(decode_logits(ablated, ids, 4), ablated(ids), rtol=1e-10, atol=1e-10)
    if dropped == "gss":
        assert ablated.prefill(ids)[1].gss_state is None
    if dropped == "attn":
        assert ablated.prefill(ids)[1].keys is None


def test_sequential_mode_equals_a_hand_composed_stack():
    config = tiny(mode="sequential", n_layers=3)
    model = randomized(config)
    ids = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(5))
    alpha = (2 * 3) ** 0.25
    with torch.no_grad():
        x = model.embed(ids)
        for block in model.blocks:
            b = block.branches
            x = block.post_norms["gss"](alpha * x + block.branch_norms["gss"](b["gss"](x)[0]))
            x = block.post_norms["attn"](alpha * x + block.branch_norms["attn"](b["attn"](x)[0]))
            for f in ("ffn_0", "ffn_1"):
                x = block.post_norms[f](alpha * x + block.branch_norms[f](b[f](x)))
        torch.testing.assert_close(model(ids), x @ model.embed.weight.T, rtol=1e-12, atol=1e-12)


def test_parallel_block_equals_the_formula():
    model = randomized(tiny(n_layers=1, tie_embeddings=False))
    block = model.blocks[0]
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    with torch.no_grad():
        p = block.mixing
        w = torch.log1p(p.exp()) / torch.log1p(p.exp()).sum()
        outs = [block.branches["gss"](x)[0], block.branches["attn"](x)[0]] + [
            block.branches[f](x) for f in ("ffn_0", "ffn_1")
        ]
        mixed = sum(w[i] * block.branch_norms[n](o) for i, (n, o) in enumerate(zip(block.names, outs)))
        expected = block.post_norm(2 ** 0.25 * x + mixed)
        torch.testing.assert_close(block(x)[0], expected, rtol=1e-12, atol=1e-12)


def test_deepnorm_init_scales_value_output_and_ffn():
    torch.manual_seed(0)
    big = PHAConfig(vocab_size=8, d_model=64, n_layers=8, context_length=8, n_q_heads=4, n_kv_heads=2, dss_state_size=4)
    model = PHA(big)
    attn, ffn = model.blocks[0].branches["attn"], model.blocks[0].branches["ffn_0"]
    beta = (8 * 8) ** -0.25
    xavier = lambda w: math.sqrt(2.0 / sum(w.shape))  # noqa: E731
    assert attn.v_proj.weight.std().item() == pytest.approx(beta * xavier(attn.v_proj.weight), rel=0.15)
    assert attn.q_proj.weight.std().item() == pytest.approx(xavier(attn.q_proj.weight), rel=0.15)
    assert ffn.fc.weight.std().item() == pytest.approx(beta * xavier(ffn.fc.weight), rel=0.15)


def test_context_length_is_enforced():
    model = PHA(tiny(context_length=8))
    with pytest.raises(ValueError, match="context length"):
        model(torch.zeros(1, 9, dtype=torch.long))
    _, cache = model.prefill(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="context length"):
        model.step(torch.zeros(1, dtype=torch.long), torch.tensor([8]), cache)


def test_a_few_adamw_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = PHA(tiny())
    ids = torch.randint(0, 37, (2, 13))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.1
    assert model.blocks[0].mixing.grad is not None and model.blocks[0].branches["gss"].dss.Lambda_real.grad is not None
