"""Smoke test of bench/scoring.py on the suite's TINY shapes: every row runs and the JSON holds
each rate, ratio and the machine (no speed is checked)."""

from __future__ import annotations

import json

import pytest

from tests.support.graphs import ENGINE_KINDS, graphs
from tests.support.tiny import TINY

pytestmark = graphs(TINY, ENGINE_KINDS)

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_scoring_bench_smoke(tmp_path, capsys):
    from bench import scoring

    out = tmp_path / "scoring.json"
    c = TINY
    rc = scoring.main(["--d-model", str(c.d_model), "--layers", str(c.n_layers), "--heads", str(c.n_heads),
                       "--vocab", str(c.vocab_size), "--context", str(c.context_length), "--batches", "1", "3",
                       "--length", "40", "--repeats", "2", "--decode-batch", "2", "--decode-prompt", "5",
                       "--decode-new", "6", "--contexts", "3", "--context-tokens", "20", "--grpo-batch", "3",
                       "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["machine"]["processor"] and res["model"]["d_model"] == c.d_model
    assert [r["batch"] for r in res["batches"]] == [1, 3]
    for r in res["batches"]:
        assert set(r["tokens_per_s"]) == {"prefill", "score", "hf"} and min(r["tokens_per_s"].values()) > 0
        assert r["score_over_prefill"] > 0 and r["score_over_hf"] > 0 and len(r["seconds"]["score"]) == 2
        assert r["score_flops_over_fma_peak"] > 0 and r["score_cpu_flops_over_core_peak"] > 0
    assert res["fma_peak"]["flops"] >= res["fma_peak"]["flops_per_core"] > 0
    assert res["decode"]["tokens"] == 2 * 6 and res["decode"]["logprobs_over_without"] > 0
    assert set(res["decode"]["op"]["over_without"]) == {"without", "chosen_only", "top_5"}
    assert res["loglikelihood"]["requests"] == 12 and res["loglikelihood"]["requests_per_s"] > 0
    assert res["grpo"]["rollouts"] == 3 and res["grpo"]["torch_over_engine"] > 0
    assert "score / prefill" in capsys.readouterr().out


def test_scoring_bench_decode_only_writes_only_a_file_given(tmp_path, capsys):
    from bench import scoring

    c = TINY
    args = ["--decode-only", "--d-model", str(c.d_model), "--layers", str(c.n_layers), "--heads", str(c.n_heads),
            "--vocab", str(c.vocab_size), "--context", str(c.context_length), "--repeats", "2", "--decode-batch", "2",
            "--decode-prompt", "5", "--decode-new", "6"]
    complete = scoring.RESULTS / "scoring.json"
    before = complete.stat().st_mtime_ns if complete.exists() else None
    assert scoring.main(args) == 0 and "sampled decode, batch 2" in capsys.readouterr().out
    assert (complete.stat().st_mtime_ns if complete.exists() else None) == before  # the complete run's file
    out = tmp_path / "decode.json"
    assert scoring.main(args + ["--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["decode"]["tokens"] == 2 * 6 and res["decode"]["op"]["over_without"]["top_5"] > 0
