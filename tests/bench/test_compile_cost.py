"""bench/compile_cost.py: its graphs build (compiling them is the benchmark: minutes in
empty caches, so not here)."""

from __future__ import annotations

import pytest

from bench.compile_cost import GRAPHS, build


@pytest.mark.parametrize("name", [*GRAPHS, "pha_plain_prefill_2", "pha_plain_prefill_1"])
def test_every_graph_builds(name):
    graph = str(build(name))
    assert "matmul" in graph or name == "add"


def test_depth_is_what_differs_between_the_pha_graphs():
    two, one = str(build("pha_plain_prefill_2")), str(build("pha_plain_prefill_1"))
    assert "blocks.1." in two and "blocks.1." not in one
