"""bench/pha_long_context.py's paired decode rounds (``--paired-rounds`` with decode on)
without a MAX compile or a llama.cpp build: a stand-in engine and llama.cpp rates."""

from __future__ import annotations

import numpy as np

from bench import pha_long_context as bench


class Decoding:
    """A stand-in engine that records each decode call: (batch, first position, steps,
    donated)."""

    config = bench.configs("pha", 128, quick=True)

    def __init__(self):
        self.calls = []

    def decode(self, ids, pos, states, sampling, steps, donate_states=False):
        assert states.shape[1] == len(ids) == len(pos) == len(sampling.temperature)
        self.calls.append((len(ids), int(pos[0]), steps, donate_states))

    @staticmethod
    def empty_states(batch):
        return np.zeros((1, batch, 4), np.float32)


def test_paired_decode_times_each_batch_against_llama_cpp_at_every_batch_in_each_round(monkeypatch):
    """Each round times every engine's decode into its states at every batch and llama.cpp
    once for its decode rate at every batch, the engines first in even rounds; each
    (engine, batch) gets its rounds' ratios and the paired verdict."""
    order = []
    engine = Decoding()
    seconds = iter([0.04, 0.02, 0.01, 0.04])  # best call per round and batch: batch 1, then 4
    llama = iter([{1: 400.0, 4: 1600.0}, {1: 100.0, 4: 6400.0}])

    def fake_timed(repeats, run):
        run()
        order.append("engine")
        return [next(seconds)]

    def llama_decode_rates():
        order.append("llama.cpp")
        return next(llama)

    monkeypatch.setattr(bench, "timed", fake_timed)
    rows = bench.paired_decode({("pha", "op", "float32"): engine}, 128, 2, 3, 8, (1, 4), np.random.default_rng(0),
                               llama_decode_rates)
    assert order == ["engine", "engine", "llama.cpp", "llama.cpp", "engine", "engine"]
    # the last steps before the context's end, into the states themselves
    assert engine.calls == [(1, 119, 8, True), (4, 119, 8, True)] * 2
    by_batch = {r["batch"]: r for r in rows}
    # batch 1: 8 tokens in 0.04 s = 200 tokens/s against 400, then 800 against 100
    assert [r["ratio"] for r in by_batch[1]["rounds"]] == [0.5, 8.0]
    # batch 4: 32 tokens in 0.02 s = 1,600 against 1,600, then 800 against 6,400
    assert [r["ratio"] for r in by_batch[4]["rounds"]] == [1.0, 0.125]
    assert [r["engines_first"] for r in by_batch[4]["rounds"]] == [True, False]
    assert by_batch[1]["ratio"] == 0.5 and by_batch[1]["rounds_won"] == 1
    assert by_batch[4]["ratio"] == 0.125 and by_batch[4]["rounds_won"] == 0
    assert {(r["model"], r["path"], r["dtype"], r["context"], r["steps_per_call"]) for r in rows} == {
        ("pha", "op", "float32", 128, 8)}


def test_summarize_recomputes_the_paired_decode_verdict():
    """``--summarize`` gives an earlier run's paired decode rounds the verdict
    ``paired_summary`` gives now, as it does the paired prefill's."""
    ratios = [1.8, 0.96, 1.7, 0.98]
    run = {"steps_per_call": 16, "rows": [], "llama_cpp": [],
           "paired_decode": [{"model": "pha", "context": 512, "batch": 1, "rounds": [{"ratio": r} for r in ratios],
                              "ratio": 1.8}]}
    (paired,) = bench.summarized({"runs": [run]})["runs"][0]["paired_decode"]
    assert paired["ratio"] == 0.97 and paired["median_ratio_engines_first"] == 1.75 and paired["rounds_won"] == 2


def test_llama_cpp_side_of_a_round_is_its_best_run_per_batch():
    """llama.cpp's side of a paired round is its best of as many runs as the engines' calls,
    per batch and per rate on its own (one run can have the best prompt, another the best
    decode)."""
    runs = [[{"batch": 1, "decode_tokens_per_s": 900.0, "prompt_tokens_per_s": 5000.0},
             {"batch": 16, "decode_tokens_per_s": 2000.0, "prompt_tokens_per_s": 6000.0}],
            [{"batch": 1, "decode_tokens_per_s": 1100.0, "prompt_tokens_per_s": 4000.0},
             {"batch": 16, "decode_tokens_per_s": 1800.0, "prompt_tokens_per_s": 6500.0}]]
    assert bench.best_by_batch(runs, "decode_tokens_per_s") == {1: 1100.0, 16: 2000.0}
    assert bench.best_by_batch(runs, "prompt_tokens_per_s") == {1: 5000.0, 16: 6500.0}
