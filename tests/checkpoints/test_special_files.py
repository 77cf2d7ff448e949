"""A named pipe, a folder or a device where a command reads a file is refused at once, in one
line naming the path (``files.check_regular_file``): opening a named pipe would block until
something writes to it. A watchdog releases a reader that opens the pipe all the same, so that
it fails its test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from srm_max.checkpoints.convert import convert, file_sha256
from srm_max.checkpoints.format import load_checkpoint, save_checkpoint
from srm_max.checkpoints.parity import read_certificate
from srm_max.checkpoints.safetensors_io import SafetensorsFile
from srm_max.checkpoints.tokenizer import read_tokenizer
from srm_max.cli import main as cli_main
from srm_max.errors import CheckpointError, ConvertError, GenerationError
from srm_max.files import check_regular_file
from srm_max.models.config_io import read_json
from srm_max.serve.generator import Generator
from tests.support.srm_sources import CONFIG, write_source
from tests.support.tokenizers import word_tokenizer

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")

PIPE = "is a named pipe (FIFO), not a regular file"
LIMIT_S = 20
# A separate process, not a thread: the tokenizers library opens a file holding the GIL, so no
# thread of this process could run while it is blocked. After LIMIT_S seconds it opens the pipe's
# writing end (and again, for a reader that reopens it), so that a reader blocked on the pipe reads
# an empty file and returns; the marker file records that it had to.
WATCHDOG = 'sleep "$1"; while [ -p "$2" ] && : > "$2"; do touch "$3"; sleep 0.1; done'


def within(pipe: Path, call, *args, **kwargs):
    """``call(*args, **kwargs)``'s value (or its exception); the test fails instead when the call
    blocked on ``pipe`` until the watchdog released it."""
    marker = pipe.with_name(f"{pipe.name}.released")
    watchdog = subprocess.Popen(["sh", "-c", WATCHDOG, "watchdog", str(LIMIT_S), str(pipe), str(marker)],
                                start_new_session=True)
    try:
        return call(*args, **kwargs)
    finally:
        os.killpg(watchdog.pid, signal.SIGKILL)  # the group holds the watchdog and its sleep only
        watchdog.wait()
        assert not marker.exists(), f"{getattr(call, '__name__', call)} blocked on {pipe} for {LIMIT_S} s"


def pipe_at(path: Path) -> Path:
    """``path``, whatever it was, made a named pipe."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def refused(error: type[Exception], path: Path, call, *args, **kwargs) -> None:
    with pytest.raises(error) as caught:
        within(path, call, *args, **kwargs)
    assert str(caught.value) == f"{path}: {PIPE}"


# ---------------------------------------------------------------- the check itself


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "a named pipe (FIFO)"),
    (lambda p: p.mkdir(), "a directory"),
    (lambda p: (os.mkfifo(p.with_name("pipe")), p.symlink_to(p.with_name("pipe"))), "a named pipe (FIFO)"),
    (lambda p: p.symlink_to("/dev/null"), "a character device"),
], ids=["fifo", "directory", "link to a fifo", "device"])
def test_the_check_names_what_is_there_instead_of_a_file(tmp_path, make, kind):
    path = tmp_path / "config.json"
    make(path)
    with pytest.raises(GenerationError) as caught:
        check_regular_file(path, GenerationError)
    assert str(caught.value) == f"{path}: is {kind}, not a regular file"
    with pytest.raises(CheckpointError) as caught:
        check_regular_file(path, name=f"--text {path}")
    assert str(caught.value) == f"--text {path}: is {kind}, not a regular file"


def test_the_check_passes_files_and_leaves_a_missing_one_to_the_reader(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    for path in ("file", "link", "missing"):
        check_regular_file(tmp_path / path)


# ---------------------------------------------------------------- each reader


@pytest.fixture
def checkpoint(model, tmp_path) -> Path:
    """A saved checkpoint with a tokenizer.json and a parity.json that verify accepts."""
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    word_tokenizer(CONFIG.vocab_size).save(str(tmp_path / "tokenizer.json"))
    path = save_checkpoint(tmp_path / "ckpt", CONFIG, weights, tokenizer=tmp_path / "tokenizer.json")
    certificate = {"weights_sha256": file_sha256(path / "model.safetensors"), "tokens": 8, "batch": 1, "seed": 0}
    (path / "parity.json").write_text(json.dumps(certificate))
    return path


def test_each_checkpoint_reader_refuses_a_pipe(checkpoint):
    for name, read in [("config.json", read_json), ("model.safetensors", SafetensorsFile),
                       ("parity.json", read_certificate)]:
        refused(CheckpointError, pipe_at(checkpoint / name), read, checkpoint / name)
    tokenizer = pipe_at(checkpoint / "tokenizer.json")
    refused(ConvertError, tokenizer, read_tokenizer, tokenizer, ConvertError)


@pytest.mark.parametrize("name, check", [("config.json", "integrity"), ("model.safetensors", "integrity"),
                                         ("parity.json", "integrity"), ("tokenizer.json", "tokenizer")])
def test_verify_fails_on_a_pipe_in_the_checkpoint(checkpoint, capsys, name, check):
    pipe = pipe_at(checkpoint / name)
    assert within(pipe, cli_main, ["verify", str(checkpoint), "--no-engine"]) == 1
    out, err = capsys.readouterr()
    assert f"FAIL {check}: {pipe}: {PIPE}\n" in out and "Traceback" not in err


@pytest.mark.parametrize("name, error", [("config.json", CheckpointError), ("model.safetensors", CheckpointError),
                                         ("tokenizer.json", GenerationError)])
def test_a_model_with_a_pipe_is_refused_before_an_engine_is_built(checkpoint, name, error):
    pipe = pipe_at(checkpoint / name)
    if error is CheckpointError:
        refused(error, pipe, load_checkpoint, checkpoint)
    refused(error, pipe, Generator.from_pretrained, checkpoint, warmup=False)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_generate_names_a_pipe_in_the_model(checkpoint, capsys, name):
    pipe = pipe_at(checkpoint / name)
    assert within(pipe, cli_main, ["generate", "--model", str(checkpoint), "hi"]) == 2
    assert capsys.readouterr().err == f"srm-max generate: error: {pipe}: {PIPE}\n"


def test_save_checkpoint_refuses_a_pipe_for_a_tokenizer(model, tmp_path):
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    pipe = pipe_at(tmp_path / "tokenizer.json")
    refused(CheckpointError, pipe, save_checkpoint, tmp_path / "out", CONFIG, weights, tokenizer=pipe)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- srm-max convert


@pytest.mark.parametrize("source", ["model.pt", "weights.safetensors", "folder/model.safetensors",
                                    "folder/pytorch_model.bin"])
def test_convert_refuses_a_pipe_as_its_source(tmp_path, source):
    pipe = tmp_path / source
    pipe.parent.mkdir(exist_ok=True)
    pipe_at(pipe)
    src = tmp_path / "folder" if source.startswith("folder/") else pipe
    refused(ConvertError, pipe, convert, src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["config", "tokenizer"])
def test_convert_refuses_a_pipe_for_a_config_or_tokenizer(model, tmp_path, option):
    (tmp_path / "src").mkdir()
    src = write_source("pt", model, tmp_path / "src")
    pipe = pipe_at(tmp_path / f"{option}.json")
    refused(ConvertError, pipe, convert, src, tmp_path / "out", **{option: pipe})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["pipe", "junk"])
def test_a_damaged_config_beside_the_source_is_named_not_replaced_by_the_shapes(model, tmp_path, kind):
    """A config.json beside the weights that cannot be read as JSON is likely the run's own,
    damaged: refused (a pipe never opened), not silently stood in for by the inferred config."""
    (tmp_path / "src").mkdir()
    src = write_source("safetensors", model, tmp_path / "src").rename(tmp_path / "src" / "model.safetensors")
    beside = tmp_path / "src" / "config.json"
    if kind == "pipe":
        with pytest.raises(ConvertError, match=re.escape(f"{beside}: {PIPE}; pass --config")):
            within(pipe_at(beside), convert, src, tmp_path / "out", parity_tokens=8)
    else:
        beside.write_text('{"architecture": "srm", "d_model": 2')
        with pytest.raises(ConvertError, match=f"{beside}: not valid JSON .*; pass --config"):
            convert(src, tmp_path / "out", parity_tokens=8)
    assert not (tmp_path / "out").exists()


def test_another_tools_config_beside_the_source_is_left_to_the_shapes(model, tmp_path):
    """A config.json of another tool (a Trainer's) is JSON but not this project's: the shapes
    tell the config, and the tokenizer beside it is not taken for this model's."""
    (tmp_path / "src").mkdir()
    src = write_source("safetensors", model, tmp_path / "src").rename(tmp_path / "src" / "model.safetensors")
    word_tokenizer(CONFIG.vocab_size).save(str(tmp_path / "src" / "tokenizer.json"))
    (tmp_path / "src" / "config.json").write_text('{"model_type": "llama"}')
    convert(src, tmp_path / "out", parity_tokens=8)
    assert load_checkpoint(tmp_path / "out").tokenizer_path is None  # the tokenizer is kept only beside ours


def test_convert_cli_names_a_pipe_in_one_line(tmp_path, capsys):
    pipe = pipe_at(tmp_path / "model.pt")
    assert within(pipe, cli_main, ["convert", str(pipe), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"srm-max convert: error: {pipe}: {PIPE}\n"


# ---------------------------------------------------------------- srm-max eval


def test_eval_refuses_a_pipe_for_its_text_before_loading_a_model(tmp_path, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the text was checked")

    monkeypatch.setattr(Generator, "from_pretrained", no_model)
    pipe = pipe_at(tmp_path / "text.txt")
    assert within(pipe, cli_main, ["--quiet", "eval", "--text", str(pipe)]) == 2
    assert capsys.readouterr().err == f"srm-max eval: error: --text {pipe}: {PIPE}\n"
