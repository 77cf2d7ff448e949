"""Faults: a killed or failing convert leaves the complete old or new output, never half a model
or none."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from srm_max.checkpoints.convert import convert
from srm_max.checkpoints.format import load_checkpoint
from srm_max.errors import ConvertError
from srm_max.models.srm.config import SRMConfig
from srm_max.reference.srm import SRM

# Big enough that writing and certifying take a noticeable time, small enough for CI.
CONFIG = SRMConfig(2048, 128, 4, 2, 256)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "model.pt"
    torch.manual_seed(0)
    torch.save(SRM(CONFIG).state_dict(), path)
    return path


def visible(directory):
    """What a user sees: everything except hidden temporary folders."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


# Runs `convert --force` with the replace step held: the child says when it reaches the
# swap, then waits on stdin, so the test kills it exactly there (no timing guesswork).
HELD_AT_SWAP = """
import sys
import srm_max.files as files
swap = files._swap_into_place
def held(tmp, destination):
    if sys.argv[1] == "before":
        print("at-swap", flush=True)
        sys.stdin.readline()
    swap(tmp, destination)
    if sys.argv[1] == "after":
        print("at-swap", flush=True)
        sys.stdin.readline()
files._swap_into_place = held
from srm_max.cli import main
main(["convert", sys.argv[2], sys.argv[3], "--force", "--parity-tokens", "16"])
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_kill_at_the_replace_leaves_the_complete_old_or_new_model(source, tmp_path, when):
    """The destination holds the complete old or new model at every instant: killed
    right before or right after the swap, never missing, never hidden away."""
    from srm_max.files import exchange_paths

    probe = tmp_path / "probe"
    (probe / "a").mkdir(parents=True)
    (probe / "b").mkdir()
    if not exchange_paths(probe / "a", probe / "b"):
        pytest.skip("this file system has no atomic directory exchange (documented fallback)")
    out = tmp_path / "models" / "out"
    convert(source, out, dtype="bfloat16", parity_tokens=16)  # the old output
    process = subprocess.Popen([sys.executable, "-c", HELD_AT_SWAP, when, str(source), str(out)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout.readline().strip() == "at-swap"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert visible(out.parent) == ["out"]
    now = load_checkpoint(out)
    assert now.dtype == ("bfloat16" if when == "before" else "float32")
    assert (out / "parity.json").exists()


@pytest.mark.parametrize("delay", [0.5, 1.5, 3.0, 5.0])
def test_killed_convert_leaves_old_output_or_nothing(source, tmp_path, delay):
    out = tmp_path / "out"
    convert(source, out, dtype="bfloat16", parity_tokens=16)  # the old output
    old = load_checkpoint(out)
    process = subprocess.Popen(
        [sys.executable, "-m", "srm_max.cli", "convert", str(source), str(out), "--force", "--parity-tokens", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert visible(tmp_path) == ["out"]  # never missing, whenever the kill came
    now = load_checkpoint(out)  # complete: old (bfloat16) or new (float32), never a mix
    assert now.dtype in ("bfloat16", "float32")
    assert (out / "parity.json").exists()
    if now.dtype == old.dtype:
        assert (out / "model.safetensors").stat().st_size == os.path.getsize(old.path / "model.safetensors")


def test_full_disk_is_a_clear_error_and_keeps_the_old_output(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    convert(source, out, parity_tokens=16)
    before = (out / "model.safetensors").read_bytes()
    import srm_max.checkpoints.format as checkpoint

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "write_safetensors", full_disk)
    with pytest.raises(ConvertError, match="out: cannot write \\(No space left on device\\); nothing was written"):
        convert(source, out, force=True, parity_tokens=16)
    assert (out / "model.safetensors").read_bytes() == before
    assert visible(tmp_path) == ["out"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
