"""The reference SRM: naive == parallel == recurrent, and the decode hand-off."""

import pytest
import torch

from srm_max.models.srm.config import SRMConfig
from srm_max.reference.mixer import naive_mixer, parallel_mixer, recurrent_mixer
from srm_max.reference.srm import SRM

CONFIGS = [
    # (vocab, d, layers, heads, n): n < 512, n = 1024 (c = 2), odd head widths
    SRMConfig(37, 12, 2, 2, 40),
    SRMConfig(50, 10, 1, 2, 1024),  # head dim 5
    SRMConfig(29, 12, 2, 4, 70),  # head dim 3
    SRMConfig(40, 8, 2, 2, 33, decay=False),
    SRMConfig(31, 6, 1, 2, 600, ffn_expansion=2),  # c = 1 with n >= 512
]


def randomized(config: SRMConfig, dtype=torch.float64, seed=0) -> SRM:
    """A model whose decay values straddle the 0.9 clip and whose biases are not zero."""
    torch.manual_seed(seed)
    model = SRM(config).to(dtype)
    with torch.no_grad():
        for block in model.mixer_blocks:
            for head in block.token_mixing_layer.mixer_heads:
                head.bias.normal_()
                if head.decay_value is not None:
                    head.decay_value.uniform_(0.8, 1.05)
            for p in block.channel_norm.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def lam_of(model):
    return model.mixer_blocks[0].token_mixing_layer.mixer_params()[2]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"d{c.d_model}h{c.n_heads}n{c.context_length}")
def test_three_forms_agree_float64(config):
    model = randomized(config)
    T = min(config.context_length, 150)
    ids = torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        naive, parallel, recurrent = (model(ids, mixer=m) for m in ("naive", "parallel", "recurrent"))
    scale = naive.abs().max()
    assert (naive - parallel).abs().max() <= 1e-9 * scale
    assert (naive - recurrent).abs().max() <= 1e-9 * scale


@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: f"d{c.d_model}n{c.context_length}")
def test_three_forms_agree_float32(config):
    model = randomized(config, torch.float32)
    T = min(config.context_length, 150)
    ids = torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        naive, parallel, recurrent = (model(ids, mixer=m) for m in ("naive", "parallel", "recurrent"))
    torch.testing.assert_close(parallel, naive, rtol=1e-4, atol=1e-4 * naive.abs().max().item())
    torch.testing.assert_close(recurrent, naive, rtol=1e-4, atol=1e-4 * naive.abs().max().item())


def test_naive_is_the_paper_matrix():
    """The paper builds M from clip(decay)**((j-i)/c) over all n positions, right-padded."""
    config = SRMConfig(20, 8, 1, 2, 1024)
    model = randomized(config)
    mixer = model.mixer_blocks[0].token_mixing_layer
    w, beta, lam = mixer.mixer_params()
    n = config.context_length
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    u = torch.randn(1, n, 2, 4, dtype=torch.float64)
    for h, head in enumerate(mixer.mixer_heads):
        decay = torch.clip(head.decay_value, 0.9, 1) ** ((j - i) / config.decay_constant)
        v = head.weight.reshape(-1)
        M = torch.where(j >= i, (v[j] if h == 0 else v[i]) * decay, torch.zeros(()))
        expected = u[0, :, h].T @ M + head.bias  # [hd, n]
        got, _ = naive_mixer(u, w, beta, lam)
        torch.testing.assert_close(got[0, :, h].T, expected, rtol=1e-10, atol=1e-10)


def test_decay_below_clip_is_clipped():
    model = randomized(SRMConfig(20, 8, 1, 2, 40))
    mixer = model.mixer_blocks[0].token_mixing_layer
    with torch.no_grad():
        mixer.mixer_heads[0].decay_value.fill_(0.5)
        mixer.mixer_heads[1].decay_value.fill_(1.3)
    lam = mixer.mixer_params()[2]
    assert lam.tolist() == [0.9, 1.0]


def test_long_sequence_is_stable_in_float32():
    """lam = 0.9 over 1024 steps: the chunked scan must not overflow (lam**-1024 ~ 1e47)."""
    H, T = 2, 1024
    u = torch.randn(1, T, H, 3)
    w = torch.randn(H, T)
    beta = torch.randn(H, T)
    lam = torch.full((H,), 0.9)
    y32, s32 = parallel_mixer(u, w, beta, lam)
    y64, s64 = recurrent_mixer(u.double(), w.double(), beta.double(), lam.double())
    assert torch.isfinite(y32).all()
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s32.double(), s64, rtol=1e-4, atol=1e-4)


def test_prefill_state_equals_stepping_and_respects_lengths():
    config = CONFIGS[2]
    model = randomized(config)
    ids = torch.randint(0, config.vocab_size, (3, 30), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([30, 11, 1])
    with torch.no_grad():
        _, states = model.prefill(ids, lengths=lengths)
        for b, length in enumerate(lengths.tolist()):
            stepped = model.empty_state(1)
            for t in range(length):
                logits, stepped = model.step(ids[b : b + 1, t], torch.tensor([t]), stepped)
            torch.testing.assert_close(states[:, b], stepped[:, 0], rtol=1e-10, atol=1e-12)
            full_logits, _ = model.prefill(ids[b : b + 1, :length])
            torch.testing.assert_close(logits[0], full_logits[0, -1], rtol=1e-10, atol=1e-10)


def test_batched_step_with_mixed_positions():
    """Samples at different positions in one step equal each sample stepped alone."""
    config = CONFIGS[0]
    model = randomized(config)
    ids = torch.randint(0, config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(4))
    lengths = [20, 7, 13]
    with torch.no_grad():
        _, states = model.prefill(ids, lengths=torch.tensor(lengths))
        nxt = torch.tensor([1, 2, 3])
        logits, new_states = model.step(nxt, torch.tensor(lengths), states)
        for b, length in enumerate(lengths):
            alone, _ = model.prefill(torch.cat([ids[b, :length], nxt[b : b + 1]]).view(1, -1))
            torch.testing.assert_close(logits[b], alone[0, -1], rtol=1e-10, atol=1e-10)


def test_greedy_recurrent_equals_parallel_recomputation():
    config = CONFIGS[0]
    model = randomized(config)
    prompt = torch.randint(0, config.vocab_size, (6,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        generated = model.generate_greedy(prompt, 30)
        sequence = prompt.clone()
        for _ in range(30):
            nxt = model(sequence.view(1, -1), mixer="parallel")[0, -1].argmax().view(1)
            sequence = torch.cat([sequence, nxt])
    assert generated.tolist() == sequence[6:].tolist()


def test_context_length_is_enforced():
    config = CONFIGS[0]
    model = randomized(config)
    with pytest.raises(ValueError, match="exceeds the context length 40"):
        model(torch.zeros(1, 41, dtype=torch.long))
    with pytest.raises(ValueError, match="past the context length"):
        model.step(torch.tensor([0]), torch.tensor([40]), model.empty_state(1))
