"""The ``graphs`` marker: a test module declares the compiled graphs it needs
(``pytestmark = graphs(TINY)``; the graphs of Mojo ops alone: ``op_graphs(OP_SCAN)``) and
the session compiles all of them up front, side by side (tests/conftest.py
``suite_graphs``)."""

from __future__ import annotations

import dataclasses

import pytest

from srm_max.runtime.compiled import graph_kinds
from srm_max.runtime.precompile import joins_plain_and_op_graphs, unit_kinds

# the graphs a CPU engine with the Mojo ops loads (``Engine.graph_kinds``: its decodes take
# decode_steps)
ENGINE_KINDS = graph_kinds(steps_in_one_op=True)


def graphs(config, kinds=ENGINE_KINDS, dtype: str = "float32", kernels: bool = True):
    """A marker naming compiled graphs that the marked tests need (CPU). The session
    compiles every graph the selected tests declare up front, side by side. A prefill
    draws its first tokens with the engine's sample graph, which comes with it."""
    if "prefill" in kinds and "sample" not in kinds:
        kinds = (*kinds, "sample")
    return pytest.mark.graphs(*[(kind, config, dtype, kernels) for kind in kinds])


def op_graphs(*ops: str, vocab: int | None = None, dtype: str = "float32"):
    """A marker naming graphs of Mojo ops alone (tests/support/op_graphs.py, by op name;
    ``vocab``: the row width of the graphs that need one; ``dtype``: of their weights), which
    the marked tests load with ``op_graphs.model``. The float32 ones are graphs with the Mojo
    ops alone, so the x86-64-v3 guard keeps the tests that declare them."""
    from tests.support.op_graphs import OpGraphConfig, job

    for op in ops:
        job(op, vocab, dtype)  # refuses an op with no graph of its own here
    return graphs(OpGraphConfig(vocab), ops, dtype)


def declared_graph_jobs(items) -> list:
    """The compile jobs of every graph the ``items`` declare (``graphs`` markers)."""
    from srm_max.models import registry
    from tests.support import op_graphs

    specs = dict.fromkeys(spec for item in items for marker in item.iter_markers("graphs") for spec in marker.args)
    return list(dict.fromkeys(  # several ops may share one graph (op_graphs.TOGETHER)
        op_graphs.job(kind, config.vocab, dtype) if isinstance(config, op_graphs.OpGraphConfig)
        else registry.of(config).graph_job(kind, config, dtype, "cpu", kernels)
        for kind, config, dtype, kernels in specs))


def compile_report(seconds: dict, items) -> list[str]:
    """Lines naming each unit of graphs the session compiled up front (``seconds``: what
    ``precompile`` returned), dearest first, with the first test file that declares it:
    which graphs the cold suite's time goes to."""
    first_file: dict = {}
    for item in items:
        for job in declared_graph_jobs([item]):
            first_file.setdefault(job.mef_path(), item.nodeid.split("::")[0])
    graphs = sum(len(unit) for unit in seconds)
    lines = [f"{graphs} graph{'s' if graphs != 1 else ''} compiled up front in {len(seconds)} "
             f"unit{'s' if len(seconds) != 1 else ''}, {sum(seconds.values()):.0f} s of compiling "
             "(side by side, so more than the wall-clock time):"]
    for unit, s in sorted(seconds.items(), key=lambda us: -us[1]):
        job = unit[0]
        ops = "plain and Mojo ops" if joins_plain_and_op_graphs(unit) else ("Mojo ops" if job.kernels else "plain ops")
        target = f", for {job.cpu_target}" if job.cpu_target else ""
        where = first_file.get(dataclasses.replace(job, cpu_target="").mef_path(), "?")
        kinds = unit_kinds(unit)
        lines.append(f"{s:7.0f} s  {kinds} ({job.architecture}, {job.dtype}, {ops}{target}), declared by {where}")
    return lines


def undeclared(item, used) -> list:
    """The op graphs among ``used`` (``op_graphs.OpUse``) whose graph ``item`` does not declare."""
    declared = set(declared_graph_jobs([item]))
    return [use for use in used if use.job() not in declared]


# the pytest option (tests/conftest.py) that keeps only the tests for which
# needs_only_float32_kernel_graphs holds
KERNEL_GRAPHS_ONLY = "--float32-kernel-graphs-only"


def needs_only_float32_kernel_graphs(item) -> bool:
    """Whether every graph ``item`` declares is a float32 graph with the Mojo ops (the
    CPU engine's default graphs: what the x86-64-v3 guard recompiles and reruns)."""
    return all(dtype == "float32" and kernels
               for marker in item.iter_markers("graphs") for _kind, _config, dtype, kernels in marker.args)
