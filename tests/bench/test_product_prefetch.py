"""bench/product_prefetch.py: its summary (its driver builds: test_bench_drivers.py; timing it
is the benchmark: not here)."""

from __future__ import annotations

import pytest

from bench import product_prefetch as pp


def test_the_modes_include_the_ops_ways_and_the_baseline():
    assert set(pp.MODES) == {"none", "own", "crowded", "spread"} and pp.BASELINE in pp.MODES


def test_summary_takes_medians_and_each_modes_ratio_to_the_baseline():
    runs = {"none": [50.0, 40.0, 60.0], "own": [60.0, 50.0, 55.0], "crowded": [66.0, 66.0, 66.0],
            "spread": [110.0, 100.0, 120.0]}
    s = pp.summarize(runs)
    assert s["own_gflops"] == 55.0 and s["spread_gflops"] == 110.0
    assert s["spread_over_own"] == 2.0 and s["crowded_over_own"] == 1.2 and s["none_over_own"] == 0.909
    assert "own_over_own" not in s
    assert s["rounds_gflops"]["none"] == [50.0, 40.0, 60.0]


def test_non_positive_rounds_or_workers_are_refused_before_any_build(capsys):
    for bad in (["--rounds", "0"], ["--workers", "-1"]):
        with pytest.raises(SystemExit) as e:
            pp.main(bad)
        assert e.value.code == 2
    assert "--rounds and --workers must be positive" in capsys.readouterr().err
