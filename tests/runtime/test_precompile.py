"""Compile workers: fresh interpreters that never run the caller's script again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A user's first script: no ``if __name__ == "__main__":`` guard. It counts its own
# top-level runs in a file and asks two compile workers for graphs of a kind that does
# not exist, so the workers fail fast (no real compile) and say why.
SCRIPT = textwrap.dedent("""
    import sys
    from srm_max.models.srm.config import SRMConfig
    from srm_max.models import registry
    from srm_max.runtime.precompile import compile_in_workers

    with open(sys.argv[1] if len(sys.argv) > 1 else {runs!r}, "a") as f:
        f.write("ran\\n")
    config = SRMConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, context_length=96)
    arch = registry.of(config)
    jobs = [arch.graph_job("no_such_kind", config), arch.graph_job("no_such_kind", config, "bfloat16")]
    try:
        compile_in_workers(jobs, workers=2)
    except RuntimeError as e:
        print("worker error:", e)
""")


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_an_unguarded_script_runs_once_and_gets_the_workers_error(tmp_path, how):
    runs = tmp_path / "runs.txt"
    script = SCRIPT.format(runs=str(runs))
    if how == "file":
        path = tmp_path / "first_script.py"
        path.write_text(script)
        proc = subprocess.run([sys.executable, str(path), str(runs)], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
    else:
        proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert runs.read_text().splitlines() == ["ran"], "the script's top level ran in a worker"
    assert "worker error: compiling the no_such_kind graph failed" in out, out
    assert "unknown SRM graph kind 'no_such_kind'" in out, out
    assert "BrokenProcessPool" not in out


def test_jobs_of_the_same_graph_compile_once(monkeypatch, tmp_path):
    """The sampler ignores the weight dtype (not the Mojo ops: with them it scores its
    draws through the row op): the jobs for it that differ only in the weight dtype name
    one graph, so precompile hands the workers one job per graph."""
    from tests.support.tiny import TINY
    from srm_max.models import registry
    from srm_max.runtime import precompile as pc

    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))
    arch = registry.of(TINY)
    jobs = [arch.graph_job("sample", TINY, dtype, "cpu", kernels) for dtype in ("float32", "bfloat16")
            for kernels in (True, False)]
    jobs.append(arch.graph_job("regroup", TINY, "bfloat16", "cpu", False))
    handed: list = []
    monkeypatch.setattr(pc, "compile_in_workers", lambda missing, workers: handed.extend(missing) or {})
    pc.precompile(jobs)
    assert [(j.kind, j.dtype, j.kernels) for j in handed] == [
        ("sample", "float32", True), ("sample", "float32", False), ("regroup", "bfloat16", False)]
