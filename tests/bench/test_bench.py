"""Smoke tests of bench/: the benchmarks run end to end on the suite's tiny config.

They check that every engine runs and that the JSON, the markdown table and the plot
are written, not any speed. The SRM on MAX uses the suite's TINY shapes, so it loads
the compiled graphs the other tests already cached.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from srm_max.runtime import cpu_target
from tests.support.graphs import graphs
from tests.support.paths import REPO_ROOT as ROOT
from tests.support.tiny import TINY

pytestmark = graphs(TINY)


pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return {name: importlib.import_module(f"bench.{name}") for name in ("common", "throughput", "concurrency", "h100")}


def tiny_args(config) -> list[str]:
    return ["--d-model", str(config.d_model), "--layers", str(config.n_layers), "--heads", str(config.n_heads),
            "--vocab", str(config.vocab_size)]


def test_throughput_smoke(bench, tiny_config, tmp_path, capsys):
    out = tmp_path / "tp"
    rc = bench["throughput"].main([
        *tiny_args(tiny_config), "--context", str(tiny_config.context_length),
        "--batches", "1,2", "--prompts", "8", "--new-tokens", "3", "--threads", "1",
        "--roofline-n", "128", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    res = json.loads(out.with_suffix(".json").read_text())
    assert "throughput.py" in res["command"] or "pytest" in res["command"]
    ok = [r for r in res["runs"] if r["status"] == "ok"]
    engines = {r["engine"] for r in ok}
    assert engines == {"srm-max", "srm-torch", "llama-hf", "mamba-hf"}, res["runs"]
    for r in ok:
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0 and r["new_tokens"] == 3
    # every engine's parameters within 10% of the SRM's
    n = tiny_config.num_parameters()
    for name, d in res["engines"].items():
        assert abs(d["parameters"] - n) <= 0.1 * n, (name, d["parameters"], n)
    assert "MAX runtime default" in res["engines"]["srm-max"]["threads"]
    max_threads = {r["threads"] for r in ok if r["engine"] == "srm-max"}
    assert "all" in max_threads
    if len(os.sched_getaffinity(0)) > 1:
        assert 1 in max_threads  # the child process pinned to one core ran too
    assert res["engines"]["llama-hf"]["cache"] == "static"
    assert res["roofline"]["roofline_tokens_per_s"] > 0
    assert "percent_of_roofline" in res["roofline"]
    ratio = res["ratios_tokens_per_s"][0]
    assert {"srm-max/llama-hf", "srm-max/mamba-hf", "srm-max/srm-torch"} <= set(ratio)
    assert res["srm_max_vs_torch_token_agreement"], res["runs"]  # no batch where both engines ran: say why
    assert "| prompt | batch |" in text and "max/llama" in text and "Roofline" in text
    assert out.with_suffix(".png").stat().st_size > 1000


def test_throughput_quick_grid_and_skips(bench):
    tp = bench["throughput"]
    a = tp.parse_args(["--quick"])
    assert a.batches == [1, 16, 64] and a.prompts == [16, 1024] and a.new_tokens == 32
    assert a.max_minutes and a.budget_s <= 60 and "vllm" not in a.engines
    # a run predicted to exceed the budget is skipped, from the engine's own history
    assert tp.predict([(1, 16, 4, 0.1)], 64, 1024, 32) > tp.predict([(1, 16, 4, 0.1)], 1, 16, 32)
    with pytest.raises(SystemExit):
        tp.parse_args(["--engines", "vllm"])  # GPU only
    # a thread count 2x slower than another at the previous batch is pruned (quick mode)
    measured = {("llama-hf", 1, 16): {1: 1.0, 16: 2.0}, ("llama-hf", 2, 16): {1: 3.0, 16: 3.5}}
    assert tp.dominated(measured, "llama-hf", 2, 16, 64, 2.0) is None  # 3.5 / 2.0 < 2 at batch 16
    assert tp.dominated(measured, "llama-hf", 2, 16, 16, 2.0) is None  # batch 1 says nothing of 16
    assert tp.dominated(measured, "llama-hf", 2, 16, 4, 2.0)[:2] == (1, 1)  # 3x at batch 1
    measured[("llama-hf", 2, 16)][16] = 5.0
    assert tp.dominated(measured, "llama-hf", 2, 16, 64, 2.0)[:2] == (1, 16)
    assert tp.dominated(measured, "llama-hf", 1, 16, 64, 2.0) is None
    assert a.prune_threads == 2.0 and tp.parse_args([]).prune_threads == 0.0


def test_concurrency_smoke(bench, tiny_config, tmp_path, capsys):
    out = tmp_path / "conc"
    rc = bench["concurrency"].main([*tiny_args(tiny_config), "--budget-gib", "0.01", "--contexts", "48,96",
                                    "--out", str(out)])
    assert rc == 0
    res = json.loads(out.with_suffix(".json").read_text())
    by = {(r["model"], r["context"], r["variant"]): r for r in res["results"]}
    for T in (48, 96):
        srm, tf = by[("srm-max", T, "state")], by[("llama-hf", T, "state")]
        assert srm["batch"] > tf["batch"] > 0
        for r in (srm, tf, by[("srm-torch", T, "state")], by[("mamba-hf", T, "state")]):
            assert r["allocated_bytes"] <= res["budget_bytes"]
    # the SRM state does not grow with the context; the KV cache does
    assert by[("srm-max", 48, "state")]["batch"] == by[("srm-max", 96, "state")]["batch"]
    assert by[("llama-hf", 48, "state")]["batch"] > by[("llama-hf", 96, "state")]["batch"]
    c = tiny_config
    assert by[("srm-torch", 96, "state")]["state_bytes_per_sample"] == 4 * c.n_layers * c.d_model + 16
    assert "srm-max/llama-hf" in capsys.readouterr().out


def _has_gpu() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except Exception:  # noqa: BLE001
        pass
    from max.driver import accelerator_count

    return accelerator_count() > 0


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present: bench-h100 would run")
def test_h100_refuses_without_gpu():
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "bench.h100", "--quick"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no GPU found" in p.stderr


def test_h100_defaults_and_merge(bench):
    h, tp = bench["h100"], bench["throughput"]
    argv = h.gpu_defaults(["--quick", "--new-tokens", "8"])
    a = tp.parse_args(argv, gpu=True)
    assert (a.d_model, a.layers, a.heads, a.context, a.vocab) == (1024, 16, 4, 1024, 8000)
    assert a.dtype == "bfloat16" and "vllm" in a.engines and a.new_tokens == 8
    assert max(a.batches) >= 16384
    row = {"threads": "all", "batch": 64, "prompt_len": 16, "new_tokens": 8, "status": "ok",
           "seconds": 1.0, "prefill_seconds": 0.5, "tokens_per_s": 512.0}
    children = {
        "srm-max": {"runs": [{**row, "engine": "srm-max", "decode_tokens_per_s": 900.0}],
                    "engines": {"srm-max": {"parameters": 1}},
                    "roofline": {"roofline_tokens_per_s": 1000.0, "matmul": {}}},
        "llama-hf": {"runs": [{**row, "engine": "llama-hf", "tokens_per_s": 64.0, "decode_tokens_per_s": 90.0}],
                     "engines": {"llama-hf": {"parameters": 1}}},
        "vllm": {"error": "exit code 1"},
    }
    res = h.merge(a, children, 1.0)
    assert res["ratios_tokens_per_s"][0]["srm-max/llama-hf"] == pytest.approx(8.0)
    assert res["roofline"]["percent_of_roofline"] == pytest.approx(90.0)
    assert any(r["engine"] == "vllm" and r["status"] == "error" for r in res["runs"])
    assert "max/llama" in res["markdown"]


def test_pha_comparison_pieces(tmp_path):
    """bench/pha_comparison.py without its training runs: equal parameters, the Transformer's
    KV-cache decode against its forward, state bytes as the config implies, the sandwich check."""
    import torch

    pc = importlib.import_module("bench.pha_comparison")
    a = pc.parse_args(["--quick", "--out", str(tmp_path)])
    V = 300
    target = pc.srm_config(a, V).num_parameters()
    widths = {}
    for arch, branches in (("pha", ("gss", "attn", "ffn")), ("pha-attn", ("attn", "ffn"))):
        widths[arch] = pc.matched_ffn_width(a, V, branches, target)
        step_params = 2 * a.n_layers * (2 * a.d_model + 1) * 8  # one step of 8 in both FFN widths
        assert abs(pc.pha_config(a, V, branches, widths[arch]).num_parameters() - target) <= step_params / 2
    assert pc.check_transformer_step(a, V) < 1e-5

    n, B = 64, 2
    for kind in pc.DECODE_MODELS:
        step, state_bytes, params = pc.build_decoder(a, V, kind, n, B, widths)
        with torch.no_grad():
            assert step(torch.zeros(B, dtype=torch.long), n - 1).shape == (B, V)
        dh = a.d_model // a.n_heads
        kv = 2 * a.n_layers * n * dh * 4 * (a.n_heads if kind == "transformer" else a.n_kv_heads)
        gss = a.n_layers * (a.d_model // 4) * a.dss_state_size * 8 if kind == "pha" else 0
        assert state_bytes == kv + gss, kind

    mixing = {"branches": ["gss", "attn", "ffn_0", "ffn_1"],
              "weights": [[0.4, 0.2, 0.2, 0.2], [0.2, 0.4, 0.2, 0.2], [0.4, 0.1, 0.3, 0.2]]}
    check = pc.sandwich_check(mixing)
    assert check["matches_paper"] and check["largest_branch_per_layer"] == ["gss", "attn", "gss"]
    mixing["weights"][1] = [0.4, 0.2, 0.2, 0.2]
    assert not pc.sandwich_check(mixing)["matches_paper"]


def test_cpu_decode_limits_probe_and_fixed_step_cost():
    """bench/cpu_decode.py's measuring pieces on small sizes: the limits probe keeps the best
    rate seen since its reset; the fixed cost of a step is measured on the suite's tiny shape
    (the same compiled graphs as the engine tests)."""
    cd = importlib.import_module("bench.cpu_decode")
    probe = cd.LimitsProbe(1 << 20, n=256)
    probe.run()
    first = (probe.flops, probe.bytes_per_s)
    assert first[0] > 1e8 and first[1] > 1e8
    probe.run()
    assert probe.flops >= first[0] and probe.bytes_per_s >= first[1]
    probe.reset()
    assert probe.flops == 0 and probe.bytes_per_s == 0
    limits = probe.measure(runs=2)
    assert limits == {"matmul_flops": probe.flops, "read_bytes_per_s": probe.bytes_per_s}
    assert limits["matmul_flops"] > 1e8 and limits["read_bytes_per_s"] > 1e8
    fixed = cd.fixed_step_seconds([1, 3], steps=2, repeats=1)
    assert set(fixed) == {1, 3} and all(0 < s < 1 for s in fixed.values())


@pytest.mark.skipif(cpu_target.host_x86_level() not in ("x86-64-v3", "x86-64-v4"), reason="needs an AVX2 x86-64 CPU")
def test_cpu_decode_at_x86_64_v3_holds_torch_and_numpy_to_avx2(monkeypatch):
    """``--cpu-target x86-64-v3`` restarts bench/cpu_decode.py with MAX's target and
    AVX2_ONLY: in such a process torch and inductor report AVX2 and numpy's matmul still
    agrees; once the environment is in place the benchmark goes on without restarting."""
    cd = importlib.import_module("bench.cpu_decode")
    target_env = cd.cpu_target_environment("x86-64-v3")
    env = os.environ | target_env
    probe = ("import numpy as np, torch\nfrom torch._inductor import cpu_vec_isa\n"
             "a = np.arange(64, dtype=np.float32).reshape(8, 8)\n"
             "assert np.allclose(a @ a, torch.from_numpy(a) @ torch.from_numpy(a))\n"
             "print(torch.backends.cpu.get_cpu_capability(), cpu_vec_isa.pick_vec_isa())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["AVX2", "avx2"]
    for key, value in target_env.items():
        monkeypatch.setenv(key, value)
    cd._restart_for_cpu_target("x86-64-v3", ["--quick"])  # returns: nothing to change


def test_a_drivers_number_is_read_from_its_line_and_a_failed_driver_ends_the_run(tmp_path):
    """decode_op_ab.run_driver, which every Mojo driver's benchmark runs its driver through."""
    from bench import decode_op_ab

    def driver(name, output, status=0):
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\nprintf '{output}'\necho 'what went wrong' >&2\nexit {status}\n")
        path.chmod(0o755)
        return path

    ok = driver("decode_op", "noise\\nbatch 64 median_tok_s 8123.5 best_tok_s 9000.0\\n")
    assert decode_op_ab.run_driver(ok, [64, 5, 2, "float32"], "batch", "median_tok_s") == 8123.5
    gbps = driver("product_read_rate", "mode tile dtype bfloat16 phase_kib 2048 total_kib 12288 workers 2 "
                                       "bytes 2097152000 best_s 0.0135 gbps 155.3\\n")
    assert decode_op_ab.run_driver(gbps, ["tile"], "mode", "gbps") == 155.3
    with pytest.raises(ValueError, match="no 'batch ... median_tok_s' line"):
        decode_op_ab.run_driver(driver("crashed", "Segmentation fault\\n"), [], "batch", "median_tok_s")
    with pytest.raises(SystemExit, match="failed_driver failed \\(exit 3\\):\nwhat went wrong"):
        decode_op_ab.run_driver(driver("failed_driver", "", 3), [], "mode", "gbps")


def test_a_verdict_of_interleaved_rounds_is_their_ratios_median_and_the_rounds_above_1():
    from bench.common import rounds_verdict

    # a generator as the tools pass it; an even count's median is the middle two's mean
    assert rounds_verdict(r for r in (1.2, 0.8, 1.05, 1.0)) == {"median": pytest.approx(1.025), "above_1": 2,
                                                               "rounds": 4}
    with pytest.raises(ValueError, match="no rounds"):
        rounds_verdict([])


def test_decode_op_ab_summarizes_rounds():
    from bench import decode_op_ab

    s = decode_op_ab.summarize([(100.0, 110.0), (100.0, 90.0), (200.0, 240.0)])
    assert s["ratio_median"] == pytest.approx(1.1)
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(0.9), pytest.approx(1.2))
    assert (s["b_faster_rounds"], s["rounds"]) == (2, 3)
    assert (s["a_median_tok_s"], s["b_median_tok_s"]) == (100.0, 110.0)


def test_decode_op_ab_exports_the_op_package_at_a_revision(tmp_path):
    """The A side is mojo/ at a revision, as a package the driver imports by the name it uses
    (that the driver builds against it: test_bench_drivers.py); the JSON names the commit."""
    import subprocess

    from bench import decode_op_ab

    package = decode_op_ab.export_ops("HEAD", tmp_path) / decode_op_ab.PACKAGE
    assert (package / "__init__.mojo").is_file() and (package / "decode_step.mojo").is_file()
    assert f"from {decode_op_ab.PACKAGE}.decode_step import" in decode_op_ab.DRIVER.read_text()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert decode_op_ab.commit_of("HEAD") == head and len(head) == 40
    with pytest.raises(SystemExit, match="cannot read mojo/"):
        decode_op_ab.export_ops("no-such-revision", tmp_path / "x")


def test_op_in_engine_misaligns_by_sixteen_bytes():
    """--misalign hands MAX what numpy gives by itself: arrays 16 bytes past a cache line."""
    import numpy as np

    from bench.op_in_engine import misaligned
    from srm_max.runtime.device import CACHE_LINE

    a = np.arange(300, dtype=np.float32).reshape(3, 100)
    moved = misaligned(a)
    assert moved.ctypes.data % CACHE_LINE == 16 and moved.flags.c_contiguous
    np.testing.assert_array_equal(moved, a)


def test_prefix_cache_smoke(tiny_config, tmp_path, capsys):
    """Every workload of bench/prefix_cache.py on TINY shapes: with and without the cache the
    tokens agree (the bench asserts it), and the JSON holds each ratio and the machine."""
    from bench import prefix_cache

    out = tmp_path / "prefix_cache.json"
    c = tiny_config
    rc = prefix_cache.main([
        "--d-model", str(c.d_model), "--layers", str(c.n_layers), "--heads", str(c.n_heads),
        "--vocab", str(c.vocab_size), "--context", str(c.context_length), "--prefix", "60", "--suffix", "5",
        "--repeats", "2", "--docs", "6", "--shots", "40", "--doc-tokens", "5", "20", "--eval-batch", "3",
        "--eval-new", "2", "--turns", "3", "--system", "10", "--user", "5", "--reply", "4", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["machine"]["processor"] and res["model"]["d_model"] == c.d_model
    assert res["ttft"]["speedup_cached"] > 0 and len(res["ttft"]["seconds"]["cached"]) == 2
    assert res["fewshot"]["speedup_cached"] > 0 and res["chat"]["speedup_cached"] > 0
    assert res["split"]["cut"] is None  # TINY's prompts are shorter than a checkpoint interval
    assert res["memory"]["state_bytes"] == 4 * c.n_layers * c.d_model
    assert res["memory"]["budget_bytes_per_entry"] == 4 * c.n_layers * c.d_model + 4 * 60
    assert res["cache_stats"]["hits"] > 0 and res["cache_stats"]["tokens_saved"] > 0
    assert "time to first token" in capsys.readouterr().out


def test_the_benchmarks_srm_engines_hold_every_weight_their_graphs_bind():
    """Built, not compiled: the CPU engines bench/ times beside the default one (decode by
    the graph's loop of whole-step ops, or by the unfused decode graph) bind, in every graph
    they load, only weights their registry holds: the packed copies that the whole-step op
    and the prefill read are there whichever decode graph the engine takes."""
    from bench.common import build_srm_reference, loop_engine, srm_weights, unfused_engine
    from srm_max.models.srm.engine import Engine

    weights = srm_weights(build_srm_reference(TINY))
    for engine in (Engine(TINY, weights, kernels=True), loop_engine(TINY, weights), unfused_engine(TINY, weights)):
        for kind in ("prefill", *engine.graph_kinds()):
            missing = engine.graph_job(kind).weights() - set(engine.weights)
            assert not missing, f"{type(engine).__name__} {kind}: {sorted(missing)}"


def test_soak_checks_the_engine_without_changing_its_calls():
    """bench/soak.py's wrapper passes the scheduler's options (donated states, log-probabilities)
    through to the engine, and counts a non-finite state."""
    import types

    import numpy as np

    from bench.soak import CheckedEngine

    calls = []

    class Engine:
        def host(self, buffer):
            return buffer

        def prefill(self, prompts, sampling=None, **options):
            calls.append(("prefill", options))
            return types.SimpleNamespace(logits=np.zeros(2), states=np.zeros(2))

        def decode(self, ids, positions, states, sampling, steps=1, **options):
            calls.append(("decode", steps, options))
            return types.SimpleNamespace(states=np.array([np.nan]))

    checked = CheckedEngine(Engine(), check_every=1)
    checked.prefill([[1]], None, logprobs=2)
    checked.decode([1], [0], None, None, 4, donate_states=True, logprobs=None)
    assert calls == [("prefill", {"logprobs": 2}), ("decode", 4, {"donate_states": True, "logprobs": None})]
    assert checked.nonfinite == ["decode states after decode call 1"]
