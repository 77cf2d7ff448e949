"""``srm-max train --resume`` in a damaged or hostile run directory: a named pipe, folder or device
where the run keeps a file, a ``latest`` marker naming something else than one of its checkpoints,
a checkpoint that is not this run's, a file this user may not read. Each is one line on stderr,
exit 2, and the run's files as they were; a metrics.jsonl with junk in it resumes, keeping
every line before the checkpoint. ``srm-max convert`` of such a run ends too, in one line."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from srm_max.cli import main
from srm_max.train.run_dir import keep_metrics_through
from tests.train.test_train_cli import TINY, refused

STEPS = ["--steps", "6", "--save-every", "2"]
STEP4 = Path("checkpoints") / "step-000004"


def look(folder: Path) -> dict[str, object]:
    """Every path under ``folder``: the bytes of a regular file, else what it is. Never opens
    anything but a regular file (a named pipe would block the test)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        mode = path.lstat().st_mode
        found[str(path.relative_to(folder))] = (path.read_bytes() if stat.S_ISREG(mode) else f"-> {os.readlink(path)}"
                                                if stat.S_ISLNK(mode) else stat.S_IFMT(mode))
    return found


def resume(out: Path, corpus_args: list[str], *extra: str) -> list[str]:
    return ["--out", str(out), *corpus_args, *TINY, *STEPS, "--resume", *extra]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, corpus_args) -> Path:
    """A run of 6 steps stopped at step 4: checkpoints of steps 2 and 4, latest naming step 4."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main(["train", "--out", str(out), *corpus_args, *TINY, *STEPS, "--stop-at-step", "4"]) == 0
    return out


@pytest.fixture
def out(stopped, tmp_path) -> Path:
    """A copy of the stopped run to damage."""
    return Path(shutil.copytree(stopped, tmp_path / "run", symlinks=True))


def put(path: Path, kind: str) -> None:
    """Replace ``path`` by a folder, a link to /dev/null or a named pipe."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    {"folder": path.mkdir, "device": lambda: path.symlink_to(os.devnull), "pipe": lambda: os.mkfifo(path)}[kind]()


RUN_PATHS = ["checkpoints/latest", f"{STEP4}/model.pt", f"{STEP4}/trainer_state.pt", "metrics.jsonl", "config.json",
             "results.json"]
WHAT = {"folder": "is a directory, not a regular file", "device": "is a character device, not a regular file",
        "pipe": "is a named pipe (FIFO), not a regular file"}


@pytest.mark.parametrize("kind", ["folder", "device"])
@pytest.mark.parametrize("name", RUN_PATHS)
def test_a_folder_or_device_in_place_of_a_run_file_is_refused(out, corpus_args, capsys, name, kind):
    put(out / name, kind)
    before = look(out)
    refused(capsys, resume(out, corpus_args), f"{out / name}: {WHAT[kind]}")
    assert look(out) == before


@pytest.mark.parametrize("kind", ["file", "device"])
def test_a_checkpoints_folder_that_is_no_folder_is_refused(out, corpus_args, capsys, kind):
    shutil.rmtree(out / "checkpoints")
    if kind == "file":
        (out / "checkpoints").write_text("not a folder")
    else:
        (out / "checkpoints").symlink_to(os.devnull)
    before = look(out)
    refused(capsys, resume(out, corpus_args), f"{out / 'checkpoints'}: is not a directory")
    assert look(out) == before


# Run in a child process with a time limit: a named pipe that is opened blocks (torch and the
# tokenizers library may hold the GIL meanwhile) and must fail the test, not hang it.
PIPE_RUNS = """
import json, sys
from srm_max.cli import main
print(json.dumps([main(["train", *argv]) for argv in json.loads(sys.argv[1])]))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_in_place_of_a_run_file_is_refused_without_opening_it(stopped, tmp_path, corpus_args):
    runs, outs = [], []
    for i, name in enumerate(RUN_PATHS):
        out = Path(shutil.copytree(stopped, tmp_path / f"run{i}"))
        put(out / name, "pipe")
        outs.append((out, look(out)))
        runs.append(resume(out, corpus_args))
    done = subprocess.run([sys.executable, "-c", PIPE_RUNS, json.dumps(runs)], capture_output=True, text=True,
                          timeout=180)
    assert done.stdout == json.dumps([2] * len(runs)) + "\n", done.stderr
    assert done.stderr.splitlines() == [f"srm-max train: error: {out / name}: {WHAT['pipe']}"
                                        for (out, _), name in zip(outs, RUN_PATHS)]
    for out, before in outs:
        assert look(out) == before


MARKERS = [
    (b"../../etc/passwd\n", "names '../../etc/passwd', not a checkpoint of this run"),
    (b"../../other/checkpoints/step-000004", "names '../../other/checkpoints/step-000004', not a checkpoint"),
    (b"\x00\xff junk\nmore junk", "names '\\x00\\ufffd junk\\nmore junk', not a checkpoint of this run"),
    (b"", "names '', not a checkpoint of this run"),
    (b"step-000008\n", "points at {out}/checkpoints/step-000008, which is incomplete"),
    (b"x" * 100_000, "names '" + "x" * 60 + "'..., not a checkpoint"),
]


@pytest.mark.parametrize("marker, says", MARKERS, ids=["outside", "another run", "junk", "empty", "missing", "huge"])
def test_a_latest_marker_naming_no_checkpoint_of_the_run_is_refused(out, corpus_args, capsys, marker, says):
    (out / "checkpoints" / "latest").write_bytes(marker)
    before = look(out)
    err = refused(capsys, resume(out, corpus_args), says.format(out=out))
    assert len(err) < 500
    assert look(out) == before


def test_a_step_folder_linked_out_of_the_run_is_refused(out, stopped, corpus_args, capsys):
    shutil.rmtree(out / STEP4)
    (out / STEP4).symlink_to(stopped / STEP4)
    before = look(out)
    refused(capsys, resume(out, corpus_args), f"{out / STEP4}: a link out of {out / 'checkpoints'}")
    assert look(out) == before


@pytest.fixture(scope="module")
def wider(tmp_path_factory, corpus_args) -> Path:
    """The same run with --d-model 32: checkpoints of another model size, at the same steps."""
    other = tmp_path_factory.mktemp("wider") / "run"
    assert main(["train", "--out", str(other), *corpus_args, *TINY, *STEPS, "--stop-at-step", "4",
                 "--d-model", "32"]) == 0
    return other


def test_a_checkpoint_of_another_model_size_or_architecture_is_refused(out, wider, corpus_args, capsys):
    before = look(out)
    shutil.copy(wider / STEP4 / "model.pt", out / STEP4 / "model.pt")
    refused(capsys, resume(out, corpus_args), f"{out / STEP4}: its weights do not fit this model (size mismatch")
    from srm_max.models.pha.config import PHAConfig
    from srm_max.reference.pha import PHA

    torch.save(PHA(PHAConfig(vocab_size=300, d_model=16, n_layers=1, context_length=16, n_q_heads=2, n_kv_heads=2))
               .state_dict(), out / STEP4 / "model.pt")
    refused(capsys, resume(out, corpus_args), f"{out / STEP4}: its weights do not fit this model (Missing key")
    (out / STEP4 / "model.pt").write_bytes(before[f"{STEP4}/model.pt"])
    assert look(out) == before


def test_a_trainer_state_that_is_not_this_runs_is_refused(out, wider, corpus_args, capsys):
    state = out / STEP4 / "trainer_state.pt"
    original = state.read_bytes()
    cases = [(lambda: shutil.copy(wider / STEP4 / "trainer_state.pt", state), "optimizer 'exp_avg' of parameter 0 "
              "has shape [300, 32], the model's [300, 16]"),
             (lambda: shutil.copy(out / "checkpoints/step-000002/trainer_state.pt", state),
              "it holds step 2, its folder names step 4"),
             (lambda: torch.save({"step": 4}, state), "(KeyError: 'optimizer')"),
             (lambda: torch.save({**torch.load(state, weights_only=True), "torch_rng": torch.zeros(3)}, state),
              "(TypeError: RNG state must be a torch.ByteTensor)"),
             (lambda: state.write_bytes(b"\x80\x02junk" * 10), "cannot be read, damaged or not this trainer's")]
    for damage, says in cases:
        state.write_bytes(original)
        damage()
        before = look(out)
        err = refused(capsys, resume(out, corpus_args), says)
        assert err.startswith(f"srm-max train: error: {state}: ")
        assert look(out) == before


@pytest.mark.parametrize("field, value, says", [
    ("context_length", 32, "another model: context_length 32 (the arguments give 16); resume with the model"),
    ("architecture", "pha", "another model: architecture 'pha' (the arguments give 'srm')"),
    (None, "{ not json", "not valid JSON"),
    (None, "[1]", "not a config of this trainer (a JSON object)"),
    (None, " " * (1 << 20) + "{}", "over 1 MiB, too large for a config file; repair or remove it"),
])
def test_a_run_config_of_another_model_than_the_arguments_is_refused(out, corpus_args, capsys, field, value, says):
    """The checkpoint's weights fit the arguments; the run's config.json says another model (its
    context length leaves the weights as they are), which the resumed run would overwrite."""
    config = out / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {field: value}) if field else value)
    before = look(out)
    err = refused(capsys, resume(out, corpus_args), says)
    assert err.startswith(f"srm-max train: error: {config}: ")
    assert look(out) == before


def test_a_run_config_without_a_field_at_its_default_resumes(out, corpus_args):
    """A config written before a field existed (here: without layer_norm_eps, at its default) is
    the same model: the check reads it as a config, so the run resumes."""
    config = out / "config.json"
    saved = json.loads(config.read_text())
    assert saved.pop("layer_norm_eps") == 1e-5
    config.write_text(json.dumps(saved))
    assert main(["train", *resume(out, corpus_args)]) == 0


def test_resume_keeps_every_metrics_line_before_the_checkpoint(out, corpus_args):
    """Junk between good lines, a stray byte and a line cut short by a kill: resuming drops only
    what comes after the checkpoint's step, and keeps the rest byte for byte."""
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    lines[1:1] = [b"garbage {\n", b'{"step": 1, "note": "caf\xe9"}\n']
    kept = b"".join(lines)
    (out / "metrics.jsonl").write_bytes(kept + b'{"step": 5, "loss": 1.0}\n\xff\xfe junk\n{"step": 6, "lo')
    assert main(["train", *resume(out, corpus_args)]) == 0
    metrics = (out / "metrics.jsonl").read_bytes()
    assert metrics.startswith(kept)
    assert [json.loads(line)["step"] for line in metrics[len(kept):].splitlines()] == [5, 6, 6]  # 6 twice: val loss
    assert json.loads((out / "results.json").read_text())["finished"]


def test_keep_metrics_through_leaves_a_file_it_has_nothing_to_drop_from_untouched(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\x00junk\n{"step": 2}')
    keep_metrics_through(tmp_path, 2)
    assert path.read_bytes() == b'{"step": 1}\n\x00junk\n{"step": 2}\n'
    mtime = path.stat().st_mtime_ns
    keep_metrics_through(tmp_path, 2)
    assert path.stat().st_mtime_ns == mtime
    keep_metrics_through(tmp_path, 1)
    assert path.read_bytes() == b'{"step": 1}\n'


def reads_unreadable_files(folder: Path) -> bool:
    """Whether this process reads a file of mode 000 anyway (root, or a capability that overrides)."""
    probe = folder / "probe"
    probe.write_text("x")
    probe.chmod(0)
    try:
        probe.read_text()
        return True
    except PermissionError:
        return False
    finally:
        probe.chmod(0o644)


@pytest.mark.parametrize("name, says", [
    ("checkpoints/latest", "cannot be read (Permission denied)"),
    (f"{STEP4}/model.pt", "cannot be read (Permission denied)"),
    (f"{STEP4}/trainer_state.pt", "cannot be read (Permission denied)"),
    ("config.json", "cannot be read (Permission denied)"),
    ("metrics.jsonl", "cannot be read (Permission denied)"),
    ("checkpoints", "cannot be looked up (Permission denied)"),
])
def test_a_file_this_user_may_not_read_is_refused(out, tmp_path, corpus_args, capsys, name, says):
    if reads_unreadable_files(tmp_path):
        pytest.skip("this process reads any file (root)")
    before = look(out)
    (out / name).chmod(0)
    try:
        err = refused(capsys, resume(out, corpus_args), says)
    finally:
        (out / name).chmod(0o755 if (out / name).is_dir() else 0o644)
    assert str(out / name) in err
    assert look(out) == before


CONVERT_RUNS = """
import json, sys
from srm_max.cli import main
print(json.dumps([main(["convert", *argv, "--parity-tokens", "4"]) for argv in json.loads(sys.argv[1])]))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_convert_of_a_damaged_run_ends_in_one_line(stopped, wider, tmp_path, corpus_args):
    """The run directory itself, its model.pt as a named pipe, and a model.pt of another size than
    the run's config.json: each a one-line error (in a child process: a pipe opened would block)."""
    whole = Path(shutil.copytree(stopped, tmp_path / "whole"))
    pipe = Path(shutil.copytree(stopped, tmp_path / "pipe"))
    os.mkfifo(pipe / "model.pt")
    sized = Path(shutil.copytree(stopped, tmp_path / "sized"))
    shutil.copy(wider / STEP4 / "model.pt", sized / "model.pt")
    runs = [[str(whole), str(tmp_path / "dst0")], [str(pipe / "model.pt"), str(tmp_path / "dst1")],
            [str(sized / "model.pt"), str(tmp_path / "dst2")]]
    done = subprocess.run([sys.executable, "-c", CONVERT_RUNS, json.dumps(runs)], capture_output=True, text=True,
                          timeout=180)
    assert done.stdout == "[2, 2, 2]\n", done.stderr
    errors = done.stderr.splitlines()
    assert len(errors) == 3 and all(line.startswith("srm-max convert: error: ") for line in errors), errors
    assert f"{whole}: directory holds no model.safetensors" in errors[0]
    assert f"{pipe / 'model.pt'}: is a named pipe (FIFO)" in errors[1]
    assert "has shape [300, 32] but the config implies [300, 16]" in errors[2]
    assert not any((tmp_path / f"dst{i}").exists() for i in range(3))
