"""bench/compile_cost.py: its graphs build (compiling them is the benchmark: minutes in
empty caches, so not here)."""

from __future__ import annotations

import pytest

from bench.compile_cost import (FAMILY_GRAPHS, FLOOR_DIV_GRAPHS, GRAPHS, MODEL_GRAPHS, SUITE_GRAPHS, build,
                                constant_subgraph_files, kernel_counts, suite_graph)

# a test of a scalar int64 against another: in floor_div_signed, of the constant divisor's sign
SCALAR_TEST = "(!mo.tensor<[], si64>, !mo.tensor<[], si64>) -> !mo.tensor<[], bool>"


@pytest.mark.parametrize("name", [*GRAPHS, *MODEL_GRAPHS])
def test_every_graph_builds(name):
    graph = str(build(name))
    assert "matmul" in graph or name == "add"


def test_only_the_signed_floor_division_tests_its_constant_divisor():
    """The pair that shows what a compiled constant subgraph costs: ``ops.floor_div``
    tests the divisor's sign (an op on constants alone), ``floor_div_nonnegative`` does not."""
    signed, nonnegative = (str(suite_graph((name,))) for name in FLOOR_DIV_GRAPHS)
    assert "rmo.div" in signed and "rmo.div" in nonnegative
    assert SCALAR_TEST in signed and SCALAR_TEST not in nonnegative


def test_the_constant_subgraph_check_covers_both_architectures_and_reads_the_dump(tmp_path):
    assert {spec[0] for spec in SUITE_GRAPHS} == {"srm", "pha"}
    assert {spec[1] for spec in SUITE_GRAPHS} >= {"prefill", "decode", "decode_steps", "sample"}
    assert suite_graph(("pha", "decode", "float32", False)).name.startswith("pha_decode")
    for name in ("g.mojo", "g_constant_subgraphs.mojo", "g_constant_subgraphs_1.mojo", "g.mo.mlir"):
        (tmp_path / name).write_text("")
    assert constant_subgraph_files(tmp_path) == ["g_constant_subgraphs.mojo", "g_constant_subgraphs_1.mojo"]


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


# each family graph's op as MAX's graph text names it, and how many matmuls it holds
FAMILY_OPS = {"elementwise": ("rmo.mo.exp", 0), "matmul": ("rmo.matmul", 1), "batch_matmul": ("rmo.matmul", 1),
              "matmul_and_batch_matmul": ("rmo.matmul", 2), "four_matmuls": ("rmo.matmul", 4),
              "layer_norm": ("mo.reduce.layer_norm", 0), "rms_norm": ("mo.reduce.rms_norm", 0),
              "gather": ("rmo.mo.gather", 0), "gather_nd": ("rmo.mo.gather_nd", 0), "top_k": ("rmo.top_k", 0),
              "concat": ("rmo.concat", 0), "cumsum": ("rmo.mo.cumsum", 0), "argmax": ("rmo.mo.reduce.arg_max", 0),
              "second_matmul": ("rmo.matmul", 1)}


@pytest.mark.parametrize("kind", FAMILY_OPS)
def test_each_family_graph_holds_its_kind_of_op(kind):
    """``--families``: one kind of op per graph, so a row's cost beyond the elementwise
    graph's is that kind's; only the matmul rows hold matmuls."""
    op, matmuls = FAMILY_OPS[kind]
    text = str(build(f"family_{kind}"))
    assert op in text and text.count("rmo.matmul") == matmuls


def test_the_family_rows_are_the_kinds_and_one_process_compiling_two_graphs():
    kinds = {name.removeprefix("family_") for name in FAMILY_GRAPHS}
    assert kinds == set(FAMILY_OPS) - {"second_matmul"} | {"two_matmul_graphs_in_one_process"}
    assert str(build("family_second_matmul")) != str(build("family_matmul"))
