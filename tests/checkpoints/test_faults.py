"""Faults: a killed or failing convert leaves the complete old or new output, never half a model
or none."""

import errno
import os
import signal
import subprocess
import sys

import pytest
import torch

from srm_max.checkpoints.convert import convert
from srm_max.checkpoints.format import load_checkpoint
from srm_max.cli import main as cli_main
from srm_max.errors import ConvertError
from srm_max.files import atomic_directory
from srm_max.models.srm.config import SRMConfig
from srm_max.reference.srm import SRM
from tests.support.srm_sources import snapshot, write_source

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


# Runs `convert --force` held at one stage (argv[1]): the child says when it gets there,
# then waits on stdin, so the test kills it exactly there, at every stage in turn (no
# timing guesswork): before the new files are written, once the weights are written and
# before the parity check, right before and right after the swap into place.
HELD_AT_STAGE = """
import sys
import srm_max.checkpoints.convert as convert
import srm_max.files as files

def hold(stage):
    if sys.argv[1] == stage:
        print("held", flush=True)
        sys.stdin.readline()

def held(module, name, before, after=None):
    real = getattr(module, name)
    def wrapped(*args, **kwargs):
        hold(before)
        result = real(*args, **kwargs)
        hold(after)
        return result
    setattr(module, name, wrapped)

held(convert, "write_checkpoint_files", "writing")
held(convert, "compute_parity", "certifying")
held(files, "_swap_into_place", "swapping", "swapped")
from srm_max.cli import main
main(["convert", sys.argv[2], sys.argv[3], "--force", "--parity-tokens", "16"])
"""
STAGES = ["writing", "certifying", "swapping", "swapped"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_kill_at_any_stage_leaves_the_complete_old_or_new_model(source, tmp_path, stage):
    """The destination holds the complete old or new model at every instant: killed at
    any stage of a convert that replaces it, never missing, never half written, never
    hidden away; the old one until the swap, the new one from it on."""
    from srm_max.files import exchange_paths

    probe = tmp_path / "probe"
    (probe / "a").mkdir(parents=True)
    (probe / "b").mkdir()
    if stage.startswith("swap") and not exchange_paths(probe / "a", probe / "b"):
        pytest.skip("this file system has no atomic directory exchange (documented fallback)")
    out = tmp_path / "models" / "out"
    convert(source, out, dtype="bfloat16", parity_tokens=16)  # the old output
    old_size = (out / "model.safetensors").stat().st_size
    process = subprocess.Popen([sys.executable, "-c", HELD_AT_STAGE, stage, str(source), str(out)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout.readline().strip() == "held"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert visible(out.parent) == ["out"]
    now = load_checkpoint(out)  # complete: old (bfloat16) or new (float32), never a mix
    assert now.dtype == ("float32" if stage == "swapped" else "bfloat16")
    assert (out / "parity.json").exists()
    if now.dtype == "bfloat16":
        assert (out / "model.safetensors").stat().st_size == old_size


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


def hidden(directory):
    """What a write left behind: the hidden temporary names beside its destination."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_force_never_turns_a_file_into_a_checkpoint(model, tmp_path, capsys):
    src = write_source("pt", model, tmp_path)
    convert(src, tmp_path / "out", parity_tokens=16)
    before = snapshot(tmp_path / "out")
    inside = tmp_path / "out" / "model.safetensors"
    assert cli_main(["convert", str(src), str(inside), "--force"]) == 2
    assert capsys.readouterr().err == (f"srm-max convert: error: {inside}: exists and is not a directory; a checkpoint "
                                       "is a directory, so it is not replaced (even with --force): remove it or "
                                       "choose another path\n")
    assert snapshot(tmp_path / "out") == before and hidden(tmp_path / "out") == []

    (tmp_path / "f").write_text("hi")
    with pytest.raises(ConvertError, match="f: exists and is not a directory"):
        convert(src, tmp_path / "f", force=True)
    assert (tmp_path / "f").read_text() == "hi"
    assert hidden(tmp_path) == [] and visible(tmp_path) == ["f", "model.pt", "out"]


def test_the_replaced_entry_is_removed_whatever_it_was(tmp_path):
    """What the swap takes out of the destination's place is removed, a file (one that
    appeared there after the check) or a symbolic link (never what it points at)."""
    out = tmp_path / "out"
    out.mkdir()
    with atomic_directory(out, force=True) as tmp:
        (tmp / "new").write_text("new")
        out.rmdir()
        out.write_text("raced in")
    assert [p.name for p in out.iterdir()] == ["new"]
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "keep").write_text("keep")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with atomic_directory(tmp_path / "link", force=True) as tmp:
        (tmp / "new").write_text("new")
    assert not (tmp_path / "link").is_symlink() and [p.name for p in (tmp_path / "link").iterdir()] == ["new"]
    assert (tmp_path / "real" / "keep").read_text() == "keep"
    assert hidden(tmp_path) == [] and visible(tmp_path) == ["link", "out", "real"]
