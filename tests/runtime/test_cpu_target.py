"""The Mojo ops once more compiled for AVX2 (``x86-64-v3``).

Compiled CPU code differs between instruction sets: a fault that only AVX2 code
has (16 vector registers, 32-byte vectors) cannot show on an AVX-512 machine
running its own code. So where the host is not itself an ``x86-64-v3`` CPU, the
tests of the project's Mojo ops run again in child processes with
``SRM_MAX_CPU_TARGET=x86-64-v3`` (``srm_max.runtime.cpu_target``), each op checked against
its float64 or reference form. A child that crashes in every run is reported as a
failure naming the test each crash was in, instead of killing this run.
``SRM_MAX_TARGET_GUARD=1`` runs it on any x86-64 host (to check the guard itself).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from srm_max.runtime import cpu_target
from tests.support.graphs import KERNEL_GRAPHS_ONLY
from tests.support.paths import REPO_ROOT as ROOT

GUARD_TARGET = "x86-64-v3"
PHA_OP = "tests/models/pha/test_pha_decode_op.py::"
PREFILL_OP = "tests/models/pha/test_pha_prefill_attention_op.py::"
GSS_OP = "tests/models/pha/test_pha_gss_scan_op.py::"
# What the guard reruns: the project's own CPU code, the Mojo ops, whose tiles and vector
# loops are written per SIMD width (AVX2: 8 float32 lanes, 16 registers; AVX-512: 16 and
# 32), each against its float64 or reference form, through graphs of the op alone or of the
# engine's decode op alone (each a small compile for x86-64-v3). The engines' other graphs
# are MAX's own kernels around these ops, with no loop in them on a CPU (the MAX fault this
# guard was made for struck plain ops inside ``ops.while_loop``, docs/avx2_crash.md, and the
# CPU decode is one op now); they run as AVX2 code natively on the AVX2 CI machines.
#
# Children of the guard, each a process of its own. Under a virtual target, MAX's runtime
# faults at random calls once a PHA model has been loaded into a process after another has
# run (docs/avx2_crash.md), so the PHA's ops run apart from the SRM's and from each other:
# the SRM's ops (the mixer's step and scan, the whole decode step and its steps with the
# row sampler, the score graphs' head and row reduction, the prefill's dense layer), the
# PHA decode op's tests against the reference (the op's engine alone), and the PHA
# prefill's two ops against float64 (the attention op on lengths across its AVX2 tiles,
# the GSS scan op).
GUARD_TESTS = (
    ("tests/models/srm/test_kernels.py", "tests/models/srm/test_decode_step_op.py",
     "tests/models/srm/test_score_head.py", "tests/models/srm/test_score_rows.py",
     "tests/models/srm/test_linear_op.py"),
    tuple(PHA_OP + name for name in (
        "test_greedy_batch_equals_the_reference", "test_greedy_batch_of_one_across_blocks_and_slices",
        "test_a_sample_past_the_context_leaves_its_batch_mates_alone",
        "test_query_heads_read_in_groups_equal_the_reference",
        "test_no_steps_returns_the_inputs_and_leaves_the_caller_states")),
    (PREFILL_OP + "test_the_op_equals_float64_causal_attention",
     GSS_OP + "test_the_op_equals_the_float64_recurrence", GSS_OP + "test_the_phases_stay_accurate_over_8192_tokens"),
)
# Only tests whose graphs are float32 graphs with the Mojo ops (the op-alone graphs are, so
# each child compiles those it runs up front, side by side); the slow ones (a virtual GPU's
# compile) are no CPU code.
GUARD_OPTIONS = (KERNEL_GRAPHS_ONLY, "-m", "not slow")
# A child that dies by a signal runs again, up to this many times in all: that runtime
# fault strikes a child now and then, while a fault of the graphs' own AVX2 code strikes
# every run (the crash this guard was made for did), so it still fails the guard.
CRASH_ATTEMPTS = 3


def _guard_reason() -> str | None:
    """Why the guard does not run here (None: it runs)."""
    if cpu_target.requested():
        return f"this run already compiles for {cpu_target.requested()}"
    host = cpu_target.host_x86_level()
    if host is None:
        return "not an x86-64 host"
    if os.environ.get("SRM_MAX_TARGET_GUARD") == "1":
        return None
    if host == GUARD_TARGET:
        return f"the host is an {GUARD_TARGET} CPU: the suite's own engine tests ran AVX2 code"
    return None


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
@pytest.mark.skipif(_guard_reason() is not None, reason=str(_guard_reason()))
def test_the_mojo_ops_pass_compiled_for_avx2():
    problems = [run_for_target(tests, GUARD_TARGET, attempts=CRASH_ATTEMPTS, options=GUARD_OPTIONS)
                for tests in GUARD_TESTS]
    problems = [p for p in problems if p]
    if problems:
        pytest.fail("\n\n".join(problems))


def test_the_guard_names_tests_that_exist():
    """A renamed test would leave the guard selecting nothing from it (pytest exits
    with 4 on an unknown node id, so this also keeps the error readable)."""
    for tests in GUARD_TESTS:
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
    assert "test_greedy_decode_in_one_op_equals_the_graph_loop[float32]" in selected
    assert "test_prefill_logits_and_states_match_reference" in selected
    for left_out in ("test_greedy_decode_in_one_op_equals_the_graph_loop[bfloat16]",
                     "test_bfloat16_logits_close_and_greedy_equal", "test_mixer_kernels_and_plain_ops_agree"):
        assert left_out not in selected
    assert re.search(r"\d+/\d+ tests collected \(\d+ deselected\)", proc.stdout), proc.stdout[-500:]
