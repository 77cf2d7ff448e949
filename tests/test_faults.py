"""Faults: a killed or failing convert leaves the old output or nothing, never half a model."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from srm_max.checkpoint import load_checkpoint
from srm_max.config import SRMConfig
from srm_max.convert import convert
from srm_max.errors import ConvertError
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
    assert visible(tmp_path) in (["out"], [])
    if (tmp_path / "out").exists():
        now = load_checkpoint(out)  # complete: old (bfloat16) or new (float32), never a mix
        assert now.dtype in ("bfloat16", "float32")
        assert (out / "parity.json").exists()
        if now.dtype == old.dtype:
            assert (out / "model.safetensors").stat().st_size == os.path.getsize(old.path / "model.safetensors")


def test_full_disk_is_a_clear_error_and_keeps_the_old_output(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    convert(source, out, parity_tokens=16)
    before = (out / "model.safetensors").read_bytes()
    import srm_max.checkpoint as checkpoint

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "write_safetensors", full_disk)
    with pytest.raises(ConvertError, match="out: cannot write \\(No space left on device\\); nothing was written"):
        convert(source, out, force=True, parity_tokens=16)
    assert (out / "model.safetensors").read_bytes() == before
    assert visible(tmp_path) == ["out"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
