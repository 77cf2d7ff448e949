"""The Mojo ops once more compiled for AVX2 (``x86-64-v3``).

Compiled CPU code differs between instruction sets: a fault that only AVX2 code
has (16 vector registers, 32-byte vectors) cannot show on an AVX-512 machine
running its own code. So where the host is not itself an ``x86-64-v3`` CPU, the
tests of the project's Mojo ops run again in child processes with
``SRM_MAX_CPU_TARGET=x86-64-v3`` (``srm_max.runtime.cpu_target``), each op checked against
its float64 or reference form. A child that crashes in every run is reported as a
failure naming the test each crash was in, instead of killing this run.
``SRM_MAX_TARGET_GUARD=1`` runs it on any x86-64 host (to check the guard itself).
What the guard reruns is in tests/support/cpu_guard.py, whose graphs the session compiles
up front for the guard's target (tests/conftest.py), so the children find them cached.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from srm_max.runtime import cpu_target
from tests.support.cpu_guard import (GUARD_OPTIONS, GUARD_TARGET, GUARD_TEST, GUARD_TESTS, guard_graph_jobs,
                                     guard_reason)
from tests.support.paths import REPO_ROOT as ROOT

# A child that dies by a signal runs again, up to this many times in all: that runtime
# fault strikes a child now and then, while a fault of the graphs' own AVX2 code strikes
# every run (the crash this guard was made for did), so it still fails the guard.
CRASH_ATTEMPTS = 3


def last_started_test(verbose_output: str) -> str | None:
    """The test pytest -v had started when its output ends (a crash cuts the line)."""
    started = re.findall(r"^(tests/\S+::\S+)", verbose_output, flags=re.MULTILINE)
    return started[-1] if started else None


def test_last_started_test_names_the_test_a_crash_cut_short():
    out = ("tests/models/srm/test_engine.py::test_a PASSED      [ 50%]\n"
           "tests/models/srm/test_engine.py::test_b[float32] ")
    assert last_started_test(out) == "tests/models/srm/test_engine.py::test_b[float32]"
    assert last_started_test("collected 0 items\n") is None


def run_for_target(test_paths, target: str, cwd: Path = ROOT, attempts: int = 1, options=()) -> str | None:
    """Run pytest on ``test_paths`` (with pytest ``options``) in a child process compiling
    for ``target``, again after a crash up to ``attempts`` runs in all; -> None when a run
    passes, else what went wrong (a failure at once; crashes name the test each one hit)."""
    env = os.environ | {cpu_target.ENV: target}
    crashes = []
    for _ in range(attempts):
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *options, *map(str, test_paths)],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
        out = proc.stdout + proc.stderr
        if proc.returncode == 0:
            return None
        if proc.returncode > 0:
            return f"the tests compiled for {target} failed:\n{out[-6000:]}"
        crashes.append(f"signal {-proc.returncode} in {last_started_test(proc.stdout)}")
    return (f"the tests compiled for {target} crashed in each of {attempts} runs "
            f"({'; '.join(crashes)}):\n{out[-3000:]}")


def test_a_crash_in_the_child_fails_naming_the_test(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_crash.py").write_text(
        "import os, signal\n\n"
        "def test_fine():\n    pass\n\n"
        "def test_segfaults():\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    problem = run_for_target(["tests/test_crash.py"], GUARD_TARGET, cwd=tmp_path, attempts=2)
    assert problem is not None and "crashed in each of 2 runs" in problem
    assert problem.count("signal 11 in tests/test_crash.py::test_segfaults") == 2


def test_a_crash_that_does_not_recur_passes_and_a_failure_is_not_retried(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    marker = tmp_path / "crashed_once"
    (tests / "test_flaky.py").write_text(
        "import os, signal\nfrom pathlib import Path\n\n"
        f"MARK = Path({str(marker)!r})\n\n"
        "def test_crashes_the_first_time():\n"
        "    if not MARK.exists():\n        MARK.touch()\n        os.kill(os.getpid(), signal.SIGSEGV)\n")
    assert run_for_target(["tests/test_flaky.py"], GUARD_TARGET, cwd=tmp_path, attempts=2) is None
    (tests / "test_fails.py").write_text(
        "from pathlib import Path\n\n"
        f"RUNS = Path({str(tmp_path / 'runs')!r})\n\n"
        "def test_fails():\n    RUNS.write_text(RUNS.read_text() + 'x' if RUNS.exists() else 'x')\n"
        "    assert False, 'wrong numbers'\n")
    problem = run_for_target(["tests/test_fails.py"], GUARD_TARGET, cwd=tmp_path, attempts=3)
    assert problem is not None and "failed" in problem and "wrong numbers" in problem
    assert (tmp_path / "runs").read_text() == "x"


@pytest.mark.slow
@pytest.mark.skipif(guard_reason() is not None, reason=str(guard_reason()))
def test_the_mojo_ops_pass_compiled_for_avx2():
    problems = [run_for_target(tests, GUARD_TARGET, attempts=CRASH_ATTEMPTS, options=GUARD_OPTIONS)
                for tests in GUARD_TESTS]
    problems = [p for p in problems if p]
    if problems:
        pytest.fail("\n\n".join(problems))


def test_the_guard_names_tests_that_exist():
    """A renamed test would leave the guard selecting nothing from it (pytest exits
    with 4 on an unknown node id, so this also keeps the error readable)."""
    for tests in GUARD_TESTS + ((GUARD_TEST,),):
        for test in tests:
            path, _, name = test.partition("::")
            assert (ROOT / path).exists(), test
            assert not name or f"def {name}(" in (ROOT / path).read_text(), test


def test_the_guard_selects_the_tests_of_the_float32_kernel_graphs_only():
    """The guard's children keep the tests whose graphs are all float32 graphs with the
    Mojo ops, so they compile no bfloat16 or plain-op graph for x86-64-v3."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *GUARD_OPTIONS,
         "tests/models/srm/test_engine.py"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    selected = set(re.findall(r"^tests/\S+::(\S+)$", proc.stdout, flags=re.MULTILINE))
    assert "test_greedy_decode_in_one_op_equals_single_steps[float32]" in selected
    assert "test_prefill_logits_and_states_match_reference" in selected
    for left_out in ("test_greedy_decode_in_one_op_equals_single_steps[bfloat16]",
                     "test_bfloat16_logits_close_and_greedy_equal", "test_mixer_kernels_and_plain_ops_agree"):
        assert left_out not in selected
    assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", proc.stdout), proc.stdout[-500:]


def test_the_session_compiles_the_guards_graphs_for_its_target_when_it_runs(monkeypatch):
    """tests/conftest.py compiles up front, for x86-64-v3, the graphs of the collected tests
    the guard's children rerun (float32 graphs with the Mojo ops, not slow), and nothing
    for the guard when the guard is not collected or skips."""
    from srm_max.graphs.op_names import OP_SAMPLE_ROWS
    from tests.support import op_graphs
    from tests.support.cpu_guard import PREFILL_OP
    from tests.support.graphs import graphs, op_graphs as declare
    from tests.support.stand_ins import MarkedItem
    from tests.support.tiny import TINY

    def op_graph(vocab):  # a graph of its own for each row width
        return declare(OP_SAMPLE_ROWS, vocab=vocab)

    items = [MarkedItem(nodeid=GUARD_TEST),
             MarkedItem(op_graph(8), nodeid="tests/models/srm/test_kernels.py::test_a[1-2]"),
             MarkedItem(op_graph(16), nodeid=PREFILL_OP + "test_the_op_equals_float64_causal_attention[x]"),
             # not rerun: another test of a file the guard takes some tests of, a longer name,
             # a plain-op graph, a slow test, a file the guard does not take
             MarkedItem(op_graph(24), nodeid=PREFILL_OP + "test_the_op_refuses_bad_shapes_naming_the_problem"),
             MarkedItem(op_graph(32), nodeid=PREFILL_OP + "test_the_op_equals_float64_causal_attention_too"),
             MarkedItem(graphs(TINY, ("prefill",), kernels=False), nodeid="tests/models/srm/test_kernels.py::test_b"),
             MarkedItem(op_graph(40), pytest.mark.slow, nodeid="tests/models/srm/test_linear_op.py::test_c"),
             MarkedItem(op_graph(48), nodeid="tests/models/srm/test_engine.py::test_d")]
    monkeypatch.delenv(cpu_target.ENV, raising=False)
    monkeypatch.setenv("SRM_MAX_TARGET_GUARD", "1")
    if guard_reason() is not None:
        pytest.skip(guard_reason())
    jobs = guard_graph_jobs(items)
    assert [(job.kind, job.config.vocab, job.cpu_target) for job in jobs] == [(OP_SAMPLE_ROWS, 8, GUARD_TARGET),
                                                                              (OP_SAMPLE_ROWS, 16, GUARD_TARGET)]
    assert jobs[0].mef_path() != op_graphs.job(OP_SAMPLE_ROWS, 8).mef_path()
    assert guard_graph_jobs(items[1:]) == []
    monkeypatch.setenv(cpu_target.ENV, GUARD_TARGET)  # a run that compiles for the target already
    assert guard_graph_jobs(items) == []
