"""Inputs found by fuzzing: malformed safetensors headers, torch files that are not state dicts
of dense tensors, huge override values, and outputs that overlap the source. Each ends in a
clean error naming the file or argument, and nothing is written."""

import json
import re
import struct

import numpy as np
import pytest
import torch

from srm_max.checkpoints.convert import convert, parse_override
from srm_max.checkpoints.format import save_checkpoint
from srm_max.checkpoints.safetensors_io import SafetensorsFile
from srm_max.cli import main as cli_main
from srm_max.errors import CheckpointError, ConvertError
from tests.support.srm_sources import CONFIG, snapshot, write_source
from tests.support.tokenizers import word_tokenizer

# ---------------------------------------------------------------- safetensors headers

A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
B = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}


def write_raw(path, header_text: str, data_size: int = 16):
    encoded = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data_size))
    return path


@pytest.mark.parametrize("header,data_size,message", [
    ({"a": A | {"dtype": ["F32"]}, "b": B}, 16, r"tensor 'a': unsupported dtype \['F32'\]"),
    ({"a": A | {"dtype": {"F32": 1}}, "b": B}, 16, r"tensor 'a': unsupported dtype \{'F32': 1\}"),
    ({"a": A | {"shape": "2"}, "b": B}, 16, r"tensor 'a': invalid shape '2'"),
    ({"a": A | {"shape": [True, 2]}, "b": B}, 16, r"tensor 'a': invalid shape \[True, 2\]"),
    ({"a": A | {"data_offsets": [0, "8"]}, "b": B}, 16, r"tensor 'a': invalid data_offsets \[0, '8'\]"),
    ({"a": A, "b": B | {"data_offsets": [4, 12]}}, 16, r"tensor 'b': data_offsets \[4, 12\] overlaps tensor 'a'"),
    ({"a": A, "b": B | {"data_offsets": [12, 20]}}, 20, r"tensor 'b': data_offsets \[12, 20\] leaves a gap"),
    ({"a": A, "b": B}, 24, "the tensors cover 16 bytes of data but the file holds 24"),
    ({"__metadata__": {"format": 1}, "a": A, "b": B}, 16, "__metadata__ is not a map of strings"),
])
def test_a_malformed_header_is_refused_by_name(header, data_size, message, tmp_path):
    path = write_raw(tmp_path / "x.safetensors", json.dumps(header), data_size)
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + ".*" + message):
        SafetensorsFile(path)


def test_a_duplicate_header_key_is_refused(tmp_path):
    text = '{"a": %s, "a": %s}' % (json.dumps(A), json.dumps(A))
    path = write_raw(tmp_path / "x.safetensors", text, 8)
    with pytest.raises(CheckpointError, match="corrupt safetensors header \\(duplicate key 'a'\\)"):
        SafetensorsFile(path)


def test_a_header_that_tiles_the_data_is_read(tmp_path):
    path = write_raw(tmp_path / "x.safetensors", json.dumps({"b": B, "a": A, "empty": A | {
        "shape": [0], "data_offsets": [8, 8]}}))
    assert SafetensorsFile(path).read("b").tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- torch sources


@pytest.mark.parametrize("content,message", [
    (b"", "empty file, not a PyTorch checkpoint"),
    (b"(", "cannot read torch file, truncated or corrupt$"),  # EOFError with no message
    (b"hello, this is text\n", r"not a PyTorch checkpoint \(KeyError: \d+\)"),
    (b"\x93", r"refused to load: not a plain tensor state dict \(Unsupported operand 147\)"),
    (b"\x80\x02}q\x00.", r"cannot read torch file, truncated or corrupt \(Invalid magic number"),
])
def test_a_file_that_is_no_torch_checkpoint_is_named(content, message, tmp_path, capsys):
    (tmp_path / "junk.pt").write_bytes(content)
    with pytest.raises(ConvertError, match=re.escape(str(tmp_path / "junk.pt")) + ": (" + message + ")") as raised:
        convert(tmp_path / "junk.pt", tmp_path / "out")
    assert "weights_only" not in str(raised.value)  # torch's advice to load unsafely is not passed on
    assert cli_main(["convert", str(tmp_path / "junk.pt"), str(tmp_path / "out")]) == 2
    assert "srm-max convert: error: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda sd: sd.update({0: torch.zeros(2)}), "key 0 is a int, not a string"),
    (lambda sd: sd.update({"input_layer.weight": torch.empty(48, 12, device="meta")}),
     "tensor 'input_layer.weight' is on the meta device"),
    (lambda sd: sd.update({"input_layer.weight": torch.eye(48, 12).to_sparse()}),
     "tensor 'input_layer.weight' has layout torch.sparse_coo; expected a dense tensor"),
])
def test_a_state_dict_entry_that_is_no_dense_tensor_is_named(edit, message, model, tmp_path):
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    edit(sd)
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert(tmp_path / "bad.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_torch_file_this_user_may_not_read_is_not_called_corrupt(model, tmp_path, monkeypatch):
    """torch.load opens the file itself: its PermissionError says the file cannot be read, not
    that it is truncated (as root ignores file modes, the refusal is simulated)."""
    torch.save(model.state_dict(), tmp_path / "model.pt")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "model.pt"))

    monkeypatch.setattr(torch, "load", refused)
    with pytest.raises(ConvertError, match=re.escape(f"{tmp_path / 'model.pt'}: cannot be read (Permission denied)")):
        convert(tmp_path / "model.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_override_too_large_to_read_is_an_error(model, tmp_path, capsys):
    too_large = r"override 'vocab_size': value '9{60}'\.\.\. \(5000 characters\) is too large"
    with pytest.raises(ConvertError, match=too_large):
        parse_override("vocab_size=" + "9" * 5000)
    with pytest.raises(ConvertError, match="override 'n_layers': value .* is too large or too deeply nested"):
        parse_override("n_layers=" + "[" * 100_000)
    with pytest.raises(ConvertError, match="override 'decay': value 'nope' is not valid JSON"):
        parse_override("decay=nope")
    src = write_source("pt", model, tmp_path)
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--override", "vocab_size=" + "7" * 5000]) == 2
    assert "error: override 'vocab_size'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the output overlaps the source


@pytest.fixture
def ours(model, tmp_path):
    """A checkpoint of this project's format with a tokenizer and a file of the user's."""
    word_tokenizer(CONFIG.vocab_size).save(str(tmp_path / "tok.json"))
    path = save_checkpoint(tmp_path / "ours", CONFIG, {k: v.detach().numpy() for k, v in model.state_dict().items()},
                           tokenizer=tmp_path / "tok.json")
    (path / "notes.txt").write_text("keep me")
    return path


def test_an_output_overlapping_the_source_is_refused_even_with_force(ours, tmp_path):
    (tmp_path / "link").symlink_to(ours)
    before = snapshot(ours)
    for src, dst, problem in [
        (ours, ours, "would replace the source"),
        (ours, tmp_path / "link", "would replace the source"),
        (ours / "model.safetensors", ours, "would replace the source"),
        (ours / "model.safetensors", tmp_path, "would replace the source"),
        (ours, ours / "converted", "lies inside the source"),
        (ours, ours / ".." / "ours", "would replace the source"),
    ]:
        with pytest.raises(ConvertError, match=re.escape(f"{dst}: the output {problem}")):
            convert(src, dst, force=True)
    assert snapshot(ours) == before
    assert not (ours / "converted").exists()


def test_a_trainer_folder_is_not_replaced_by_its_own_conversion(model, tmp_path, capsys):
    trainer = tmp_path / "trainer"
    trainer.mkdir()
    write_source("trainer_output", model, trainer)
    before = snapshot(trainer)
    for src in (trainer, trainer / "checkpoint-1000"):
        assert cli_main(["convert", str(src), str(trainer), "--force"]) == 2
        assert "would replace the source" in capsys.readouterr().err
    assert snapshot(trainer) == before


def test_converting_a_checkpoint_of_ours_keeps_its_tokenizer(ours, tmp_path):
    (ours / "tokenizer_config.json").write_text('{"chat_template": "mine"}\n')
    convert(ours, tmp_path / "out", dtype="bfloat16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (ours / name).read_bytes(), name
    np.testing.assert_array_equal(  # the dtype did change: the weights were converted, not copied
        SafetensorsFile(tmp_path / "out" / "model.safetensors").dtype("input_layer.weight"), "BF16")
