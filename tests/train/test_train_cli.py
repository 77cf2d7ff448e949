"""``srm-max train`` refuses bad input before any work: one line on stderr naming the argument
or file and the problem, exit 2, nothing written. An --out that holds files is refused unless
--resume continues the run there or --force starts it over, and neither mixes one run's
metrics into another's."""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from srm_max.cli import main
from srm_max.reference.transformer import Transformer, TransformerConfig
from srm_max.train import TrainConfig, TrainError, train
from srm_max.train import cli as train_cli
from srm_max.train.run_dir import keep_metrics_through
from tests.support.tokenizers import word_tokenizer

TINY = ["--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--context-length", "16", "--batch-size", "2",
        "--warmup-steps", "1", "--precision", "fp32", "--log-every", "1", "--quiet"]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder): what a refusal must leave."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def refused(capsys, argv: list[str], says: str) -> str:
    """``srm-max train argv`` exits 2 with one line on stderr that ``says`` why, and prints nothing
    else; -> that line."""
    assert main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("srm-max train: error: ") and says in err and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_steps(out: Path) -> list[int]:
    """The steps of the training-loss events of ``out``'s metrics, in file order."""
    return [event["step"] for event in metrics(out) if "loss" in event]


@pytest.fixture
def untrained(monkeypatch):
    """Training fails the test: a refusal must come before it."""
    def trained(*args, **kwargs):
        raise AssertionError("training started despite a bad input")

    monkeypatch.setattr(train_cli, "train", trained)


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    """Unusable inputs, by the names the cases below use."""
    paths = {"missing": tmp_path / "missing", "folder": tmp_path / "folder", "not_json": tmp_path / "not_json.json",
             "no_eot": tmp_path / "no_eot.json", "latin1": tmp_path / "latin1.txt", "empty": tmp_path / "empty.txt",
             "a_file": tmp_path / "a_file", "device": Path(os.devnull)}
    paths["folder"].mkdir()
    paths["not_json"].write_text("{ not json")
    word_tokenizer(8).save(str(paths["no_eot"]))
    paths["latin1"].write_bytes("café".encode("latin-1"))
    paths["empty"].write_text("")
    paths["a_file"].write_text("not a folder")
    return paths


# (arguments after the good ones, what the error says); {name} is the path of inputs[name]
BAD_INPUTS = [
    (["--tokenizer", "{missing}"], "--tokenizer {missing}: no such file or directory"),
    (["--tokenizer", "{folder}"], "--tokenizer {folder}: is a directory, not a regular file"),
    (["--tokenizer", "{device}"], "--tokenizer {device}: is a character device, not a regular file"),
    (["--tokenizer", "{not_json}"], "--tokenizer {not_json}: not a valid tokenizer.json"),
    (["--tokenizer", "{no_eot}"], "--tokenizer {no_eot}: has no <|endoftext|> token"),
    (["--train-text", "{missing}"], "--train-text {missing}: no such file or directory"),
    (["--train-text", "{folder}"], "--train-text {folder}: is a directory, not a regular file"),
    (["--val-text", "{device}"], "--val-text {device}: is a character device, not a regular file"),
    (["--train-text", "{latin1}"], "--train-text {latin1}: not valid UTF-8 text: byte 3 is 0xe9"),
    (["--train-text", "{empty}"], "--train-text {empty}: 1 token, too few for --context-length 16"),
    (["--val-text", "{empty}"], "--val-text {empty}: 1 token, too few for --context-length 16"),
    (["--d-model", "15"], "--arch srm: d_model 15 is not divisible by n_heads 2"),
    (["--n-heads", "3", "--d-model", "15"], "--arch srm: n_heads must be even"),
    (["--arch", "transformer", "--d-model", "18", "--n-heads", "4"],
     "--arch transformer: d_model 18 is not divisible by n_heads 4"),
    (["--arch", "pha", "--pha-ffn-dims", "8,x"], "--pha-ffn-dims must be comma-separated integers, got '8,x'"),
    (["--context-length", "0"], "--context-length must be an integer >= 1, got 0"),
    (["--n-layers", "0"], "--n-layers must be an integer >= 1, got 0"),
    (["--dss-state-size", "-1"], "--dss-state-size must be an integer >= 0, got -1"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--steps", "-1"], "--steps must be an integer >= 1, got -1"),
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--warmup-steps", "-5"], "--warmup-steps must be an integer >= 0, got -5"),
    (["--log-every", "0"], "--log-every must be an integer >= 1, got 0"),
    (["--save-every", "-1"], "--save-every must be an integer >= 0, got -1"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--seed", str(2**32)], "--seed must be an integer from 0 to 4294967295"),
    (["--lr", "-1"], "--lr must be a number > 0 and <= 1000, got -1.0"),
    (["--lr", "nan"], "--lr must be a number > 0 and <= 1000, got nan"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio must be a number from 0 to 1, got 2.0"),
    (["--grad-clip", "inf"], "--grad-clip must be a number >= 0 (0: no clipping), got inf"),
    (["--threads", "-1"], "--threads must be an integer >= 0, got -1"),
    (["--device", "bogus"], "--device bogus: not a device the trainer runs on"),
    (["--device", "meta"], "--device meta: not a device the trainer runs on"),
    (["--device", "cuda:99"], "--device cuda:99: not available"),
    (["--out", "{a_file}"], "--out {a_file}: exists and is not a directory"),
    (["--out", "{a_file}/run"], "--out {a_file}/run: {a_file} is not a directory"),
    (["--resume", "--force"], "--resume and --force exclude each other"),
    (["--lr", "1e308"], "--lr must be a number > 0 and <= 1000, got 1e+308"),
    (["--weight-decay", "1e308"], "--weight-decay must be a number from 0 to 1000, got 1e+308"),
    (["--batch-size", str(10**20)], f"--batch-size must be an integer from 1 to 1048576, got {10**20}"),
    (["--batch-size", str(10**12)], f"--batch-size must be an integer from 1 to 1048576, got {10**12}"),
    (["--steps", str(10**20)], f"--steps must be an integer from 1 to 2147483647, got {10**20}"),
    (["--threads", str(10**21)], f"--threads must be an integer from 0 to 4096, got {10**21}"),
    (["--out", ""], "--out: an empty path names no file or directory"),
    (["--tokenizer", ""], "--tokenizer: an empty path names no file or directory"),
    (["--train-text", ""], "--train-text: an empty path names no file or directory"),
    (["--val-text", ""], "--val-text: an empty path names no file or directory"),
]


@pytest.mark.parametrize("extra, says", BAD_INPUTS, ids=[" ".join(extra) for extra, _ in BAD_INPUTS])
def test_a_bad_input_is_refused_before_any_work(tmp_path, corpus_args, inputs, untrained, capsys, extra, says):
    names = {name: str(path) for name, path in inputs.items()}
    before = snapshot(tmp_path)
    refused(capsys, ["--out", str(tmp_path / "run"), *corpus_args, *TINY, "--steps", "2",
                     *[arg.format(**names) for arg in extra]], says.format(**names))
    assert snapshot(tmp_path) == before  # --out not made, no file touched


# Run in a child process with a time limit: a read that opened a named pipe would block (the
# tokenizers library's holding the GIL, so no thread could step in) and must fail, not hang, the test.
PIPE_RUNS = """
import json, sys
from srm_max.cli import main
print(json.dumps([main(["train", *argv]) for argv in json.loads(sys.argv[1])]))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_for_a_file_is_refused_without_reading_it(tmp_path, corpus_args):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    flags = ("--tokenizer", "--train-text", "--val-text")
    given = dict(zip(corpus_args[::2], corpus_args[1::2]))
    runs = [["--out", str(tmp_path / "run"), *[a for item in (given | {flag: str(pipe)}).items() for a in item],
             *TINY, "--steps", "2"] for flag in flags]
    done = subprocess.run([sys.executable, "-c", PIPE_RUNS, json.dumps(runs)], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout == "[2, 2, 2]\n", done.stderr
    assert done.stderr.splitlines() == [f"srm-max train: error: {flag} {pipe}: is a named pipe (FIFO), not a regular "
                                        "file" for flag in flags]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_val_text_without_train_text_is_refused(tmp_path, corpus_args, untrained, capsys):
    tokenizer, val = corpus_args[:2], corpus_args[-2:]
    refused(capsys, ["--out", str(tmp_path / "run"), *tokenizer, *val, *TINY], "--val-text needs --train-text")
    assert not (tmp_path / "run").exists()


def run(out: Path, corpus_args: list[str], *extra: str) -> list[str]:
    return ["--out", str(out), *corpus_args, *TINY, *extra]


def test_an_out_holding_files_is_refused_and_left_whole(tmp_path, corpus_args, capsys):
    out = tmp_path / "run"
    assert main(["train", *run(out, corpus_args, "--steps", "2")]) == 0
    before = snapshot(out)
    refused(capsys, run(out, corpus_args, "--steps", "3"),
            f"{out}: already exists (use --force to overwrite, or --resume to continue the run in it)")
    assert snapshot(out) == before

    others = tmp_path / "others"
    others.mkdir()
    (others / "notes.txt").write_text("not a run, but not the trainer's to write into either")
    refused(capsys, run(others, corpus_args, "--steps", "2"), f"{others}: already exists")
    assert snapshot(others) == {"notes.txt": b"not a run, but not the trainer's to write into either"}

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", *run(empty, corpus_args, "--steps", "2")]) == 0


def test_force_starts_over_and_keeps_files_that_are_not_the_runs(tmp_path, corpus_args):
    out = tmp_path / "run"
    assert main(["train", *run(out, corpus_args, "--steps", "3", "--save-every", "1")]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002", "step-000003"]
    (out / "notes.txt").write_text("mine")

    assert main(["train", *run(out, corpus_args, "--steps", "2", "--force")]) == 0
    assert train_steps(out) == [1, 2]  # the old run's steps 1-3 are gone, not mixed in
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002"]
    results = json.loads((out / "results.json").read_text())
    assert results["finished"] and results["steps"] == 2
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_continues_a_killed_run_without_repeating_its_metrics(tmp_path, corpus_args):
    out = tmp_path / "run"
    # --resume where there is no run yet starts one
    assert main(["train", *run(out, corpus_args, "--steps", "4", "--stop-at-step", "2", "--resume")]) == 0
    assert train_steps(out) == [1, 2] and not (out / "model.pt").exists()
    with open(out / "metrics.jsonl", "a") as f:  # what a run killed after step 3, before its checkpoint, leaves
        f.write(json.dumps({"step": 3, "loss": 99.0}) + "\n" + '{"step": 4, "lo')

    assert main(["train", *run(out, corpus_args, "--steps", "4", "--resume")]) == 0
    assert train_steps(out) == [1, 2, 3, 4]
    assert 99.0 not in [event.get("loss") for event in metrics(out)]
    results = json.loads((out / "results.json").read_text())
    assert results["finished"] and results["step"] == 4 and (out / "model.pt").is_file()


def test_resume_with_other_model_sizes_is_refused(tmp_path, corpus_args, capsys):
    out = tmp_path / "run"
    assert main(["train", *run(out, corpus_args, "--steps", "2")]) == 0
    before = snapshot(out)
    refused(capsys, run(out, corpus_args, "--steps", "4", "--resume", "--d-model", "32"),
            f"{out / 'config.json'}: the run was started with another model: d_model 16 (the arguments give 32)")
    assert snapshot(out) == before


def test_resume_from_an_incomplete_checkpoint_is_refused(tmp_path, corpus_args, untrained, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-000007\n")
    refused(capsys, run(out, corpus_args, "--steps", "9", "--resume"),
            f"{out / 'checkpoints' / 'latest'} points at {out / 'checkpoints' / 'step-000007'}, which is incomplete")


def test_resume_starts_over_a_run_killed_before_its_first_checkpoint(tmp_path, corpus_args):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")  # all a run killed before its first checkpoint leaves
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 99.0}) + "\n")
    assert main(["train", *run(out, corpus_args, "--steps", "2", "--resume")]) == 0
    assert train_steps(out) == [1, 2] and 99.0 not in [event.get("loss") for event in metrics(out)]
    assert json.loads((out / "results.json").read_text())["finished"]


def test_resume_into_a_run_without_checkpoints_is_refused_and_leaves_it(tmp_path, corpus_args, untrained, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.pt").write_bytes(b"a finished run's model")
    (out / "results.json").write_text("{}")
    before = snapshot(out)
    refused(capsys, run(out, corpus_args, "--steps", "4", "--resume"),
            f"{out}: holds a run's files (model.pt, results.json) but no checkpoint to resume from")
    assert snapshot(out) == before


@pytest.mark.parametrize("damaged", ["model.pt", "trainer_state.pt"])
def test_resume_from_a_damaged_checkpoint_names_the_file_and_the_others(tmp_path, corpus_args, capsys, damaged):
    out = tmp_path / "run"
    assert main(["train", *run(out, corpus_args, "--steps", "4", "--save-every", "2", "--stop-at-step", "4")]) == 0
    path = out / "checkpoints" / "step-000004" / damaged
    path.write_bytes(path.read_bytes()[:100])  # a file cut short
    before = snapshot(out)
    err = refused(capsys, run(out, corpus_args, "--steps", "6", "--save-every", "2", "--resume"),
                  f"{path}: cannot be read, damaged or not this trainer's")
    assert "other checkpoints: step-000002" in err
    assert snapshot(out) == before


def test_keep_metrics_through_drops_later_and_cut_lines(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)] + ["[1]", '{"step": 4, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    keep_metrics_through(tmp_path, 2)
    assert train_steps(tmp_path) == [1, 2]
    keep_metrics_through(tmp_path, 0)  # a resumed run with no checkpoint starts over
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_python_api_refuses_a_used_out_and_bad_settings(tmp_path):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, context_length=8,
                                          ffn_dim=32))
    data = torch.randint(1, 32, (400,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(context_length=8, batch_size=2, steps=2, warmup_steps=1, precision="fp32", eval_every=0,
                      save_every=0)
    out = tmp_path / "run"
    train(model, data, None, cfg, out, progress=False)
    before = snapshot(out)
    with pytest.raises(TrainError, match="already exists"):
        train(model, data, None, cfg, out, progress=False)
    assert snapshot(out) == before
    with pytest.raises(TrainError, match="--batch-size must be an integer >= 1, got 0"):
        train(model, data, None, dataclasses.replace(cfg, batch_size=0), tmp_path / "other", progress=False)
    assert not (tmp_path / "other").exists()
    with pytest.raises(TrainError, match="--steps must be an integer >= 1, got True"):
        dataclasses.replace(cfg, steps=True).check()  # a flag where a count belongs


def test_python_m_srm_max_train_reports_errors_as_srm_max_train(tmp_path, corpus_args, untrained, monkeypatch,
                                                                  capsys):
    monkeypatch.setattr(sys, "argv", ["srm_max.train", *run(tmp_path / "run", corpus_args, "--steps", "0")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("srm_max.train", run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "srm-max train: error: --steps must be an integer >= 1, got 0\n"


def test_a_diverged_run_is_an_error_that_says_what_it_left(tmp_path, corpus_args, capsys):
    out = tmp_path / "run"
    err = refused(capsys, run(out, corpus_args, "--lr", "1000", "--steps", "12", "--save-every", "2"), "loss is nan")
    assert "lower --lr" in err and f"{out} holds " in err and "config.json" in err, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no folder can be made")
def test_an_out_that_cannot_be_made_is_an_error(tmp_path, corpus_args, capsys):
    out = Path("/proc/srm_max_train_run")
    refused(capsys, run(out, corpus_args, "--steps", "1"), f"--out {out}: ")
