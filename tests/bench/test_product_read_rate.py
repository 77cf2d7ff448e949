"""bench/product_read_rate.py: its summary (its driver builds: test_bench_drivers.py; its output is read
by decode_op_ab.run_driver: test_bench.py; timing it is the benchmark: not here)."""

from __future__ import annotations

from bench import product_read_rate as prr


def test_widen_each_is_a_bfloat16_mode_only():
    assert "widen_each" in prr.modes_for("bfloat16")
    assert "widen_each" not in prr.modes_for("float32")


def test_summary_takes_medians_and_the_ratios_that_locate_the_limit():
    cells = {"stream": [100.0, 90.0, 110.0], "tile": [80.0, 90.0, 85.0], "per_unit": [60.0, 50.0, 70.0],
             "claimed": [90.0, 90.0, 90.0], "widen_each": [45.0, 40.0, 50.0]}
    s = prr.summarize(cells)
    assert s["stream_gbps"] == 100.0 and s["tile_gbps"] == 85.0 and s["per_unit_gbps"] == 60.0
    assert s["tile_over_stream"] == 0.85
    assert s["claimed_over_per_unit"] == 1.5
    assert s["tile_over_widen_each"] == 1.889
    assert s["rounds_gbps"]["per_unit"] == [60.0, 50.0, 70.0]
    no_bf16 = prr.summarize({m: cells[m] for m in prr.modes_for("float32")})
    assert "tile_over_widen_each" not in no_bf16


def test_the_sweep_varies_the_phase_size_then_the_total_each_cell_once():
    cells = prr.sweep_cells()
    assert len(cells) == len(set(cells))
    assert [kib for kib, mib in cells if mib == prr.SWEEP_TOTAL_MIB] == list(prr.SWEEP_PHASES_KIB)
    assert sorted(mib for kib, mib in cells if kib == prr.SWEEP_PHASE_KIB) == list(prr.SWEEP_TOTALS_MIB)


def test_a_sweep_cell_is_the_medians_and_the_ops_share_of_the_plain_read():
    s = prr.summarize_sweep({"stream": [200.0, 180.0, 190.0], "claimed": [95.0, 100.0, 80.0]})
    assert s["stream_gbps"] == 190.0 and s["claimed_gbps"] == 95.0 and s["claimed_over_stream"] == 0.5
    assert s["rounds_gbps"]["claimed"] == [95.0, 100.0, 80.0]
