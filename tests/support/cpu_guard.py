"""What the x86-64-v3 guard (tests/runtime/test_cpu_target.py) reruns, and the graphs it
needs compiled for its target, so that the session can compile those up front beside
its own instead of leaving them to the guard's children one group at a time."""

from __future__ import annotations

import dataclasses
import os

from srm_max.runtime import cpu_target
from tests.support.graphs import KERNEL_GRAPHS_ONLY, declared_graph_jobs, needs_only_float32_kernel_graphs

GUARD_TARGET = "x86-64-v3"
GUARD_TEST = "tests/runtime/test_cpu_target.py::test_the_mojo_ops_pass_compiled_for_avx2"
PHA_OP = "tests/models/pha/test_pha_decode_op.py::"
PREFILL_OP = "tests/models/pha/test_pha_prefill_attention_op.py::"
GSS_OP = "tests/models/pha/test_pha_gss_scan_op.py::"
# What the guard reruns: the project's own CPU code, the Mojo ops, whose tiles and vector
# loops are written per SIMD width (AVX2: 8 float32 lanes, 16 registers; AVX-512: 16 and
# 32), each against its float64 or reference form, through the graph of the ops alone
# (tests/support/op_graphs.py ``TOGETHER``) or the engine's decode op alone (each a small
# compile for x86-64-v3). The engines' other graphs are MAX's own kernels around these
# ops, with no loop in them on a CPU (the MAX fault this guard was made for struck plain
# ops inside ``ops.while_loop``, docs/avx2_crash.md, and the CPU decode is one op now);
# they run as AVX2 code natively on the AVX2 CI machines.
#
# Children of the guard, each a process of its own. Under a virtual target, MAX's runtime
# faults at random calls once a PHA model has been loaded into a process after another has
# run (docs/avx2_crash.md), so the PHA's ops run apart from the SRM's and from each other:
# the SRM's ops (the mixer's step and scan, the whole decode step and its steps with the
# row sampler, the scored rows' head and row reduction, the prefill's dense layer), the
# PHA decode op's tests against the reference (the op's engine alone), and the PHA
# prefill's ops against float64 or numpy (the attention op on lengths across its AVX2
# tiles, the GSS scan op, the dense layer, the placement of the states).
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
     GSS_OP + "test_the_op_equals_the_float64_recurrence", GSS_OP + "test_the_phases_stay_accurate_over_8192_tokens",
     "tests/models/pha/test_linear_packed_op.py", "tests/models/pha/test_prefill_states.py"),
)
# Only tests whose graphs are float32 graphs with the Mojo ops (the op-alone graphs are);
# the slow ones (a virtual GPU's compile) are no CPU code.
GUARD_OPTIONS = (KERNEL_GRAPHS_ONLY, "-m", "not slow")


def guard_reason() -> str | None:
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


def selects(test: str, nodeid: str) -> bool:
    """Whether the guard's entry ``test`` (a file, or a test of a file) takes ``nodeid``."""
    if "::" in test:
        return nodeid == test or nodeid.startswith(test + "[")
    return nodeid.startswith(test + "::")


def guard_graph_jobs(items) -> list:
    """The graphs the guard's children will load, compiled for its target, when the guard
    runs in this session: those of its tests among ``items`` (the children select the
    same tests with ``GUARD_OPTIONS``). Empty when the guard is not selected or skips."""
    if guard_reason() is not None or not any(item.nodeid == GUARD_TEST for item in items):
        return []
    rerun = [item for item in items
             if any(selects(test, item.nodeid) for group in GUARD_TESTS for test in group)
             and needs_only_float32_kernel_graphs(item) and item.get_closest_marker("slow") is None]
    return [dataclasses.replace(job, cpu_target=GUARD_TARGET) for job in declared_graph_jobs(rerun)]
