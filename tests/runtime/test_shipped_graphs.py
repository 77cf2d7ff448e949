"""The compiled graphs shipped for the embedded model (srm_max.shipped_graphs).

The first test fails whenever graphs/, mojo/ or MAX change without a rebuild of
the shipped files (scripts/build_shipped_graphs.py), so stale files never ship.
The others load them into an empty cache, where nothing may compile.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest

from srm_max import shipped_graphs
from srm_max.embedded import EMBEDDED_MODEL_DIR
from srm_max.runtime import cpu_target, precompile

REBUILD = "rebuild them: .venv/bin/python scripts/build_shipped_graphs.py"


def _why_not_runnable() -> str | None:
    """Why this process cannot load the shipped x86-64-v3 graphs (None: it can)."""
    if cpu_target.requested() and cpu_target.requested() != "x86-64-v3":
        return f"this run compiles for {cpu_target.requested()}"
    if cpu_target.host_x86_level() not in ("x86-64-v3", "x86-64-v4"):
        return "this CPU cannot run x86-64-v3 code"
    return None


needs_runnable_target = pytest.mark.skipif(_why_not_runnable() is not None, reason=str(_why_not_runnable()))


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty SRM_MAX_CACHE where compiling fails the test."""
    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))

    def no_compiling(jobs, workers):
        raise AssertionError(f"compiled {[j.kind for j in jobs]} instead of using the shipped graphs")

    monkeypatch.setattr(precompile, "compile_in_workers", no_compiling)
    return tmp_path


def test_shipped_files_match_the_current_graphs():
    """Every shipped file is keyed on the graphs, kernels and MAX of this checkout."""
    directory = shipped_graphs.version_dir()
    assert directory.is_dir(), f"no graphs shipped for this MAX ({directory.name}): {REBUILD}"
    targets = shipped_graphs.shipped_targets()
    assert set(shipped_graphs.DEFAULT_TARGETS) <= set(targets), f"shipped: {targets}; {REBUILD}"
    for target in targets:
        expected = {shipped_graphs.shipped_file(job, target).name for job in shipped_graphs.embedded_jobs()}
        shipped = {p.name for p in (directory / target).iterdir()}
        assert shipped == expected, (f"{target}: shipped {sorted(shipped)}, the current graphs are "
                                     f"{sorted(expected)}; {REBUILD}")
    others = [p.name for p in shipped_graphs.SHIPPED_DIR.glob("max-*") if p != directory]
    assert not others, f"graphs shipped for other MAX versions: {others}; {REBUILD}"


def test_known_answer_is_for_the_embedded_weights():
    answer = np.load(shipped_graphs.KNOWN_ANSWER)
    weights = (EMBEDDED_MODEL_DIR / "model.safetensors").read_bytes()
    assert str(answer["weights_sha256"]) == hashlib.sha256(weights).hexdigest(), REBUILD


@needs_runnable_target
def test_generate_uses_the_shipped_graphs_without_compiling(empty_cache, caplog):
    from srm_max import Generator

    caplog.set_level(logging.INFO, logger="srm_max")
    gen = Generator.from_pretrained(device="cpu")  # warmup: every graph it may run
    assert f"using the shipped {', '.join(shipped_graphs.KINDS)} graphs" in caplog.text
    for job in shipped_graphs.embedded_jobs():
        assert job.mef_path().is_file() and job.mef_path().parent.parent == empty_cache

    answer = np.load(shipped_graphs.KNOWN_ANSWER)
    prompt = answer["prompt_ids"].tolist()
    logits = gen.engine.host(gen.engine.prefill([prompt]).logits)[0]
    scale = max(1.0, float(np.abs(answer["logits"]).max()))
    assert np.abs(logits - answer["logits"]).max() <= shipped_graphs.RTOL * scale
    out = gen.generate([prompt], max_new_tokens=len(answer["tokens"]))[0]
    assert out.ids == answer["tokens"].tolist()


@needs_runnable_target
def test_compile_command_installs_the_shipped_graphs(empty_cache, capsys):
    from srm_max.cli import main

    assert main(["compile", "--device", "cpu"]) == 0
    assert f"ready: {', '.join(shipped_graphs.KINDS)} graphs (float32, cpu)" in capsys.readouterr().out
    assert all(job.cached() for job in shipped_graphs.embedded_jobs())


@needs_runnable_target
def test_a_failed_known_answer_check_leaves_the_graphs_to_compile(empty_cache, tmp_path, monkeypatch, caplog):
    answer = dict(np.load(shipped_graphs.KNOWN_ANSWER))
    answer["logits"] = answer["logits"] + 0.01 * np.abs(answer["logits"]).max()
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, **answer)
    monkeypatch.setattr(shipped_graphs, "KNOWN_ANSWER", wrong)

    caplog.set_level(logging.INFO, logger="srm_max")
    jobs = shipped_graphs.embedded_jobs()
    assert shipped_graphs.install(jobs) == []
    assert "fail their known-answer check (prefill logits: relative error" in caplog.text
    assert not any(job.cached() for job in jobs)


def test_only_targets_this_cpu_runs_are_used(monkeypatch):
    monkeypatch.setattr(shipped_graphs, "shipped_targets", lambda: ["x86-64-v3", "x86-64-v4"])
    monkeypatch.setattr("max.driver.get_virtual_cpu_target", lambda: "")
    for host, usable in [("x86-64-v2", []), ("x86-64-v3", ["x86-64-v3"]),
                         ("x86-64-v4", ["x86-64-v4", "x86-64-v3"]), (None, [])]:
        monkeypatch.setattr(cpu_target, "host_x86_level", lambda host=host: host)
        assert shipped_graphs.usable_targets() == usable, host
    # compiling for a named target: exactly that target's code, or none
    monkeypatch.setattr(cpu_target, "host_x86_level", lambda: "x86-64-v4")
    monkeypatch.setattr("max.driver.get_virtual_cpu_target", lambda: "x86-64-v3")
    assert shipped_graphs.usable_targets() == ["x86-64-v3"]
    monkeypatch.setattr(shipped_graphs, "shipped_targets", lambda: ["x86-64-v4"])
    assert shipped_graphs.usable_targets() == []


def test_other_shapes_never_look_for_shipped_graphs(empty_cache, monkeypatch):
    from tests.support.tiny import TINY

    monkeypatch.setattr(shipped_graphs, "shipped_file", lambda *a: pytest.fail("looked for a shipped file"))
    from srm_max.models import registry

    assert shipped_graphs.install([registry.of(TINY).graph_job("prefill", TINY, kernels=True)]) == []
