"""bench/sampling.py and bench/grpo_groups.py: their pieces, and a quick end-to-end run of the
sampling benchmark on the embedded model (its graphs are shipped)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from srm_max.embedded import EMBEDDED_MODEL_DIR
from srm_max.models.registry import load_config
from tests.support.graphs import ENGINE_KINDS, graphs

pytestmark = graphs(load_config(EMBEDDED_MODEL_DIR / "config.json"), ENGINE_KINDS)


sampling = pytest.importorskip("bench.sampling")


def test_stop_tokens_sum_to_the_target_frequency():
    rng = np.random.default_rng(0)
    drawn = rng.integers(0, 100, (50, 400))  # about uniform over 100 tokens: 1 % each
    stop = sampling.stop_tokens(drawn, 100, mean_length=10)
    freq = np.bincount(drawn.ravel(), minlength=100) / drawn.size
    assert 0.09 <= freq[stop].sum() <= 0.11 and len(set(stop)) == len(stop)
    assert sampling.stop_tokens(drawn, 100, mean_length=10) == stop  # deterministic


def test_quick_run_writes_its_results(tmp_path, capsys):
    out = tmp_path / "sampling.json"
    result = sampling.main(["--quick", "--models", "embedded", "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row == json.loads(json.dumps(result["rows"][0]))
    assert row["samples"] == 64 and row["tokens"] >= row["samples"]
    assert row["pool_tokens_per_s"] > 0 and row["fixed_tokens_per_s"] > 0 and min(row["pure_decode_tokens_per_s"]) > 0
    assert out.with_suffix(".png").is_file()
    assert "pool / pure decode" in capsys.readouterr().out
