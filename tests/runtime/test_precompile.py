"""Compile workers: fresh interpreters that never run the caller's script again."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from tests.support.graphs import graphs
from tests.support.pha import CONFIG as PHA
from tests.support.stand_ins import MarkedItem
from tests.support.tiny import TINY

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
        compile_in_workers([(job,) for job in jobs], workers=2)
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
    draws through the row op) and the architecture (it reads logits, no weights): the jobs
    for it that differ only in those name one graph, so precompile hands the workers one
    job per graph."""
    from srm_max.models import registry
    from srm_max.runtime import precompile as pc

    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))
    assert PHA.vocab_size == TINY.vocab_size
    arch = registry.of(TINY)
    jobs = [arch.graph_job("sample", TINY, dtype, "cpu", kernels) for dtype in ("float32", "bfloat16")
            for kernels in (True, False)]
    jobs.append(arch.graph_job("regroup", TINY, "bfloat16", "cpu", False))
    pha_sample = registry.of(PHA).graph_job("sample", PHA, "float32", "cpu", True)
    assert pha_sample.graph_salt != jobs[0].graph_salt and pha_sample.mef_path() == jobs[0].mef_path()
    jobs.append(pha_sample)
    handed: list = []
    monkeypatch.setattr(pc, "compile_in_workers", lambda units, workers: handed.extend(j for u in units for j in u) or {})
    pc.precompile(jobs)
    assert sorted((j.kind, j.dtype, j.kernels) for j in handed) == [
        ("regroup", "bfloat16", False), ("sample", "float32", False), ("sample", "float32", True)]


def test_precompile_compiles_an_engines_graphs_as_one_unit_the_longest_first(tmp_path, monkeypatch):
    """The graphs binding one engine's weights are one unit (compiled together, a fixed
    cost once and their kernels shared); the graphs binding none (the sampler's, the
    regrouping), which other engines may load, are another. The workers get the units
    longest first (lines of MLIR, what a compile grows with), so that the compiles left
    when cores fall idle at the end are the short ones."""
    from srm_max.models import registry
    from srm_max.runtime import precompile as pc

    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))
    arch = registry.of(TINY)
    jobs = [arch.graph_job(kind, TINY, dtype, "cpu", kernels) for kind, dtype, kernels in
            (("regroup", "float32", True), ("sample", "float32", True), ("decode", "float32", False),
             ("prefill", "float32", False), ("decode_steps", "float32", True), ("prefill", "bfloat16", True))]
    handed: list = []
    monkeypatch.setattr(pc, "compile_in_workers", lambda units, workers: handed.extend(units) or {})
    pc.precompile(jobs)
    assert sorted((tuple((j.kind, j.dtype, j.kernels) for j in unit) for unit in handed), key=str) == sorted([
        (("decode", "float32", False), ("prefill", "float32", False)), (("decode_steps", "float32", True),),
        (("prefill", "bfloat16", True),), (("regroup", "float32", True), ("sample", "float32", True))], key=str)
    sizes = [sum(j.size() for j in unit) for unit in handed]
    assert sizes == sorted(sizes, reverse=True) and [j.kind for j in handed[0]] == ["decode", "prefill"]
    # MAX loads a unit's graphs by name: the plain-op sampler has a name of its own and joins
    # the unit; the sampler of another vocabulary, also named "sample", goes apart
    plain_sample = arch.graph_job("sample", TINY, "float32", "cpu", False)
    other_vocabulary = dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 8)
    other_sample = registry.of(other_vocabulary).graph_job("sample", other_vocabulary, "float32", "cpu", True)
    units = pc.compile_units([jobs[0], jobs[1], plain_sample, other_sample])
    assert [[(j.kind, j.kernels, j.config.vocab_size) for j in unit] for unit in units] == [
        [("regroup", True, 64), ("sample", True, 64), ("sample", False, 64)], [("sample", True, 72)]]


def test_a_models_graphs_with_and_without_the_mojo_ops_share_a_unit_unless_they_bind_op_weights(tmp_path,
                                                                                               monkeypatch):
    """Where one model's graphs with and without the Mojo ops compile together (a test
    suite's), the unit with the ops joins the plain one when every weight it binds is one
    the plain engine registers too: the PHA's prefill with the ops joins its plain prefill
    and decode. The SRM's op unit binds the packed copies only an engine running its decode
    op registers (named under ``OP_WEIGHTS``), so it stays apart."""
    from srm_max.models import registry
    from srm_max.runtime.precompile import OP_WEIGHTS, compile_units

    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))

    def jobs(config, kernels, *kinds):
        return [registry.of(config).graph_job(kind, config, "float32", "cpu", kernels) for kind in kinds]

    def kinds(units):
        return [[(job.kind, job.kernels) for job in unit] for unit in units]

    assert kinds(compile_units(jobs(PHA, True, "prefill") + jobs(PHA, False, "prefill", "decode"))) == [
        [("prefill", False), ("decode", False), ("prefill", True)]]
    srm_op = jobs(TINY, True, "prefill", "decode_steps")
    assert any(name.startswith(OP_WEIGHTS) for name in srm_op[1].weights())
    assert kinds(compile_units(srm_op + jobs(TINY, False, "prefill", "decode"))) == [
        [("prefill", True), ("decode_steps", True)], [("prefill", False), ("decode", False)]]


def test_a_job_for_another_cpu_target_is_cached_and_compiled_for_it(tmp_path, monkeypatch):
    """A job naming a CPU target has that target's cache key, and its compile worker runs
    with ``SRM_MAX_CPU_TARGET`` set to it (the worker refuses a job whose target its
    process does not compile for, since its .mef would land under another key)."""
    import dataclasses
    import os
    import pickle

    from srm_max.models import registry
    from srm_max.runtime import cpu_target
    from srm_max.runtime.compile_cache import graph_key
    from srm_max.runtime.precompile import compile_in_workers

    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))
    host = registry.of(TINY).graph_job("regroup", TINY)
    v3 = dataclasses.replace(host, cpu_target="x86-64-v3")
    graph = host.graph()
    assert v3.mef_path() == tmp_path / "mef" / f"{graph.name}-{graph_key(graph, host.graph_salt, 'x86-64-v3')}.mef"
    assert v3.mef_path() != host.mef_path() and v3.mef_path().parent == host.mef_path().parent
    # the worker gets the target (it fails on the unknown kind, after the target check)
    with pytest.raises(RuntimeError, match="unknown SRM graph kind 'no_such_kind'"):
        compile_in_workers([(dataclasses.replace(v3, kind="no_such_kind"),)], workers=1)
    host_env = {k: v for k, v in os.environ.items() if k != cpu_target.ENV}
    proc = subprocess.run([sys.executable, "-m", "srm_max.runtime.precompile"], input=pickle.dumps((v3,)),
                          capture_output=True, timeout=300, env=host_env)
    assert proc.returncode != 0 and b"the job is for x86-64-v3, this process compiles for host-" in proc.stderr



def test_one_worker_compiles_its_units_one_after_another(tmp_path, monkeypatch):
    """A worker lives for several units, taking the next unit of its CPU target when its
    compile ends; a unit for another target waits for a worker of its own (here it fails at
    once). A unit's graphs compile as one file under each graph's cache path, from which
    each loads alone."""
    import dataclasses

    import numpy as np
    from max.engine import InferenceSession
    from srm_max.runtime import precompile as pc
    from srm_max.runtime.compile_cache import load_compiled
    from tests.support.op_graphs import pythonpath_with_repo_root
    from tests.support.stand_ins import PassThroughConfig, pass_through_graph

    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", pythonpath_with_repo_root())  # the workers import the stand-in
    started: list[str] = []

    class CountedWorker(pc._Worker):
        def __init__(self, cpu_target):
            started.append(cpu_target)
            super().__init__(cpu_target)

    monkeypatch.setattr(pc, "_Worker", CountedWorker)
    a, b = (pc.GraphJob(kind, PassThroughConfig(), "float32", "cpu", False, pass_through_graph, b"")
            for kind in ("a", "b"))
    v3 = dataclasses.replace(a, kind="no_such_kind", cpu_target="x86-64-v3")
    with pytest.raises(RuntimeError, match="unknown pass-through graph kind 'no_such_kind'"):
        pc.compile_in_workers([(a,), (v3,), (a, b)], workers=1)
    assert started == ["", "x86-64-v3"]  # the host's worker compiled both of its units
    assert a.mef_path().samefile(b.mef_path())  # the second unit's file replaced the first's
    session = InferenceSession()
    for job in (a, b):
        model = load_compiled(session, job.graph, {}, job.salt, mef=job.mef_path())
        assert model.name == f"pass_through_{job.kind}"
        (out,) = model.execute(np.array([1.5, -2.0], np.float32))
        np.testing.assert_array_equal(out.to_numpy(), [1.5, -2.0])

# The op tests' graphs (tests/support/op_graphs.py) are compile jobs like the engines': the
# marker declares them, the session compiles them up front in the same workers, and a test
# that uses one it does not declare fails.


def test_op_graphs_are_declared_by_op_and_kept_by_the_avx2_guard():
    from srm_max.graphs.op_names import OP_DECODE_STEP, OP_LINEAR, OP_SAMPLE_ROWS, OP_SCAN, OP_WRITE_STATE_ROWS
    from tests.support.graphs import declared_graph_jobs, graphs, needs_only_float32_kernel_graphs, op_graphs, undeclared
    from tests.support.op_graphs import TOGETHER, OpUse, job

    item = MarkedItem(op_graphs(OP_SCAN), op_graphs(OP_SAMPLE_ROWS, vocab=64))
    assert declared_graph_jobs([item]) == [job(OP_SCAN), job(OP_SAMPLE_ROWS, 64)]
    assert undeclared(item, [OpUse(OP_SCAN), OpUse(OP_SAMPLE_ROWS, 64)]) == []
    # the linear op shares the scan's graph (op_graphs.TOGETHER): declared with it
    assert job(OP_LINEAR) == job(OP_SCAN) and job(OP_LINEAR).kind == TOGETHER
    assert undeclared(item, [OpUse(OP_LINEAR), OpUse(OP_SAMPLE_ROWS, 128), OpUse(OP_DECODE_STEP, dtype="bfloat16")]) \
        == [OpUse(OP_SAMPLE_ROWS, 128), OpUse(OP_DECODE_STEP, dtype="bfloat16")]
    assert needs_only_float32_kernel_graphs(item)
    mixed = MarkedItem(op_graphs(OP_SCAN), graphs(TINY, ("prefill",), kernels=False))
    assert not needs_only_float32_kernel_graphs(mixed)
    with pytest.raises(ValueError, match=f"no graph of the op '{OP_WRITE_STATE_ROWS}' alone"):
        op_graphs(OP_WRITE_STATE_ROWS)


def test_a_test_using_an_op_graph_it_does_not_declare_fails():
    """tests/conftest.py's check after each test: run alone, such a test would compile the
    graph inside itself, one at a time."""
    import tests.conftest as conftest
    from srm_max.graphs.op_names import OP_LINEAR, OP_SAMPLE_ROWS, OP_SCAN
    from tests.support import op_graphs
    from tests.support.graphs import op_graphs as declare

    item = MarkedItem(declare(OP_SCAN))
    # the uses a test made (patched only around each check: this test's own check follows)
    scan, linear, rows = op_graphs.OpUse(OP_SCAN), op_graphs.OpUse(OP_LINEAR), op_graphs.OpUse(OP_SAMPLE_ROWS, 64)
    for used, problem in (({scan, linear}, None),
                          ({scan, rows}, rf"add op_graphs\({OP_SAMPLE_ROWS}, vocab=64\)")):
        call = conftest.pytest_runtest_call(item)
        next(call)  # the test runs here
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(op_graphs, "used", lambda: used)
            with pytest.raises(pytest.fail.Exception if problem else StopIteration, match=problem):
                call.send(None)


def test_a_compile_worker_started_anywhere_builds_an_op_graph(tmp_path):
    """What a worker does before it compiles: unpickle the job, whose builder lives in
    tests.support, and build its graph; from outside the repository, with the PYTHONPATH
    tests/conftest.py gives the workers."""
    import os
    import pickle

    from srm_max.graphs.op_names import OP_LINEAR
    from tests.support.op_graphs import job, pythonpath_with_repo_root

    proc = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()).graph().name)"],
        input=pickle.dumps(job(OP_LINEAR)), capture_output=True, timeout=300, cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": pythonpath_with_repo_root()})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.decode().splitlines()[-1] == job(OP_LINEAR).graph().name


def test_the_compile_report_names_each_unit_dearest_first_with_the_file_declaring_it():
    """The session's summary of its up-front compiles (tests/conftest.py): one line a
    unit, the dearest first, each with its graphs and the first test file that declares it."""
    from srm_max.graphs.op_names import OP_SAMPLE_ROWS, OP_SCAN
    from srm_max.models import registry
    from tests.support.graphs import compile_report, op_graphs
    from tests.support.op_graphs import TOGETHER, job

    first = MarkedItem(op_graphs(OP_SCAN))
    second = MarkedItem(op_graphs(OP_SCAN), op_graphs(OP_SAMPLE_ROWS, vocab=64), nodeid="tests/y.py::test_y")
    third = MarkedItem(graphs(TINY, ("prefill", "decode_steps")), nodeid="tests/z.py::test_z")
    engine = tuple(registry.of(TINY).graph_job(kind, TINY, kernels=True) for kind in ("prefill", "decode_steps"))
    lines = compile_report({(job(OP_SCAN),): 12.4, (job(OP_SAMPLE_ROWS, 64),): 40.0, engine: 75.0},
                           [first, second, third])
    assert lines[0].startswith("4 graphs compiled up front in 3 units, 127 s of compiling")
    assert lines[1:] == ["     75 s  prefill + decode_steps (srm, float32, Mojo ops), declared by tests/z.py",
                         f"     40 s  {OP_SAMPLE_ROWS} (mojo_ops, float32, Mojo ops), declared by tests/y.py",
                         f"     12 s  {TOGETHER} (mojo_ops, float32, Mojo ops), declared by tests/x.py"]