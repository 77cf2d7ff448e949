"""Every bad input to the checkpoint loader and to ``srm-max convert`` ends in an error
naming the problem, and convert then writes nothing."""

import json
import os
import pickle
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from srm_max.checkpoints.convert import convert
from srm_max.checkpoints.format import load_checkpoint, save_checkpoint
from srm_max.cli import main as cli_main
from srm_max.errors import CheckpointError, ConvertError
from tests.support.srm_sources import CONFIG, snapshot, write_source


# ---------------------------------------------------------------- bad inputs: loader


@pytest.fixture
def good_dir(model, tmp_path):
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return save_checkpoint(tmp_path / "ckpt", CONFIG, weights)


def rewrite_weights(directory: Path, edit):
    from safetensors.numpy import load_file, save_file as save_np

    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_np(tensors, str(directory / "model.safetensors"))


BAD_WEIGHTS = {
    "missing key": (lambda t: t.pop("mixer_blocks.1.token_norm.bias"), "missing key 'mixer_blocks.1.token_norm.bias'"),
    "unexpected key": (lambda t: t.update(extra=np.zeros(3, np.float32)), "unexpected key 'extra'"),
    "wrong shape": (
        lambda t: t.update({"output_layer.weight": np.zeros((48, 13), np.float32)}),
        r"'output_layer.weight' has shape \[48, 13\] but the config implies \[48, 12\]",
    ),
    "unsupported dtype": (
        lambda t: t.update({"output_layer.weight": t["output_layer.weight"].astype(np.int32)}),
        "'output_layer.weight' has unsupported dtype I32",
    ),
    "nan": (lambda t: t["input_layer.weight"].__setitem__((3, 4), np.nan), "'input_layer.weight' contains NaN"),
    "inf": (lambda t: t["mixer_blocks.0.channel_norm.bias"].__setitem__(0, np.inf), "'mixer_blocks.0.channel_norm.bias' contains Inf"),
}


@pytest.mark.parametrize("case", BAD_WEIGHTS)
def test_loader_names_bad_weights(case, good_dir):
    edit, message = BAD_WEIGHTS[case]
    rewrite_weights(good_dir, edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(good_dir)


def test_loader_config_disagrees_with_tensors(good_dir):
    data = json.loads((good_dir / "config.json").read_text())
    data["context_length"] = 64
    (good_dir / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"mixer_heads.0.weight' has shape \[1, 40\] but the config implies \[1, 64\] \(config and tensors disagree\)"):
        load_checkpoint(good_dir)


@pytest.mark.parametrize("content,message", [
    ("{", "config.json: not valid JSON"),
    (" " * (1 << 20) + "{}", r"config.json: over 1 MiB, too large for a config file"),
    ('{"vocab_size": 48}', r"missing config field\(s\) \['d_model'"),
    ('{"vocab_size": 48, "d_model": 12, "n_layers": 2, "n_heads": 2, "context_length": 40, "colour": 1}',
     r"unknown config field\(s\) \['colour'\]"),
    ('{"vocab_size": -1, "d_model": 12, "n_layers": 2, "n_heads": 2, "context_length": 40}',
     "vocab_size must be a positive integer, got -1"),
    ('{"vocab_size": 48, "d_model": 12, "n_layers": 2, "n_heads": 2, "context_length": 40, "architecture": "gpt"}',
         r"config.json: unknown architecture 'gpt' \(known: srm, pha\)"),
])
def test_loader_names_bad_config(content, message, good_dir):
    (good_dir / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(good_dir)


def test_loader_truncated_and_corrupt_files(good_dir):
    path = good_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="model.safetensors: tensor .* data ends at byte .*truncated"):
        load_checkpoint(good_dir)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated"):
        load_checkpoint(good_dir)
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with pytest.raises(CheckpointError, match="corrupt or truncated header"):
        load_checkpoint(good_dir)
    path.write_bytes(data[:8] + b"\xff" * 20 + data[28:])
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_checkpoint(good_dir)
    path.unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: weights file not found"):
        load_checkpoint(good_dir)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_checkpoint(good_dir / "nowhere")


# ---------------------------------------------------------------- bad inputs: convert


class Payload:
    """Runs a command when unpickled: weights_only=True must refuse it."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_convert_refuses_malicious_pickle(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"input_layer.weight": Payload()}, f)
    with pytest.raises(ConvertError, match="evil.pt: (refused to load|cannot read torch file)"):
        convert(tmp_path / "evil.pt", tmp_path / "out")
    assert not (tmp_path / "PWNED").exists()
    assert not (tmp_path / "out").exists()


def test_convert_never_overwrites_without_force(model, tmp_path):
    src = write_source("pt", model, tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    before = snapshot(tmp_path / "out")
    with pytest.raises(ConvertError, match="out: already exists \\(use --force to overwrite\\)"):
        convert(src, tmp_path / "out")
    assert snapshot(tmp_path / "out") == before
    convert(src, tmp_path / "out", force=True)
    assert not (tmp_path / "out" / "precious.txt").exists()
    assert (tmp_path / "out" / "parity.json").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda sd: sd.pop("mixer_blocks.0.token_mixing_layer.out_proj.bias"), "missing key 'mixer_blocks.0.token_mixing_layer.out_proj.bias'"),
    (lambda sd: sd.update(surprise=torch.zeros(2)), "unexpected key 'surprise'"),
    (lambda sd: sd.update({"mixer_blocks.1.token_norm.weight": torch.zeros(7)}), r"token_norm.weight' has shape \[7\]"),
    (lambda sd: sd.update({"output_layer.weight": torch.zeros(48, 12, dtype=torch.long)}), "'output_layer.weight' has unsupported dtype torch.int64"),
    (lambda sd: sd["input_layer.weight"].__setitem__((0, 0), float("nan")), "'input_layer.weight' contains NaN"),
    (lambda sd: sd.update({"input_layer.weight": "hello"}), "entry 'input_layer.weight' is a str, not a tensor"),
])
def test_convert_names_bad_weights_and_writes_nothing(edit, message, model, tmp_path):
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    edit(sd)
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(ConvertError, match=message):
        convert(tmp_path / "bad.pt", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]


def test_convert_bad_sources(model, tmp_path):
    with pytest.raises(ConvertError, match="nothing.pt: source not found"):
        convert(tmp_path / "nothing.pt", tmp_path / "out")
    (tmp_path / "weights.onnx").write_bytes(b"x")
    with pytest.raises(ConvertError, match="unknown source type '.onnx'"):
        convert(tmp_path / "weights.onnx", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertError, match="empty: directory holds no model.safetensors"):
        convert(tmp_path / "empty", tmp_path / "out")
    src = write_source("pt", model, tmp_path)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConvertError, match="model.pt: cannot read torch file"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_parity_failure_writes_nothing(model, tmp_path, monkeypatch):
    import srm_max.checkpoints.convert as convert_module

    real = convert_module.compute_parity

    def broken(*args, **kwargs):
        certificate = real(*args, **kwargs)
        return certificate | {"passed": False}

    monkeypatch.setattr(convert_module, "compute_parity", broken)
    src = write_source("pt", model, tmp_path)
    with pytest.raises(ConvertError, match="parity check failed.*nothing was written"):
        convert(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_cli_convert_reports_errors_cleanly(model, tmp_path, capsys):
    src = write_source("pt", model, tmp_path)
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert '"passed": true' in capsys.readouterr().out
    assert cli_main(["convert", str(src), str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "out")


# ---------------------------------------------------------------- unreadable files, odd arguments


def test_a_config_json_that_cannot_be_read_is_named_everywhere(good_dir, tmp_path, capsys):
    from srm_max.serve.generator import Generator
    from tests.support.tokenizers import word_tokenizer

    word_tokenizer(CONFIG.vocab_size).save(str(good_dir / "tokenizer.json"))  # generate asks for one first
    (good_dir / "config.json").unlink()
    (good_dir / "config.json").mkdir()
    problem = f"{good_dir / 'config.json'}: is a directory, not a regular file"
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        load_checkpoint(good_dir)
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        Generator.from_pretrained(good_dir, warmup=False)
    for argv in (["generate", "--model", str(good_dir), "hi"], ["compile", str(good_dir)]):
        assert cli_main(argv) == 2
        assert capsys.readouterr().err == f"srm-max {argv[0]}: error: {problem}\n"
    assert cli_main(["verify", str(good_dir), "--no-engine"]) == 1
    assert capsys.readouterr().out == f"FAIL integrity: {problem}\n"
    src = tmp_path / "src.safetensors"
    shutil.copyfile(good_dir / "model.safetensors", src)
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--config", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"srm-max convert: error: {tmp_path}: is a directory, not a regular file\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tokens", [0, -5, True, 2.5])
def test_parity_tokens_must_be_a_positive_integer(tokens, model, tmp_path):
    src = write_source("pt", model, tmp_path)
    with pytest.raises(ConvertError, match=re.escape(f"--parity-tokens {tokens!r}: expected a positive integer")):
        convert(src, tmp_path / "out", parity_tokens=tokens)
    assert not (tmp_path / "out").exists()


def test_cli_parity_tokens_below_one_is_an_error(model, tmp_path, capsys):
    src = write_source("pt", model, tmp_path)
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--parity-tokens", "-5"]) == 2
    assert "error: --parity-tokens -5: expected a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key,hint", [("junk", "known: vocab_size, d_model"), ("n_head", "did you mean 'n_heads'?")])
def test_an_override_of_no_config_field_is_named(key, hint, model, tmp_path):
    src = write_source("pt", model, tmp_path)
    with pytest.raises(ConvertError, match=re.escape(f"--override: unknown config field(s) ['{key}'] (") + ".*" + hint):
        convert(src, tmp_path / "out", overrides={key: 1})
    save_checkpoint(tmp_path / "ours", CONFIG, {k: v.detach().numpy() for k, v in model.state_dict().items()})
    with pytest.raises(ConvertError, match=re.escape(f"--override: unknown config field(s) ['{key}']")):
        convert(tmp_path / "ours", tmp_path / "out", overrides={key: 1})  # its config.json read, then overridden
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key,shape,problem", [
    ("input_layer.weight", (3, 3), "d_model 3 is not divisible by n_heads 2"),  # an invalid config
    # a valid config (context length 7) that the other tensors disagree with
    ("mixer_blocks.0.token_mixing_layer.mixer_heads.0.weight", (1, 7), r"has shape \[40\] but the config implies \[7\]"),
])
def test_a_tensor_the_config_is_inferred_from_is_named_with_its_shape(key, shape, problem, model, tmp_path):
    from safetensors.torch import save_file

    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()} | {key: torch.zeros(shape)}
    save_file(sd, str(tmp_path / "odd.safetensors"))
    with pytest.raises(ConvertError, match=problem) as raised:
        convert(tmp_path / "odd.safetensors", tmp_path / "out")
    assert f"{key!r} {list(shape)}" in str(raised.value).split("; the config was inferred from ")[1]
    assert not (tmp_path / "out").exists()
