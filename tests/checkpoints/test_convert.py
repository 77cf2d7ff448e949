"""``srm-max convert``: round trips of every source layout, dtype and architecture, the key
mapping (prefixes, paper variants), and what the parity certificate proves."""

import json
import re

import numpy as np
import pytest
import torch

from srm_max.checkpoints.convert import convert
from srm_max.checkpoints.format import load_checkpoint
from srm_max.checkpoints.parity import reference_model
from srm_max.errors import ConvertError
from srm_max.models.srm.config import SRMConfig
from srm_max.reference.srm import SRM
from tests.support.srm_sources import CONFIG, KINDS, TORCH_DTYPES, logits_of, write_source


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_each_source_kind(kind, model, ids, tmp_path):
    (tmp_path / "src").mkdir()  # beside the output: convert refuses an output inside its source
    src = write_source(kind, model, tmp_path / "src")
    certificate = convert(src, tmp_path / "out")
    assert certificate["passed"]
    loaded = load_checkpoint(tmp_path / "out")
    assert loaded.config == CONFIG
    assert loaded.dtype == "float32"
    torch.testing.assert_close(logits_of(loaded.weights, ids), model(ids), rtol=0, atol=0)
    saved = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert saved["passed"] and set(saved["max_abs_delta"]) == {
        "naive_vs_parallel", "naive_vs_recurrent", "parallel_vs_recurrent"}
    assert saved["source_forward"]["passed"] and saved["source_forward"]["max_abs_delta"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_each_dtype(dtype, model, ids, tmp_path):
    src = write_source("pt", model, tmp_path)
    certificate = convert(src, tmp_path / "out", dtype=dtype)
    assert certificate["source_forward"]["max_abs_delta"] == 0.0  # the source, rounded alike, computes the same
    loaded = load_checkpoint(tmp_path / "out")
    assert loaded.dtype == dtype
    # The stored weights are exactly torch's rounding of the originals.
    for key, value in model.state_dict().items():
        expected = value.to(TORCH_DTYPES[dtype]).to(torch.float32).numpy()
        np.testing.assert_array_equal(loaded.weights[key], expected, err_msg=key)
    rounded = type(model)(CONFIG)
    rounded.load_state_dict({k: v.to(TORCH_DTYPES[dtype]).float() for k, v in model.state_dict().items()})
    torch.testing.assert_close(logits_of(loaded.weights, ids), rounded.eval()(ids), rtol=0, atol=0)


def test_bfloat16_source_keeps_its_dtype(model, tmp_path):
    torch.save({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "out")
    assert load_checkpoint(tmp_path / "out").dtype == "bfloat16"


def test_no_decay_variant_and_overrides(tmp_path):
    config = SRMConfig(30, 8, 1, 2, 24, decay=False)
    torch.save(SRM(config).state_dict(), tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "out", overrides={"layer_norm_eps": 1e-6})
    loaded = load_checkpoint(tmp_path / "out")
    assert loaded.config.decay is False and loaded.config.layer_norm_eps == 1e-6
    with pytest.raises(ConvertError, match="n_heads must be even"):
        convert(tmp_path / "m.pt", tmp_path / "out2", overrides={"n_heads": 3})
    with pytest.raises(ConvertError, match=r"missing key 'mixer_blocks.0.token_mixing_layer.proj_head.2.weight'"):
        convert(tmp_path / "m.pt", tmp_path / "out2", overrides={"n_heads": 4})
    assert not (tmp_path / "out2").exists()


def test_tokenizer_is_copied_and_checked(model, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(CONFIG.vocab_size)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_source("pt", model, tmp_path)
    convert(src, tmp_path / "out", tokenizer=tmp_path / "tokenizer.json")
    assert load_checkpoint(tmp_path / "out").tokenizer_path == tmp_path / "out" / "tokenizer.json"

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(CONFIG.vocab_size + 5)}, unk_token="w0"))
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(ConvertError, match=f"big.json: tokenizer has {CONFIG.vocab_size + 5} tokens with ids up to "
                                           f"{CONFIG.vocab_size + 4}, but the model's vocabulary is {CONFIG.vocab_size}"):
        convert(src, tmp_path / "out2", tokenizer=tmp_path / "big.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConvertError, match="bad.json: not a valid tokenizer.json"):
        convert(src, tmp_path / "out2", tokenizer=tmp_path / "bad.json")
    assert not (tmp_path / "out2").exists()
# ---------------------------------------------------------------- PHA checkpoints


def test_pha_round_trip_through_convert(tmp_path):
    from srm_max.models.pha.config import PHAConfig
    from srm_max.reference.pha import PHA

    config = PHAConfig(vocab_size=40, d_model=16, n_layers=2, context_length=24, n_q_heads=2, n_kv_heads=1,
                       dss_state_size=8, tie_embeddings=False)
    torch.manual_seed(0)
    model = PHA(config).eval()
    torch.save(model.state_dict(), tmp_path / "pha.pt")
    with pytest.raises(ConvertError, match="pha.pt: a PHA checkpoint; pass its config.json with --config"):
        convert(tmp_path / "pha.pt", tmp_path / "out")
    config.save(tmp_path / "pha_config.json")
    certificate = convert(tmp_path / "pha.pt", tmp_path / "out", config=tmp_path / "pha_config.json", dtype="bfloat16")
    assert certificate["passed"] and set(certificate["max_abs_delta"]) == {
        "fft_vs_recurrent", "fft_vs_decode", "recurrent_vs_decode"}
    assert certificate["source_forward"]["model"] == "srm_max.reference PHA"
    assert certificate["source_forward"]["form"] == "fft" and certificate["source_forward"]["max_abs_delta"] == 0.0
    loaded = load_checkpoint(tmp_path / "out")
    assert loaded.config == config and loaded.dtype == "bfloat16"
    ids = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = PHA(config)
    expected.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(reference_model(config, loaded.weights, torch.float32)(ids), expected.eval()(ids),
                                   rtol=0, atol=0)
    # our own format converts again (e.g. back to float32), its config.json found beside the weights
    convert(tmp_path / "out", tmp_path / "out32", dtype="float32")
    assert load_checkpoint(tmp_path / "out32").config == config


# ---------------------------------------------------------------- key mapping: prefixes and variants


@pytest.mark.parametrize("prefix", ["_orig_mod.module.", "module._orig_mod.", "module.module.", "_orig_mod.module._orig_mod."])
def test_prefixes_are_stripped_in_any_nesting_and_order(prefix, model, ids, tmp_path):
    # "_orig_mod.module." is what torch.compile over DDP writes
    torch.save({prefix + k: v for k, v in model.state_dict().items()}, tmp_path / "wrapped.pt")
    certificate = convert(tmp_path / "wrapped.pt", tmp_path / "out")
    loaded = load_checkpoint(tmp_path / "out")
    torch.testing.assert_close(logits_of(loaded.weights, ids), model(ids), rtol=0, atol=0)
    assert certificate["source_forward"]["model"].endswith("inside " + prefix.rstrip("."))


def test_keys_that_collide_after_stripping_are_named(model, tmp_path):
    sd = dict(model.state_dict())
    sd["module.output_layer.weight"] = sd["output_layer.weight"].clone()
    torch.save(sd, tmp_path / "twice.pt")
    with pytest.raises(ConvertError, match="keys 'output_layer.weight' and 'module.output_layer.weight' both map to 'output_layer.weight'"):
        convert(tmp_path / "twice.pt", tmp_path / "out")


def paper_variant(variant: str, model: SRM) -> dict:
    """The state dict of the paper code's MLPMixer with another token mixer
    (blbadger/mrm ``repeat_main.py``), built from ``model``'s other layers."""
    c = CONFIG
    d, n, H = c.d_model, c.context_length, c.n_heads
    sd = {k: v for k, v in model.state_dict().items() if ".token_mixing_layer." not in k}
    for layer in range(c.n_layers):
        p = f"mixer_blocks.{layer}.token_mixing_layer."
        if variant == "parallel_heads":  # ParallelRepeatHeads: one HeadedRepeatCausalLinear for all heads
            sd |= {p + "in_proj.weight": torch.randn(d, d), p + "in_proj.bias": torch.zeros(d),
                   p + "out_proj.weight": torch.randn(d, d), p + "out_proj.bias": torch.zeros(d),
                   p + "mixer_heads.weight": torch.randn(H, n), p + "mixer_heads.bias": torch.zeros(H, n),
                   p + "mixer_heads.decay_value": torch.ones(2, 1)}
        elif variant in ("use_projections=False", "combined_heads"):
            rows = 2 if variant == "combined_heads" else 1  # CombinedRepeatCausalLinear: a row and a column vector
            for h in range(H):
                sd |= {p + f"mixer_heads.{h}.weight": torch.randn(rows, n), p + f"mixer_heads.{h}.bias": torch.zeros(n),
                       p + f"mixer_heads.{h}.decay_value": torch.ones(rows, 1)}
                if variant == "combined_heads":
                    sd |= {p + f"proj_head.{h}.weight": torch.randn(c.head_dim, d), p + f"proj_head.{h}.bias": torch.zeros(c.head_dim)}
            if variant == "combined_heads":
                sd |= {p + "out_proj.weight": torch.randn(d, d), p + "out_proj.bias": torch.zeros(d)}
        elif variant == "heads=None":  # RowRepeatCausalLinear over all channels
            sd |= {p + "weight": torch.randn(1, n), p + "bias": torch.zeros(n)}
        elif variant == "kernel>1":  # KernelRepeatLinear, kernel 3
            sd |= {p + "weight": torch.randn(3, n), p + "bias": torch.zeros(n), p + "decay_value": torch.ones(2, 1)}
        else:
            raise ValueError(variant)
    return sd


@pytest.mark.parametrize("variant,key", [
    ("parallel_heads", "token_mixing_layer.in_proj.weight"),
    ("use_projections=False", "token_mixing_layer.mixer_heads.0.weight"),
    ("combined_heads", "token_mixing_layer.mixer_heads.0.weight"),
    ("heads=None", "token_mixing_layer.weight"),
    ("kernel>1", "token_mixing_layer.weight"),
])
def test_unsupported_paper_variants_are_refused_by_name(variant, key, model, tmp_path):
    torch.save({"module." + k: v for k, v in paper_variant(variant, model).items()}, tmp_path / "variant.pt")
    with pytest.raises(ConvertError, match=rf"the paper code's {re.escape(variant)} \(key 'mixer_blocks.0.{re.escape(key)}'\) "
                                           r"variant is not supported"):
        convert(tmp_path / "variant.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- what the certificate proves


def test_certificate_says_what_it_proves(model, tmp_path):
    certificate = convert(write_source("pt", model, tmp_path), tmp_path / "out")
    assert certificate["proves"].startswith("internal consistency of the converted weights: ")
    assert "cannot catch a wrong key mapping" in certificate["proves"]
    assert "source_forward: " in certificate["proves"]
    assert certificate["source_forward"] == {
        "model": "srm_max.reference SRM", "form": "naive", "max_abs_delta": 0.0,
        "tolerance": certificate["tolerance"], "passed": True}
    assert json.loads((tmp_path / "out" / "parity.json").read_text())["source_forward"] == certificate["source_forward"]


def test_source_forward_rebuilds_the_dropout_layout(model, tmp_path):
    certificate = convert(write_source("dropout_variant", model, tmp_path), tmp_path / "out", dtype="bfloat16")
    checked = certificate["source_forward"]
    assert checked["model"] == "srm_max.reference SRM with the dropout channel MLP (Linear, SiLU, Dropout, Linear) inside module"
    assert checked["passed"] and checked["max_abs_delta"] == 0.0  # the source is rounded to bfloat16 as well


def test_source_forward_catches_a_wrong_key_mapping(model, tmp_path, monkeypatch):
    import srm_max.checkpoints.convert as convert_module

    real_normalize, real_parity = convert_module.normalize_keys, convert_module.compute_parity
    certificates = []

    def swap_two_heads(tensors, source):
        out = real_normalize(tensors, source)
        a, b = (f"mixer_blocks.0.token_mixing_layer.proj_head.{h}.weight" for h in (0, 1))
        return out | {a: out[b], b: out[a]}

    def recording(*args, **kwargs):
        certificates.append(real_parity(*args, **kwargs))
        return certificates[-1]

    monkeypatch.setattr(convert_module, "normalize_keys", swap_two_heads)
    monkeypatch.setattr(convert_module, "compute_parity", recording)
    src = write_source("pt", model, tmp_path)
    with pytest.raises(ConvertError, match="source-forward check failed: .* the key mapping is wrong; nothing was written"):
        convert(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    (certificate,) = certificates
    # the forms agree on the wrongly mapped weights: only the source forward sees the error
    assert all(d <= certificate["tolerance"] for d in certificate["max_abs_delta"].values())
    assert certificate["source_forward"]["max_abs_delta"] > 1e3 * certificate["tolerance"]


def test_source_forward_null_with_reason_when_no_layout_fits(model, ids, tmp_path):
    sd = {("module." if "input_layer" in k else "") + k: v for k, v in model.state_dict().items()}
    torch.save(sd, tmp_path / "mixed.pt")
    certificate = convert(tmp_path / "mixed.pt", tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert saved["passed"] and saved["source_forward"] is None
    assert saved["source_forward_reason"].startswith("the keys carry different wrapper prefixes ('', 'module.')")
    assert "source_forward: " not in saved["proves"] and saved == certificate
    torch.testing.assert_close(logits_of(load_checkpoint(tmp_path / "out").weights, ids), model(ids), rtol=0, atol=0)
