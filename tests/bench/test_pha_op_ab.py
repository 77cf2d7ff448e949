"""bench/pha_op_ab.py: its summary of interleaved rounds (running the op is the benchmark:
not here)."""

from __future__ import annotations

from bench import pha_op_ab


def _row(step: float, products: float, cache: float = 100.0) -> dict:
    return {"model": "pha", "dtype": "float32", "context": 512, "batch": 1, "step_us": step, "product_us": products,
            "cache_us": cache}


def test_cells_are_keyed_by_model_dtype_context_and_batch():
    assert pha_op_ab.cell_key(_row(1.0, 1.0)) == "pha float32 n=512 B=1"


def test_summary_takes_the_median_of_the_rounds_ratios_and_counts_the_rounds_b_won():
    key = "pha float32 n=512 B=1"
    rounds = [{key: (_row(a, a / 2), _row(b, b / 4))} for a, b in ((300, 200), (330, 300), (240, 300))]
    c = pha_op_ab.summarize(rounds)[key]
    assert c["step_ratios"] == [1.5, 1.1, 0.8]
    assert c["step_ratio"] == 1.1  # the median ratio, not the ratio of the medians (300 / 300)
    assert c["product_ratio"] == 2.2
    assert c["rounds_b_won"] == 2 and c["rounds"] == 3
    assert c["step_us_a"] == 300 and c["step_us_b"] == 300
    assert c["cache_ratio"] == 1.0 and c["cache_us_a"] == 100


def test_a_model_without_cache_phases_has_no_cache_ratio():
    key = "pha float32 n=512 B=1"
    c = pha_op_ab.summarize([{key: (_row(300, 150, 0.0), _row(200, 100, 0.0))}])[key]
    assert c["cache_ratio"] is None and c["step_ratio"] == 1.5
