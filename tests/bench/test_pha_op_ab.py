"""bench/pha_op_ab.py: its summary of interleaved rounds, and what both A/B tools record of B
(running the op is the benchmark: not here)."""

from __future__ import annotations

import subprocess

import pytest

from bench import pha_op_ab
from bench.decode_op_ab import working_tree_change


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


def test_the_json_names_what_b_is_the_note_and_the_working_trees_mojo_diff(tmp_path):
    """Both A/B tools keep, beside the base commit, what the working tree's op is: the
    --note and the diff of its mojo/ against the base (empty when nothing changed)."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "mojo").mkdir()
    (tmp_path / "mojo" / "op.mojo").write_text("comptime AHEAD = 32\n")
    (tmp_path / "README").write_text("not the op\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    assert working_tree_change("HEAD", "", tmp_path) == {"note": "", "mojo_diff": ""}
    (tmp_path / "mojo" / "op.mojo").write_text("comptime AHEAD = 128\n")
    (tmp_path / "README").write_text("changed, but not the op\n")
    b = working_tree_change("HEAD", "rows fetched 128 ahead", tmp_path)
    assert b["note"] == "rows fetched 128 ahead"
    assert "-comptime AHEAD = 32" in b["mojo_diff"] and "+comptime AHEAD = 128" in b["mojo_diff"]
    assert "README" not in b["mojo_diff"]
    with pytest.raises(SystemExit, match="no-such-revision"):
        working_tree_change("no-such-revision", "", tmp_path)
