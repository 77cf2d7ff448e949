"""Scoring speed: the engine's score path against its prefill, against a same-size Hugging
Face Llama computing the same per-token log-probabilities, and sampled decode with
``logprobs=5`` against without, in one run.

    python -m bench.scoring [--batches 1 16 64] [--length 1000] [--repeats 3] [--score-only]
                            [--decode-batch 16] [--decode-prompt 32] [--decode-new 64]
                            [--lm-eval-docs 100] [--lm-eval-hf-batch 32]
    python -m bench.scoring --decode-only [--decode-batch 16] ... [--out FILE]

The SRM of the benchmark size (d 256, 8 layers, 4 heads, n 1024, vocab 4096; random
weights) on MAX, float32, on this machine's CPU; the Llama has its vocabulary, width,
depth and heads and as many parameters (``common.llama_config_matching``), in PyTorch
with all the CPU's threads. Per batch of ``--length``-token texts (best of
``--repeats``, the rows interleaved in every repeat):

    prefill          ``engine.prefill``: the parallel form, logits at the last position only
    score            ``engine.score(top_n=5)``: the same layers, the output layer and the
                     log-softmax at every position, the target's log-probability and the
                     top 20 (on a CPU the Mojo row op, mojo/score_rows.mojo); the host
                     keeps 5
    hf               ``LlamaForCausalLM`` forward, full logits, log_softmax, the targets'
                     gather and the top 5 (``torch.no_grad``)

and score's FLOP/s (2 x the matmul parameters per token: the forward with the output layer
at every position) against the CPU's measured FMA peak (bench/fma_peak.py: all cores on
register-only FMAs) and a large numpy matmul's; and, since the machine may be shared, the
same from CPU time (score's FLOPs per CPU-second of the process over one core's peak, and
score / prefill as the ratio of their CPU seconds). ``--score-only`` stops there.
Then ``Generator.generate`` of ``--decode-batch`` prompts, sampled (temperature 0.8,
top-p 0.95), with ``logprobs=5`` and without, alternating, tokens/s of each (median of
``--repeats``) and their ratio, and ``engine.decode`` alone (one call of ``--decode-new``
steps) without log-probabilities, with the chosen tokens' only and with 5 alternatives; ``Generator.loglikelihood`` on a multiple-choice-like
set (each context with 4 continuations), requests/s; and one GRPO update
(``rl.grpo.grpo_step``, one epoch, ``--grpo-batch`` rollouts) with the old and reference
log-probabilities from PyTorch and from the engines' scoring path, alternating. Last,
with lm-eval installed and the vocabulary of the embedded model's tokenizer (4,096),
lm-eval's ``simple_evaluate`` of a local multiple-choice task (``--lm-eval-docs``
questions of ``--context-tokens`` random tokens as text, 4 answers each) with the native
``srm-max`` model and with lm-eval's ``hf`` model on the same-size Llama (batch
``--lm-eval-hf-batch``), alternating: requests/s over the whole evaluation and over the
models' loglikelihood calls.

Writes bench/results/scoring.json (``--out``), naming the machine and its CPU.
``--decode-only`` runs the decode rows alone (no Llama) and prints them; it writes only to
an ``--out`` given, never over the complete run's file.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench.common import (RESULTS, build_llama, build_srm_reference, command_line, fixed_prompts, machine_info,
                          markdown_table, matmul_flops, num_params, quiet_transformers, set_torch_threads,
                          srm_config, srm_matmul_params, srm_weights, write_json)
from bench.fma_peak import fma_peak

TOP_N = 5


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timed_with_cpu(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process's threads) of one call."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def hf_scorer(model, ids: np.ndarray):
    """The HF model's per-token log-probabilities of ``ids[:, 1:]`` after ``ids[:, :-1]`` and the top 5."""
    import torch

    x = torch.from_numpy(ids)

    def run():
        with torch.no_grad():
            logp = torch.log_softmax(model(x[:, :-1]).logits.float(), -1)
            picked = logp.gather(-1, x[:, 1:, None])[..., 0]
            top = torch.topk(logp, TOP_N, dim=-1)
        return picked, top

    return run


def bench_batches(engine, llama, config, batches, length, repeats) -> list[dict]:
    rows = []
    for B in batches:
        ids = fixed_prompts(B, length + 1, config.vocab_size)
        inputs, targets = ids[:, :-1].tolist(), ids[:, 1:].tolist()
        runs = {
            "prefill": lambda: engine.prefill(inputs),
            "score": lambda: engine.score(inputs, targets, top_n=TOP_N),
            "hf": hf_scorer(llama, ids),
        }
        for fn in runs.values():  # warm up: graphs loaded, thread pools up
            fn()
        seconds = {name: [] for name in runs}
        cpu = {name: [] for name in runs}
        for _ in range(repeats):
            for name, fn in runs.items():
                wall, used = timed_with_cpu(fn)
                seconds[name].append(wall)
                cpu[name].append(used)
        tps = {name: B * length / min(s) for name, s in seconds.items()}
        flop = 2.0 * srm_matmul_params(config) * B * length  # the forward, the output layer at every position
        rows.append({"batch": B, "length": length, "seconds": seconds, "cpu_seconds": cpu, "tokens_per_s": tps,
                     "score_over_prefill": tps["score"] / tps["prefill"], "score_over_hf": tps["score"] / tps["hf"],
                     "score_over_prefill_cpu": min(cpu["prefill"]) / min(cpu["score"]),
                     "score_flops": flop * tps["score"] / (B * length),
                     "score_flops_per_cpu_second": flop / min(cpu["score"])})
    return rows


def add_peak_fractions(rows: list[dict], fma: dict, numpy_matmul: dict):
    """Score's FLOP/s over the measured FMA peak of all cores (wall clock), its FLOPs per
    CPU-second over one core's peak (what the cores gave while it had them: on a shared
    machine the wall clock also counts the other jobs' turns), and over a numpy matmul's."""
    for r in rows:
        r["score_flops_over_fma_peak"] = r["score_flops"] / fma["flops"]
        r["score_cpu_flops_over_core_peak"] = r["score_flops_per_cpu_second"] / fma["flops_per_core"]
        r["score_flops_over_numpy_matmul"] = r["score_flops"] / numpy_matmul["flops"]


def print_batches(rows: list[dict]):
    print(markdown_table(
        ["batch x tokens", "prefill tok/s", "score tok/s", "HF Llama tok/s", "score / prefill",
         "score / prefill (CPU time)", "score / HF", "score / FMA peak", "score per CPU-s / core peak"],
        [[f"{r['batch']} x {r['length']}", f"{r['tokens_per_s']['prefill']:,.0f}",
          f"{r['tokens_per_s']['score']:,.0f}", f"{r['tokens_per_s']['hf']:,.0f}", f"{r['score_over_prefill']:.2f}",
          f"{r['score_over_prefill_cpu']:.2f}", f"{r['score_over_hf']:.2f}", f"{r['score_flops_over_fma_peak']:.2f}",
          f"{r['score_cpu_flops_over_core_peak']:.2f}"] for r in rows]))


def bench_decode(gen, batch, prompt_len, new, repeats) -> dict:
    prompts = fixed_prompts(batch, prompt_len, gen.config.vocab_size, seed=99).tolist()
    options = dict(max_new_tokens=new, temperature=0.8, top_p=0.95, seed=5)
    gen.generate(prompts, logprobs=TOP_N, **options)  # warm up
    seconds = {"without": [], "logprobs": []}
    tokens = {}
    for _ in range(repeats):
        for name, lp in (("without", None), ("logprobs", TOP_N)):
            t = time.perf_counter()
            outs = gen.generate(prompts, logprobs=lp, **options)
            seconds[name].append(time.perf_counter() - t)
            tokens[name] = sum(len(c.ids) for c in outs)
    assert tokens["without"] == tokens["logprobs"], "the same seeds must give the same tokens"
    tps = {name: tokens[name] / statistics.median(s) for name, s in seconds.items()}
    # the ratio within each round (calls seconds apart), then the median: robust to a shared machine's drift
    per_round = [w / lp for w, lp in zip(seconds["without"], seconds["logprobs"])]
    return {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new, "sampling": "temperature 0.8, top-p 0.95",
            "tokens": tokens["without"], "seconds": seconds, "tokens_per_s": tps,
            "logprobs_over_without": statistics.median(per_round)}


def bench_decode_op(engine, batch, prompt_len, new, repeats) -> dict:
    """``engine.decode`` alone: ``new`` sampled steps in one call from the same prefilled
    state, without log-probabilities, with the chosen tokens' only (``logprobs=0``) and with
    ``TOP_N`` alternatives, alternating; the median seconds and each over without."""
    from srm_max.runtime.call_types import SamplingArrays

    prompts = fixed_prompts(batch, prompt_len, engine.config.vocab_size, seed=98).tolist()
    s = SamplingArrays(np.full(batch, 0.8, np.float32), np.zeros(batch, np.int64), np.full(batch, 0.95, np.float32),
                       np.arange(batch, dtype=np.uint64))
    pre = engine.prefill(prompts, s)
    lengths = [prompt_len] * batch
    variants = {"without": None, "chosen_only": 0, f"top_{TOP_N}": TOP_N}
    seconds = {name: [] for name in variants}
    for _ in range(repeats + 1):  # the first round warms up
        for name, lp in variants.items():
            t = time.perf_counter()
            engine.decode(pre.next_ids, lengths, pre.states, s, new, logprobs=lp)
            seconds[name].append(time.perf_counter() - t)
    median = {name: statistics.median(v[1:]) for name, v in seconds.items()}
    return {"batch": batch, "steps": new, "median_seconds": median,
            "over_without": {name: median["without"] / m for name, m in median.items()}}


def bench_loglikelihood(gen, contexts, context_len, repeats) -> dict:
    rng = np.random.default_rng(7)
    V = gen.config.vocab_size
    requests = [(rng.integers(1, V, context_len).tolist(), rng.integers(1, V, int(rng.integers(1, 8))).tolist())
                for _ in range(contexts)]
    requests = [(ctx, rng.integers(1, V, len(cont)).tolist()) for ctx, cont in requests for _ in range(4)]
    gen.loglikelihood(requests[:8])  # warm up
    seconds = [timed(lambda: gen.loglikelihood(requests)) for _ in range(repeats)]
    return {"requests": len(requests), "contexts": contexts, "context_tokens": context_len,
            "continuations_per_context": 4, "seconds": seconds, "requests_per_s": len(requests) / min(seconds)}


def bench_grpo(config, engine, batch, prompt_len, new, repeats) -> dict:
    import copy

    import torch

    from srm_max.rl.grpo import grpo_step

    policy = build_srm_reference(config).eval()
    reference = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    prompts = fixed_prompts(batch, prompt_len, config.vocab_size, seed=5).tolist()
    completions = fixed_prompts(batch, new, config.vocab_size, seed=6).tolist()
    advantages = np.linspace(-1, 1, batch)
    ways = {"torch": None, "engine": (engine, engine)}  # the timing does not depend on the weights
    seconds = {name: [] for name in ways}
    for _ in range(repeats + 1):  # the first round warms up
        for name, engines in ways.items():
            seconds[name].append(timed(lambda: grpo_step(policy, reference, optimizer, prompts, completions,
                                                         advantages, epochs=1, engines=engines)))
    seconds = {name: s[1:] for name, s in seconds.items()}
    return {"rollouts": batch, "prompt_tokens": prompt_len, "completion_tokens": new, "epochs": 1,
            "seconds": seconds, "best_seconds": {name: min(s) for name, s in seconds.items()},
            "torch_over_engine": min(seconds["torch"]) / min(seconds["engine"])}


def write_choice_task(folder: Path, gen, docs: int, context_tokens: int) -> tuple[str, int]:
    """A local lm-eval multiple-choice task (CSV data, YAML config) of ``docs`` questions of
    ``context_tokens`` random tokens as text, 4 answers of 1-7 tokens each -> (its name,
    its loglikelihood requests)."""
    import csv
    import json

    rng = np.random.default_rng(11)
    V = gen.config.vocab_size
    text = lambda n: gen.decode(rng.integers(1, V, n).tolist())  # noqa: E731
    rows = [{"context": text(context_tokens), **{f"c{i}": " " + text(int(rng.integers(1, 8))) for i in range(4)},
             "answer": int(rng.integers(0, 4))} for _ in range(docs)]
    with open(folder / "bench_choice.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    config = {"task": "bench_choice", "dataset_path": "csv", "test_split": "test",
              "dataset_kwargs": {"data_files": {"test": str(folder / "bench_choice.csv")}},
              "output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{[c0, c1, c2, c3]}}",
              "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}
    (folder / "bench_choice.yaml").write_text(json.dumps(config))  # JSON is YAML
    return "bench_choice", 4 * docs


def bench_lm_eval(gen, llama, tokenizer_file: Path, docs, context_tokens, hf_batch, repeats) -> dict:
    """lm-eval's ``simple_evaluate`` of one local multiple-choice task with the native srm-max
    model and with lm-eval's ``hf`` model of the same-size Llama, alternating: requests/s over
    the whole evaluation and over the models' ``loglikelihood`` calls alone."""
    import tempfile

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedTokenizerFast

    from srm_max.lm_eval_model import SRMMaxLM

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>")
    models = {"srm-max": SRMMaxLM(generator=gen),
              "hf": HFLM(pretrained=llama, tokenizer=hf_tok, batch_size=hf_batch, max_length=gen.config.context_length,
                         device="cpu")}
    spent = {name: [] for name in models}
    for name, lm in models.items():  # the loglikelihood calls timed inside the evaluation
        def timed_loglikelihood(requests, *args, _call=lm.loglikelihood, _name=name, **kwargs):
            t = time.perf_counter()
            out = _call(requests, *args, **kwargs)
            spent[_name].append(time.perf_counter() - t)
            return out
        lm.loglikelihood = timed_loglikelihood
    with tempfile.TemporaryDirectory() as folder:
        task, n = write_choice_task(Path(folder), gen, docs, context_tokens)
        manager = TaskManager(include_path=folder, include_defaults=False)
        evaluate = lambda lm: lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager,  # noqa: E731
                                                      bootstrap_iters=0, random_seed=0)
        seconds = {name: [] for name in models}
        accuracy = {}
        for r in range(repeats + 1):  # the first round warms up
            for name, lm in models.items():
                spent[name].clear()
                t = time.perf_counter()
                accuracy[name] = evaluate(lm)["results"][task]["acc,none"]
                if r:
                    seconds[name].append((time.perf_counter() - t, sum(spent[name])))
    rps = {name: {"evaluation": n / min(s[0] for s in runs), "loglikelihood": n / min(s[1] for s in runs)}
           for name, runs in seconds.items()}
    return {"task": "multiple choice, 4 answers", "docs": docs, "requests": n, "context_tokens": context_tokens,
            "hf_batch_size": hf_batch, "seconds": seconds, "requests_per_s": rps, "accuracy": accuracy,
            "srm_over_hf": {k: rps["srm-max"][k] / rps["hf"][k] for k in ("evaluation", "loglikelihood")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-prompt", type=int, default=32)
    ap.add_argument("--decode-new", type=int, default=64)
    ap.add_argument("--contexts", type=int, default=64, help="loglikelihood: contexts of 4 continuations each")
    ap.add_argument("--context-tokens", type=int, default=200)
    ap.add_argument("--grpo-batch", type=int, default=64, help="GRPO: rollouts per update")
    ap.add_argument("--lm-eval-docs", type=int, default=100, help="lm-eval: questions of 4 answers (0: skip)")
    ap.add_argument("--lm-eval-hf-batch", type=int, default=32, help="lm-eval: the hf model's batch size")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="PyTorch threads for the Llama")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/scoring.json (a whole run; "
                    "with --decode-only or --score-only only a file given)")
    ap.add_argument("--decode-only", action="store_true", help="only sampled decode with logprobs against without")
    ap.add_argument("--score-only", action="store_true",
                    help="only prefill, score and the Llama per batch, and the peaks; writes only to --out")
    args = ap.parse_args(argv)

    from srm_max.checkpoints.format import TOKENIZER_FILE
    from srm_max.embedded import EMBEDDED_MODEL_DIR
    from srm_max.models.srm.engine import Engine
    from srm_max.runtime.cpu_target import current
    from srm_max.serve.generator import Generator

    machine = machine_info()  # before the run: its load average is the other jobs'
    quiet_transformers()
    set_torch_threads(args.threads)
    config = srm_config(args.d_model, args.layers, args.heads, args.context, args.vocab)
    engine = Engine(config, srm_weights(build_srm_reference(config)), dtype="float32", device="cpu")
    if args.score_only:  # the one graph it runs (prefill and score)
        engine.model("prefill")
    elif not args.decode_only:  # the decode rows load their few graphs at their warm-up call
        engine.warmup()
    tokenizer_file = EMBEDDED_MODEL_DIR / TOKENIZER_FILE  # a vocabulary of 4,096
    gen = Generator.from_engine(engine, tokenizer=tokenizer_file if config.vocab_size == 4096 else None)
    if args.decode_only:
        return decode_only(args, machine, config, gen)
    llama = build_llama(config)
    rows = bench_batches(engine, llama, config, args.batches, args.length, args.repeats)
    if args.score_only:
        add_peak_fractions(rows, fma_peak(), matmul_flops())
        print_batches(rows)
        print(f"machine: {machine['processor']}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
              f"at the end ({machine['load_average_at_start'][0]:.2f} at the start)")
        if args.out is not None:
            write_json(args.out, {"command": command_line(), "machine": machine, "cpu_target": current(),
                                  "batches": rows})
        return 0
    decode = bench_decode(gen, args.decode_batch, args.decode_prompt, args.decode_new, args.repeats)
    decode["op"] = bench_decode_op(engine, args.decode_batch, args.decode_prompt, args.decode_new, args.repeats)
    loglik = bench_loglikelihood(gen, args.contexts, min(args.context_tokens, config.context_length - 8),
                                 args.repeats)
    grpo = bench_grpo(config, engine, args.grpo_batch, args.decode_prompt, args.decode_new, args.repeats)
    lm_eval_row = None
    if args.lm_eval_docs and gen.tokenizer is not None and importlib.util.find_spec("lm_eval") is not None:
        lm_eval_row = bench_lm_eval(gen, llama, tokenizer_file, args.lm_eval_docs,
                                    min(args.context_tokens, config.context_length - 8), args.lm_eval_hf_batch,
                                    args.repeats)
    fma, peak = fma_peak(), matmul_flops()
    add_peak_fractions(rows, fma, peak)
    write_json(args.out or RESULTS / "scoring.json", {
        "command": command_line(), "machine": machine, "cpu_target": current(),
        "load_average_at_end": list(os.getloadavg()),
        "model": {"d_model": config.d_model, "layers": config.n_layers, "heads": config.n_heads,
                  "vocab": config.vocab_size, "context": config.context_length,
                  "srm_parameters": config.num_parameters(), "llama_parameters": num_params(llama)},
        "torch_threads": args.threads, "fma_peak": fma, "numpy_matmul": peak, "batches": rows, "decode": decode,
        "loglikelihood": loglik, "grpo": grpo, "lm_eval": lm_eval_row})
    print_batches(rows)
    print_decode(decode)
    print(f"loglikelihood: {loglik['requests']} requests, {loglik['requests_per_s']:,.1f} requests/s")
    print(f"GRPO update of {grpo['rollouts']} rollouts: {grpo['best_seconds']['torch']:.2f} s with PyTorch's old and "
          f"reference log-probabilities, {grpo['best_seconds']['engine']:.2f} s with the engine's")
    if lm_eval_row:
        rps = lm_eval_row["requests_per_s"]
        print(f"lm-eval, {lm_eval_row['requests']} loglikelihood requests: srm-max {rps['srm-max']['evaluation']:,.1f} "
              f"requests/s ({rps['srm-max']['loglikelihood']:,.1f} in its loglikelihood calls), hf "
              f"{rps['hf']['evaluation']:,.1f} ({rps['hf']['loglikelihood']:,.1f})")
    print(f"machine: {machine['processor']}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end; "
          f"wrote {args.out or RESULTS / 'scoring.json'}")
    return 0


def print_decode(decode: dict) -> None:
    print(f"\nsampled decode, batch {decode['batch']}: {decode['tokens_per_s']['without']:,.0f} tok/s without, "
          f"{decode['tokens_per_s']['logprobs']:,.0f} with logprobs={TOP_N}: "
          f"{decode['logprobs_over_without']:.2f}x")
    op = decode["op"]
    if "over_without" in op:
        print(f"engine.decode alone, {op['steps']} steps: " + ", ".join(
            f"{name} {1e3 * t:,.1f} ms ({op['over_without'][name]:.2f}x)" for name, t in op["median_seconds"].items()))


def decode_only(args, machine: dict, config, gen) -> int:
    """``--decode-only``: the decode rows alone, printed (and written to an ``--out`` given)."""
    decode = bench_decode(gen, args.decode_batch, args.decode_prompt, args.decode_new, args.repeats)
    decode["op"] = bench_decode_op(gen.engine, args.decode_batch, args.decode_prompt, args.decode_new, args.repeats)
    print_decode(decode)
    load_at_end = os.getloadavg()
    print(f"machine: {machine['processor']}, {os.cpu_count()} CPUs; load average {machine.get('load_average_at_start')}"
          f" at the start, {load_at_end[0]:.2f} {load_at_end[1]:.2f} {load_at_end[2]:.2f} at the end")
    if args.out is not None:
        write_json(args.out, {"command": command_line(), "machine": machine, "model": {
            "d_model": config.d_model, "layers": config.n_layers, "heads": config.n_heads, "vocab": config.vocab_size,
            "context": config.context_length}, "decode": decode, "load_average_at_end": list(load_at_end)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
