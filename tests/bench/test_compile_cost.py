"""bench/compile_cost.py: its graphs build (compiling them is the benchmark: minutes in
empty caches, so not here)."""

from __future__ import annotations

import pytest

from bench.compile_cost import GRAPHS, MODEL_GRAPHS, build, kernel_counts


@pytest.mark.parametrize("name", [*GRAPHS, *MODEL_GRAPHS])
def test_every_graph_builds(name):
    graph = str(build(name))
    assert "matmul" in graph or name == "add"


def test_the_srm_decode_graphs_are_one_graph_whatever_home_they_compile_in():
    assert str(build("srm_plain_decode_after_prefill")) == str(build("srm_plain_decode"))
    assert str(build("srm_plain_decode")) != str(build("srm_plain_prefill"))


def test_kernel_counts_sum_the_batches_of_the_log():
    log = ("[modular-cache][mogg] checkCache summary: 6 kernels, MOGG hit=6 miss=0, Mojo hit=6 miss=0\n"
           "other line\n"
           "[modular-cache][mogg] checkCache summary: 66 kernels, MOGG hit=8 miss=58, Mojo hit=8 miss=0\n")
    assert kernel_counts(log) == {"kernels": 72, "kernel_cache_hits": 14}
    assert kernel_counts("") == {"kernels": 0, "kernel_cache_hits": 0}


def test_depth_is_what_differs_between_the_pha_graphs():
    two, one = str(build("pha_plain_prefill_2")), str(build("pha_plain_prefill_1"))
    assert "blocks.1." in two and "blocks.1." not in one


def test_the_engines_of_units_compile_as_these_units(tmp_path, monkeypatch):
    """``--units`` compares each graph compiled alone with the units the compile workers
    make: the graphs binding the engine's weights together, and those binding none (the
    sampler and the regrouping) together."""
    from bench.compile_cost import engine_jobs
    from srm_max.runtime.precompile import compile_units

    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))
    kinds = {engine: [[job.kind for job in unit] for unit in compile_units(engine_jobs(engine))]
             for engine in ("srm_mojo_ops", "pha_plain_ops")}
    assert kinds == {"srm_mojo_ops": [["prefill", "decode_steps"], ["sample", "regroup"]],
                     "pha_plain_ops": [["prefill", "decode"]]}
