"""bench/pha_long_context.py and bench/pha_llama_cpp.py without a MAX compile or a
llama.cpp build: the parsing of llama-batched-bench's table, the bytes a step must read,
the comparison with llama.cpp's best run and the merging of runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bench import pha_llama_cpp
from bench import pha_long_context as bench

# llama-batched-bench's output (llama.cpp from llama-cpp-python 0.3.36), as printed
BATCHED_BENCH = """
llama_batched_bench: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |      4 |    1 |     36 |    0.006 |  5290.13 |    0.004 |  1125.81 |    0.010 |  3749.22 |
|    32 |      4 |    2 |     72 |    0.009 |  6754.62 |    0.005 |  1501.22 |    0.015 |  4863.55 |
"""


def test_the_batched_bench_table_is_parsed_row_by_row():
    rows = pha_llama_cpp.parse_batched_bench(BATCHED_BENCH)
    assert [r["batch"] for r in rows] == [1, 2]
    assert rows[0] == {"pp": 32, "tg": 4, "batch": 1, "n_kv": 36, "t_pp_s": 0.006, "prompt_tokens_per_s": 5290.13,
                       "t_tg_s": 0.004, "decode_tokens_per_s": 1125.81, "t_s": 0.010, "tokens_per_s": 3749.22}
    assert rows[1]["decode_tokens_per_s"] == 1501.22
    assert pha_llama_cpp.parse_batched_bench("no table here\n| a | b |\n") == []


def fake_batched_bench(folder, tables: list[str]):
    """An executable printing ``tables[i]`` on its i-th run (the last one thereafter)."""
    for i, table in enumerate(tables):
        (folder / f"out{i}").write_text(table)
    script = folder / "llama-batched-bench"
    script.write_text(f"""#!/bin/sh
n=$(cat {folder}/count 2>/dev/null || echo 0)
echo $((n + 1)) > {folder}/count
cat {folder}/out$(( n < {len(tables) - 1} ? n : {len(tables) - 1} ))
""")
    script.chmod(0o755)
    return script


def test_a_run_that_prints_no_table_is_run_again_and_a_third_fails(tmp_path, capsys):
    header_only = BATCHED_BENCH.split("|    32")[0]
    binary = fake_batched_bench(tmp_path, [header_only, BATCHED_BENCH])
    rows = pha_llama_cpp.run(tmp_path / "model.gguf", 36, 4, [1, 2], binary=binary)
    assert [r["batch"] for r in rows] == [1, 2]
    assert "attempt 1 of 3 gave no table" in capsys.readouterr().out
    (tmp_path / "count").unlink()
    binary = fake_batched_bench(tmp_path, [header_only])
    with pytest.raises(RuntimeError, match="llama-batched-bench .* failed"):
        pha_llama_cpp.run(tmp_path / "model.gguf", 36, 4, [1, 2], binary=binary)
    assert (tmp_path / "count").read_text().strip() == str(pha_llama_cpp.ATTEMPTS)


def test_the_llama_has_the_attention_branchs_shape():
    config = pha_llama_cpp.llama_config(bench.configs("pha", 512, quick=False))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (256, 4, 4, 2, 64, 1024, 4096)
    assert config.tie_word_embeddings


def test_the_llamas_tokenizer_has_no_id_beyond_a_smaller_models_vocabulary(tmp_path):
    # the quick model's vocabulary (512) is smaller than the embedded tokenizer's; llama.cpp's
    # converter refuses a tokenizer with ids the embedding lacks
    from tokenizers import Tokenizer

    from srm_max.embedded import EMBEDDED_MODEL_DIR

    vocab = bench.configs("pha", 128, quick=True).vocab_size
    spec = pha_llama_cpp.tokenizer_of_vocab(EMBEDDED_MODEL_DIR / "tokenizer.json", vocab)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab
    ids = tokenizer.encode("To be, or not to be, that is the question.").ids
    assert ids and max(ids) < vocab and tokenizer.decode(ids) == "To be, or not to be, that is the question."
    whole = Tokenizer.from_file(str(EMBEDDED_MODEL_DIR / "tokenizer.json"))
    assert pha_llama_cpp.tokenizer_of_vocab(EMBEDDED_MODEL_DIR / "tokenizer.json", whole.get_vocab_size()) == \
        json.loads((EMBEDDED_MODEL_DIR / "tokenizer.json").read_text())


def test_a_step_reads_the_matrices_once_per_call_and_each_samples_state_every_step():
    c = bench.configs("pha", 512, quick=True)
    one = bench.step_bytes("pha", c, 1, 100, 4)
    # doubling the batch adds one more sample's state; doubling the steps halves the matrices' share
    per_sample = bench.step_bytes("pha", c, 2, 100, 4) - one
    assert per_sample == pytest.approx(sum(bench.sample_bytes("pha", c, 100 + s) for s in range(4)) / 4)
    assert one - per_sample == pytest.approx(bench.matrix_bytes("pha", c) / 4)
    # the KV rows read grow with the position, the GSS state does not
    attn = bench.configs("pha-attn", 512, quick=True)
    assert bench.sample_bytes("pha", c, 200) - bench.sample_bytes("pha", c, 100) == (
        bench.sample_bytes("pha-attn", attn, 200) - bench.sample_bytes("pha-attn", attn, 100)) > 0


def test_the_reread_limit_reads_the_matrices_every_step_and_the_state_at_the_streaming_rate():
    c = bench.configs("pha", 512, quick=True)
    mats = bench.matrix_bytes("pha", c)
    per_step = bench.step_bytes("pha", c, 3, 100, 4)
    state = per_step - mats / 4
    # matrices at 2e9 B/s every step, the state at 1e9 B/s
    assert bench.reread_limit_ms(per_step, mats, 4, 2e9, 1e9) == pytest.approx(1e3 * (mats / 2e9 + state / 1e9))
    # with one step per call it is the streaming limit at equal bandwidths
    one = bench.step_bytes("pha", c, 3, 100, 1)
    assert bench.reread_limit_ms(one, mats, 1, 1e9, 1e9) == pytest.approx(1e3 * one / 1e9)
    assert bench.reread_bytes_per_s(1 << 16, repeats=2) > 0


def test_the_max_engines_are_compared_with_llama_cpps_best_run():
    rows = [{"model": "pha", "path": "op", "context": 512, "decode_tokens_per_s_b1": 100.0,
             "decode_tokens_per_s_b16": 800.0},
            {"model": "pha", "path": "op", "context": 512, "prefill_tokens_per_s": 2000.0}]
    llama = [{"context": 512, "batch": 1, "threads": 2, "decode_tokens_per_s": 50.0, "prompt_tokens_per_s": 4000.0},
             {"context": 512, "batch": 1, "threads": 1, "decode_tokens_per_s": 200.0, "prompt_tokens_per_s": 3000.0},
             {"context": 512, "batch": 16, "threads": 2, "decode_tokens_per_s": 400.0, "prompt_tokens_per_s": 1.0},
             {"context": 2048, "batch": 1, "threads": 1, "decode_tokens_per_s": 1.0, "prompt_tokens_per_s": 1.0}]
    out = bench.against_llama_cpp(rows, llama)
    decode = {e["batch"]: e for e in out if "decode" in e}
    assert decode[1]["decode"] == 0.5 and decode[1]["llama_cpp_decode_threads"] == 1
    assert decode[16]["decode"] == 2.0 and decode[16]["llama_cpp_decode_threads"] == 2
    (prefill,) = [e for e in out if "prefill" in e]
    assert prefill["prefill"] == 0.5 and prefill["llama_cpp_prefill_threads"] == 2
    assert all(e["context"] == 512 for e in out)


def test_the_bytes_a_step_rereads_for_the_max_engines_and_for_llama_cpp():
    c = bench.configs("pha", 512, quick=True)
    per_sample = sum(bench.sample_bytes("pha", c, 100 + s) for s in range(4)) / 4
    assert bench.reread_step_bytes("pha", c, 3, 100, 4) == pytest.approx(bench.matrix_bytes("pha", c) + 3 * per_sample)
    # llama.cpp: float32 parameters every step, float16 keys and values per sequence and row
    kv_row = 2 * 2 * c.n_layers * c.n_kv_heads * c.head_dim
    assert bench.llama_cpp_step_bytes(c, 2, 100, 4, 1000) == pytest.approx(4000 + 2 * kv_row * 101.5)


def test_the_decode_per_byte_weighs_the_ratio_by_the_bytes_each_step_rereads():
    rows = [{"model": "pha", "path": "op", "context": 512, "decode_tokens_per_s_b1": 100.0,
             "reread_bytes_per_step_b1": 3000}]
    llama = [{"context": 512, "batch": 1, "decode_tokens_per_s": 125.0, "prompt_tokens_per_s": 1.0,
              "reread_bytes_per_step": 2000}]
    (entry,) = bench.against_llama_cpp(rows, llama)
    assert entry["decode"] == 0.8 and entry["bytes_per_step_over_llama_cpp"] == 1.5
    assert entry["decode_per_byte"] == pytest.approx(1.2)
    # the decode into donated states, beside the decode on a copy
    (entry,) = bench.against_llama_cpp([rows[0] | {"donated_decode_tokens_per_s_b1": 150.0}], llama)
    assert entry["decode"] == 0.8 and entry["decode_donated"] == 1.2
    # a llama.cpp row of an older run, without its bytes, gives the ratio alone
    del llama[0]["reread_bytes_per_step"]
    (entry,) = bench.against_llama_cpp(rows, llama)
    assert entry["decode"] == 0.8 and "decode_per_byte" not in entry


def test_pha_over_attention_merges_a_models_rows_from_several_runs():
    rows = [{"model": "pha", "path": "op", "context": 512, "decode_tokens_per_s_b1": 1.0, "prefill_tokens_per_s": 9.0},
            {"model": "pha-attn", "path": "op", "context": 512, "decode_tokens_per_s_b1": 100.0},
            {"model": "pha", "path": "op", "context": 512, "decode_tokens_per_s_b1": 50.0, "decode_from": 495,
             "steps_per_call": 16},
            {"model": "pha-attn", "path": "op", "context": 512, "prefill_tokens_per_s": 60.0},
            {"model": "pha", "path": "op", "context": 512, "prefill_tokens_per_s": 30.0},
            {"model": "pha", "path": "op", "context": 512, "decode_tokens_per_s_b1": 7.0, "decode_from": 100,
             "steps_per_call": 16},
            {"model": "pha", "path": "graph", "context": 512, "decode_tokens_per_s_b1": 7.0}]
    (ratio,) = bench.pha_vs_attention(rows, 512)
    # the latest run's number wins; rows from other positions and the plain graph's are left out
    assert ratio["decode_tokens_per_s_b1"] == 0.5
    assert ratio["prefill_tokens_per_s"] == 0.5
    assert bench.pha_vs_attention(rows, 2048) == []
    # a later run of the PHA alone leaves the ratio of the runs that timed both
    alone = {"model": "pha", "path": "op", "context": 512, "decode_tokens_per_s_b1": 99.0, "run": 2}
    (ratio,) = bench.pha_vs_attention([r | {"run": 1} for r in rows] + [alone], 512)
    assert ratio["decode_tokens_per_s_b1"] == 0.5 and "run" not in ratio and "decode_from" not in ratio


def test_llama_cpp_ratios_are_taken_within_a_run_only():
    fast = {"model": "pha", "path": "op", "context": 512, "decode_tokens_per_s_b1": 100.0}
    runs = [{"steps_per_call": 16, "rows": [fast], "llama_cpp": [
                {"context": 512, "batch": 1, "threads": 2, "decode_tokens_per_s": 50.0, "prompt_tokens_per_s": 1.0}]},
            {"steps_per_call": 16, "rows": [fast | {"decode_tokens_per_s_b1": 30.0}], "llama_cpp": [
                {"context": 512, "batch": 1, "threads": 2, "decode_tokens_per_s": 20.0, "prompt_tokens_per_s": 1.0}]},
            {"steps_per_call": 16, "rows": [fast], "llama_cpp": []}]
    out = bench.summarized({"runs": runs})["against_llama_cpp"]
    assert [(e["run"], e["decode"]) for e in out] == [(1, 2.0), (2, 1.5)]


class Recording:
    """A stand-in engine that records what ``measure`` asks of it (nothing compiled): the
    length of each prompt prefilled, the (pool rows, fresh rows, index) of each regroup."""

    config = bench.configs("pha", 128, quick=True)
    dtype = "float32"
    steps_in_one_op = True

    def __init__(self):
        self.asked = []

    def prefill(self, prompts):
        self.asked.append(len(prompts[0]))

    def decode(self, ids, pos, states, sampling, steps, donate_states=False):
        return None

    def regroup(self, pool, fresh, index, donate_pool=False):
        self.asked.append((pool.shape[1], fresh.shape[1], list(index)) + (("donated",) if donate_pool else ()))

    @staticmethod
    def empty_states(batch):
        return np.zeros((1, batch, 4), np.float32)

    @staticmethod
    def host(a):
        return a

    @staticmethod
    def graph_job(kind):
        return SimpleNamespace(kind=kind)


def test_prefill_lengths_time_one_prompt_of_each_length():
    """``--prefill-lengths``: the prefill of one prompt of each length beside the full one."""
    engine = Recording()
    row = bench.measure("pha", engine, 128, 4, (), 2, np.random.default_rng(0), prefill_lengths=[1, 64])
    assert engine.asked == [128] * 3 + [1] * 3 + [64] * 3  # a warm-up, then 2 repeats each
    assert {"prefill_seconds_t1", "prefill_seconds_t64", "prefill_seconds"} <= row.keys()


def test_paired_prefill_alternates_the_order_and_takes_the_median_of_the_rounds_ratios(monkeypatch):
    """``--paired-rounds``: each round times the engine and one llama.cpp run seconds apart,
    the engine first in even rounds, llama.cpp first in odd ones; the verdict is the median
    of the rounds' ratios and the rounds won, not a best against a best."""
    order = []
    engine = Recording()
    seconds = [0.5, 0.1, 0.2]  # the engine's best call in each round: 200, 1,000, 500 tokens/s for 100 tokens
    llama_rates = [400.0, 500.0, 1000.0]

    def fake_timed(repeats, run):
        run()
        order.append("engine")
        return [seconds.pop(0)]

    def llama_prompt_rate():
        order.append("llama.cpp")
        return llama_rates.pop(0)

    monkeypatch.setattr(bench, "timed", fake_timed)
    (row,) = bench.paired_prefill({("pha", "op", "float32"): engine}, 100, 3, 2, np.random.default_rng(0),
                                  llama_prompt_rate)
    assert order == ["engine", "llama.cpp", "llama.cpp", "engine", "engine", "llama.cpp"]
    assert engine.asked == [100] * 3
    assert [r["ratio"] for r in row["rounds"]] == [0.5, 2.0, 0.5]
    assert [r["engines_first"] for r in row["rounds"]] == [True, False, True]
    assert row["median_ratio"] == 0.5 and row["rounds_won"] == 1
    # each order's rounds on their own, the verdict the lower median
    assert row["median_ratio_engines_first"] == 0.5 and row["median_ratio_llama_cpp_first"] == 2.0
    assert row["ratio"] == 0.5
    assert (row["model"], row["path"], row["dtype"], row["context"]) == ("pha", "op", "float32", 100)


def test_the_paired_verdict_is_the_lower_of_the_two_orders_medians_and_summarize_recomputes_it():
    """llama.cpp slowed right after the engines in some rounds: the rounds with the engines
    first (even) can favour them, so the verdict is the lower order's median; ``--summarize``
    gives an earlier run's rounds the same verdict."""
    ratios = [1.8, 0.96, 1.7, 0.98, 2.0, 0.94]
    summary = bench.paired_summary(ratios)
    assert summary["median_ratio_engines_first"] == 1.8 and summary["median_ratio_llama_cpp_first"] == 0.96
    assert summary["ratio"] == 0.96 and summary["rounds_won"] == 3 and summary["median_ratio"] == pytest.approx(1.34)
    assert bench.paired_summary([1.2])["ratio"] == 1.2  # one round: one order
    run = {"steps_per_call": 16, "rows": [], "llama_cpp": [],
           "paired_prefill": [{"model": "pha", "context": 512, "rounds": [{"ratio": r} for r in ratios],
                               "median_ratio": 1.34}]}
    (paired,) = bench.summarized({"runs": [run]})["runs"][0]["paired_prefill"]
    assert paired["ratio"] == 0.96 and paired["median_ratio_engines_first"] == 1.8


def test_refill_regroups_a_batch_whose_first_row_a_fresh_state_replaces():
    """``--refill``: the regroups the slot pool asks when row 0 of a batch of B finishes (the kept
    rows moved, or the fresh row written into its slot of the donated states), timed per
    batch, and the regroup graph among the graphs the run compiles."""
    engine = Recording()
    row = bench.measure("pha", engine, 128, 4, (1, 3), 2, np.random.default_rng(0), prefill=False, refill=True)
    # a warm-up, then 2 repeats each
    assert engine.asked == [(1, 1, [1])] * 3 + [(1, 1, [1], "donated")] * 3 + [(3, 1, [1, 2, 3])] * 3 \
        + [(3, 1, [3, 1, 2], "donated")] * 3
    assert {"refill_ms_b1", "refill_ms_b3", "refill_spread_b3", "refill_in_place_ms_b3"} <= row.keys()
    assert len(row["refill_ms_runs_b3"]) == len(row["refill_in_place_ms_runs_b3"]) == 2
    assert [job.kind for job in bench.graphs_used(engine, prefill=False, decode=False, refill=True)] == ["regroup"]


def test_the_branch_variants_are_the_pha_with_branches_left_out():
    """pha-attn, pha-gss, pha-ffn: the PHA's shape with the branches each names, and no
    other difference (what each branch costs is the difference of two rows)."""
    import dataclasses

    pha = bench.configs("pha", 512, quick=True)
    for name, branches in (("pha-attn", ("attn", "ffn")), ("pha-gss", ("gss", "ffn")), ("pha-ffn", ("ffn",))):
        variant = bench.configs(name, 512, quick=True)
        assert variant.branches == branches
        assert dataclasses.replace(variant, branches=pha.branches) == pha


def test_a_prefills_flops_count_each_matrix_per_token_the_head_once_and_the_causal_attention():
    """Every matrix once per token, but the head once and, in the last block, the matrices whose
    output only the last token's logits read (graphs/pha/prefill.py ``out_at``) once."""
    import dataclasses

    c = bench.configs("pha", 512, quick=True)
    E, F, H, dq = c.d_model, c.gss_expansion_dim, c.gss_hidden_dim, c.n_q_heads * c.head_dim
    head = c.vocab_size * E
    matrices = bench.matrix_bytes("pha", c, weight_bytes=1) - head  # elements, the head apart
    ffns = sum(2 * f * E for f in c.ffn_dims)
    # 10 tokens: 1 + 2 + ... + 10 = 55 causal rows per query head, a score and a weighted value
    # each; the last block the last token's query alone, 10 rows
    attention = (c.n_layers - 1) * c.n_q_heads * c.head_dim * 2 * 55 + c.n_q_heads * c.head_dim * 2 * 10
    # the last block: the GSS's u, gate and output layer, attention's output projection, the FFNs
    last_token_only = 2 * F * E + F * H + E * dq + ffns
    assert bench.prefill_flops("pha", c, 10) == 2 * (10 * matrices + head + attention - 9 * last_token_only)
    sequential = dataclasses.replace(c, mode="sequential")  # the branches with a state run whole
    assert bench.prefill_flops("pha", sequential, 10) == 2 * (10 * matrices + head + attention - 9 * ffns)
    gss = bench.configs("pha-gss", 512, quick=True)  # no attention branch
    gss_matrices = bench.matrix_bytes("pha-gss", gss, 1) - head
    assert bench.prefill_flops("pha-gss", gss, 10) == 2 * (10 * gss_matrices + head - 9 * (2 * F * E + F * H + ffns))
    # llama.cpp's Llama: its parameters, the tied embedding as the head once, its last FFN at one
    # row (its attention runs every query)
    ffn = 3 * E * 4 * E
    attention_every_query = c.n_layers * c.n_q_heads * c.head_dim * 2 * 55
    assert bench.llama_cpp_prefill_flops(c, 10, 5000 + head) == 2 * (10 * 5000 + head - 9 * ffn
                                                                      + attention_every_query)


def test_the_prefill_per_flop_weighs_the_ratio_by_the_flops_per_token():
    rows = [{"model": "pha", "path": "op", "context": 512, "prefill_tokens_per_s": 900.0,
             "prefill_flops": 512 * 3e6}]
    llama = [{"context": 512, "batch": 1, "decode_tokens_per_s": 1.0, "prompt_tokens_per_s": 1000.0,
              "prompt_tokens": 496, "prompt_flops": 496 * 2e6}]
    (entry,) = bench.against_llama_cpp(rows, llama)
    assert entry["prefill"] == 0.9 and entry["prefill_flops_per_token_over_llama_cpp"] == pytest.approx(1.5)
    assert entry["prefill_per_flop"] == pytest.approx(1.35)
    assert bench.percent_of_peak(2e9, 0.5, {"flops": 8e9}) == 50


def test_llama_cpp_runs_at_each_context_right_after_the_max_engines(tmp_path, monkeypatch):
    """The host's speed drifts within minutes: llama.cpp is timed at a context as soon as
    the MAX engines there are, before the next context's engines are built."""
    import srm_max.runtime.precompile

    order = []

    def engine_of(name, config, path="op", dtype="float32"):
        order.append(("max", config.context_length))
        return Recording()

    def llama_cpp_rows(contexts, batches, steps, repeats, workdir, pha_config_of, threads=2):
        order.append(("llama.cpp", list(contexts)))
        return [{"context": n, "batch": B, "threads": threads, "decode_tokens_per_s": 10.0,
                 "prompt_tokens_per_s": 10.0} for n in contexts for B in batches]

    monkeypatch.setattr(bench, "engine_of", engine_of)
    monkeypatch.setattr(bench, "llama_cpp_rows", llama_cpp_rows)
    monkeypatch.setattr(bench, "stream_bytes_per_s", lambda repeats=5: 1e10)
    monkeypatch.setattr(bench, "reread_bytes_per_s", lambda nbytes, repeats=20: 1e10)
    monkeypatch.setattr(srm_max.runtime.precompile, "precompile", lambda jobs: None)
    out = tmp_path / "run.json"
    result = bench.main(["--quick", "--contexts", "128", "256", "--models", "pha", "--batches", "1", "--no-prefill",
                         "--repeats", "1", "--out", str(out)])
    assert order == [("max", 128), ("llama.cpp", [128]), ("max", 256), ("llama.cpp", [256])]
    assert [ll["context"] for ll in result["runs"][0]["llama_cpp"]] == [128, 256]
    assert [(e["context"], e["batch"]) for e in result["against_llama_cpp"]] == [(128, 1), (256, 1)]
    # the run's own re-read rates reach its cells' floors (the key the run writes them under)
    assert [("reachable_at_best_percent_of_streaming" in e) for e in result["streaming_target"]] == [True, True]


def test_a_cells_reachable_share_of_streaming_is_the_streaming_over_the_reread_limit():
    row = {"model": "pha", "path": "op", "context": 512, "streaming_limit_ms_b1": 0.2, "reread_limit_ms_b1": 0.4,
           "reread_bytes_per_step_b1": 3e7, "percent_of_streaming_b1": 30.0, "donated_percent_of_streaming_b1": 45.0,
           "streaming_limit_ms_b16": 3.0, "reread_limit_ms_b16": 3.5, "percent_of_streaming_b16": 70.0}
    run = {"steps_per_call": 16, "rows": [row], "llama_cpp": [], "reread_bytes_per_s": {"512": {"pha/float32": 1e11}}}
    one, sixteen = bench.streaming_reach(run)
    # into the states where timed so; a step at the re-read limit reaches 50 %, and one reading
    # all its 30 MB at the matrices' 100 GB/s (0.3 ms) 66.7 %
    assert (one["batch"], one["percent_of_streaming"], one["reachable_percent_of_streaming"]) == (1, 45.0, 50.0)
    assert not one["target_met"] and not one["target_reachable"]
    assert one["reachable_at_best_percent_of_streaming"] == pytest.approx(100 * 0.2 / 0.3)
    assert one["target_reachable_at_best"]
    assert sixteen["reachable_percent_of_streaming"] == pytest.approx(100 * 3.0 / 3.5)
    assert sixteen["target_met"] and sixteen["target_reachable"] and sixteen["dtype"] == "float32"
    assert "reachable_at_best_percent_of_streaming" not in sixteen  # no bytes re-read per step in the row
    # a row without the re-read limit (a run before it was measured) has no cell
    assert bench.streaming_reach({"rows": [{"model": "pha", "context": 512, "percent_of_streaming_b1": 30.0}]}) == []
    runs = [run, {"steps_per_call": 16, "rows": [], "llama_cpp": []}]
    entries = bench.summarized({"runs": runs})["streaming_target"]
    assert [e["run"] for e in entries] == [1, 1]
    (line,) = bench.streaming_target_by_cell([e for e in entries if e["batch"] == 1])
    assert "1 runs, target met in  0, reachable in  0 (at best  1)" in line and "best  45.0 %" in line
