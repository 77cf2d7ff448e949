"""bench/pha_attention_loop.py: its summary (its driver builds: test_bench_drivers.py; its output is read
by decode_op_ab.run_driver: test_bench.py; timing it is the benchmark: not here)."""

from __future__ import annotations

from bench import pha_attention_loop as pal


def test_summary_bounds_the_loop_from_memory_by_no_and_full_overlap():
    cells = {"stream_memory": [18.0, 20.0, 22.0], "loop_memory": [9.0, 10.0, 8.0], "per_head_memory": [6.0, 6.0, 6.0],
             "stream_cache": [50.0, 50.0, 50.0], "loop_cache": [30.0, 20.0, 30.0], "per_head_cache": [9.0, 9.0, 9.0]}
    s = pal.summarize(cells)
    assert s["stream_memory_gbps"] == 20.0 and s["loop_cache_gbps"] == 30.0 and s["loop_memory_gbps"] == 9.0
    assert s["no_overlap_gbps"] == 12.0  # 1 / (1/20 + 1/30)
    assert s["full_overlap_gbps"] == 20.0
    assert s["loop_memory_over_stream_memory"] == 0.45
    assert s["loop_over_per_head_memory"] == 1.5
    assert s["rounds_gbps"]["loop_cache"] == [30.0, 20.0, 30.0]


def test_against_base_takes_the_median_of_the_rounds_ratios_and_counts_the_rounds_won():
    cells = {"loop_memory": [10.0, 9.0, 12.0], "loop_memory_base": [10.0, 10.0, 10.0],
             "loop_cache": [30.0, 33.0, 36.0], "loop_cache_base": [20.0, 30.0, 40.0]}
    s = pal.against_base(cells)
    assert s == {"loop_memory_over_base": 1.0, "loop_memory_rounds_won": 1,
                 "loop_cache_over_base": 1.1, "loop_cache_rounds_won": 2}
    assert pal.against_base({"loop_memory": [1.0], "loop_cache": [1.0]}) == {}
