"""The prefix-state cache against none, on one engine, in one run (docs/prefix_cache.md).

    python -m bench.prefix_cache [--quick] [--out bench/results/prefix_cache.json]

A random-weight SRM of the benchmarks' shape (d 256, 8 layers, 4 heads, vocab 4,096;
context 2,048 here so that a 2,000-token prefix fits) on the CPU, two Generators on the
same engine: one with the cache (the default 64 MiB), one with it off. Every workload
runs on both, paired (the one, then the other, repeat by repeat, so that the machine's
drift hits both alike), and the tokens of both must be equal (greedy):

    ttft       time to first token at batch 1 of a ``--prefix``-token shared prefix plus a
               ``--suffix``-token suffix (a new one per repeat), the prefix having been sent
               as a prompt before; and of a prompt never seen (with the cache, its prefill
               runs in two pieces to keep a checkpoint: what that costs, also measured on
               the engine alone)
    fewshot    an lm-eval-style run: ``--docs`` documents behind one ``--shots``-token
               few-shot prefix, ``--eval-batch`` prompts per generate call, a few new tokens
    chat       a ``--turns``-turn chat: each turn's prompt is the last prompt, the reply and
               a new user message
    memory     bytes per cached entry: the arrays the budget counts, and what Python holds
               (tracemalloc) for an entry of a ``--prefix``-token prompt

Writes the ratios, the times and the machine to bench/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np

from bench.common import RESULTS, build_srm_reference, command_line, machine_info, srm_config, srm_weights, \
    write_json


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=2000, help="shared prefix of the time-to-first-token test")
    ap.add_argument("--suffix", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--shots", type=int, default=1000, help="tokens of the few-shot prefix")
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=[40, 160], help="a document's length: low high")
    ap.add_argument("--eval-batch", type=int, default=8)
    ap.add_argument("--eval-new", type=int, default=4, help="tokens generated per document")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--system", type=int, default=200, help="tokens of the chat's system prompt")
    ap.add_argument("--user", type=int, default=30, help="tokens of each user message")
    ap.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and documents")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.docs, args.turns = 3, 48, 8
    return args


def tokens(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(1, vocab, n).tolist()


def timed(gen, prompts, max_new: int):
    t0 = time.perf_counter()
    out = gen.generate(prompts, max_new_tokens=max_new, steps_per_call=8)
    return time.perf_counter() - t0, out


def ttft(gens: dict, args, rng, vocab: int) -> dict:
    """Batch 1: the shared prefix (sent once before) plus a new suffix per repeat; and new prompts."""
    prefix = tokens(rng, args.prefix, vocab)
    for g in gens.values():
        g.generate(prefix, max_new_tokens=1)  # the earlier request whose prefix the next ones share
    times = {"cached": [], "off": [], "new_cached": [], "new_off": []}
    for _ in range(args.repeats):
        prompt = prefix + tokens(rng, args.suffix, vocab)
        fresh = tokens(rng, args.prefix + args.suffix, vocab)
        firsts = {}
        for name, g in gens.items():
            seconds, out = timed(g, prompt, 1)
            times["cached" if name == "cache" else "off"].append(seconds)
            firsts[name] = out.ids
            seconds, out = timed(g, fresh, 1)
            times["new_cached" if name == "cache" else "new_off"].append(seconds)
            firsts[name + " new"] = out.ids
        assert firsts["cache"] == firsts["off"] and firsts["cache new"] == firsts["off new"], firsts
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    # medians, and the best of each (what a quiet moment of a shared machine allows)
    return {"prefix_tokens": args.prefix, "suffix_tokens": args.suffix, "batch": 1, "repeats": args.repeats,
            "median_seconds": med, "best_seconds": best, "seconds": times,
            "speedup_cached": med["off"] / med["cached"], "speedup_cached_best": best["off"] / best["cached"],
            "new_prompt_cost_with_cache": med["new_cached"] / med["new_off"],
            "new_prompt_cost_with_cache_best": best["new_cached"] / best["new_off"]}


def split_cost(engine, args, rng, vocab: int) -> dict:
    """The engine alone: a new prompt prefilled in one call against the two pieces the cache
    runs to keep its checkpoint (up to the last multiple of 256, then the rest from there),
    alternated; the median of the paired ratios resists the machine's drift."""
    from srm_max.serve.prefix_cache import DEFAULT_INTERVAL

    n = args.prefix + args.suffix
    cut = (n - 1) // DEFAULT_INTERVAL * DEFAULT_INTERVAL
    if cut == 0:
        return {"prompt_tokens": n, "cut": None, "cost_paired_median": None}  # no checkpoint inside it
    whole, split = [], []
    for _ in range(args.repeats):
        p = tokens(rng, n, vocab)
        t0 = time.perf_counter()
        engine.prefill([p])
        t1 = time.perf_counter()
        head = engine.prefill([p[:cut]])
        engine.prefill([p[cut:]], start_states=head.states, start_positions=[cut])
        t2 = time.perf_counter()
        whole.append(t1 - t0)
        split.append(t2 - t1)
    return {"prompt_tokens": n, "cut": cut, "seconds_whole": whole, "seconds_split": split,
            "cost_paired_median": statistics.median(b / a for a, b in zip(whole, split))}


def fewshot(gens: dict, args, rng, vocab: int) -> dict:
    shots = tokens(rng, args.shots, vocab)
    lo, hi = args.doc_tokens
    docs = [shots + tokens(rng, int(rng.integers(lo, hi + 1)), vocab) for _ in range(args.docs)]
    out, seconds = {}, {}
    for name, g in gens.items():
        total, ids = 0.0, []
        for i in range(0, len(docs), args.eval_batch):
            s, res = timed(g, docs[i:i + args.eval_batch], args.eval_new)
            total += s
            ids += [r.ids for r in res]
        seconds[name], out[name] = total, ids
    assert out["cache"] == out["off"]
    return {"documents": args.docs, "few_shot_tokens": args.shots, "document_tokens": args.doc_tokens,
            "batch": args.eval_batch, "new_tokens": args.eval_new, "seconds": seconds,
            "documents_per_s": {k: args.docs / v for k, v in seconds.items()},
            "speedup_cached": seconds["off"] / seconds["cache"]}


def chat(gens: dict, args, rng, vocab: int) -> dict:
    system = tokens(rng, args.system, vocab)
    users = [tokens(rng, args.user, vocab) for _ in range(args.turns)]
    turns, replies = {}, {}
    for name, g in gens.items():
        prompt, per_turn, said = list(system), [], []
        for u in users:
            prompt = prompt + u
            s, res = timed(g, prompt, args.reply)
            per_turn.append(s)
            said.append(res.ids)
            prompt = prompt + res.ids
        turns[name], replies[name] = per_turn, said
    assert replies["cache"] == replies["off"]
    total = {k: sum(v) for k, v in turns.items()}
    return {"turns": args.turns, "system_tokens": args.system, "user_tokens": args.user, "reply_tokens": args.reply,
            "final_prompt_tokens": args.system + args.turns * args.user + sum(len(r) for r in replies["cache"][:-1]),
            "seconds_per_turn": turns, "seconds": total, "speedup_cached": total["off"] / total["cache"],
            "last_turn_speedup": turns["off"][-1] / turns["cache"][-1]}


def memory(engine, args, rng, vocab: int) -> dict:
    """An entry's bytes: what the budget counts (state + tokens) and what Python holds for it."""
    from srm_max.serve.prefix_cache import PrefixCache

    c = engine.config
    state = np.zeros((c.n_layers, c.n_heads, c.head_dim), np.float32)
    cache, n = PrefixCache(1 << 40), 200
    prompts = [tokens(rng, args.prefix, vocab) for _ in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for p in prompts:
        cache.insert(p, state)
    held = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    return {"state_bytes": state.nbytes, "prompt_tokens": args.prefix, "budget_bytes_per_entry": cache.bytes / n,
            "python_bytes_per_entry": held,
            "entries_in_64_mib": (64 << 20) // (cache.bytes // n)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from srm_max.models.srm.engine import Engine
    from srm_max.runtime.cpu_target import current
    from srm_max.serve.generator import Generator

    config = srm_config(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                        context_length=args.context, vocab_size=args.vocab)
    engine = Engine(config, srm_weights(build_srm_reference(config)))
    if not getattr(engine, "supports_start_state", False):
        raise SystemExit("this engine cannot prefill from a state: the prefix cache is off for it")
    gens = {"cache": Generator.from_engine(engine), "off": Generator.from_engine(engine, prefix_cache_mb=0)}
    rng = np.random.default_rng(0)
    gens["off"].generate([tokens(rng, 40, config.vocab_size)] * 2, max_new_tokens=2)  # load the graphs
    result = {"command": command_line(), "machine": machine_info(), "cpu_target": current(),
              "model": {"d_model": config.d_model, "n_layers": config.n_layers, "n_heads": config.n_heads,
                        "context_length": config.context_length, "vocab_size": config.vocab_size,
                        "weights": "float32, random"},
              "cache_mb": gens["cache"].prefix_cache.budget_bytes / (1 << 20)}
    V = config.vocab_size
    result["ttft"] = r = ttft(gens, args, rng, V)
    print(f"time to first token, {args.prefix} + {args.suffix} tokens at batch 1 (median; best): "
          f"{1e3 * r['median_seconds']['off']:.1f} ms -> {1e3 * r['median_seconds']['cached']:.1f} ms cached "
          f"({r['speedup_cached']:.1f}x; best {r['speedup_cached_best']:.1f}x); a new prompt with the cache on "
          f"costs {r['new_prompt_cost_with_cache']:.2f}x (best {r['new_prompt_cost_with_cache_best']:.2f}x)")
    result["split"] = r = split_cost(engine, args, rng, V)
    if r["cut"]:
        print(f"a new {r['prompt_tokens']}-token prompt prefilled as [0, {r['cut']}) then the rest, against one "
              f"call: {r['cost_paired_median']:.2f}x (median of paired runs)")
    result["fewshot"] = r = fewshot(gens, args, rng, V)
    print(f"few-shot run, {args.docs} documents behind {args.shots} tokens: {r['seconds']['off']:.2f} s -> "
          f"{r['seconds']['cache']:.2f} s ({r['speedup_cached']:.1f}x)")
    result["chat"] = r = chat(gens, args, rng, V)
    print(f"{args.turns}-turn chat: {r['seconds']['off']:.2f} s -> {r['seconds']['cache']:.2f} s "
          f"({r['speedup_cached']:.1f}x; last turn {r['last_turn_speedup']:.1f}x)")
    result["memory"] = r = memory(engine, args, rng, V)
    print(f"an entry of a {args.prefix}-token prompt: {r['budget_bytes_per_entry']:.0f} bytes counted "
          f"({r['state_bytes']} of state), {r['python_bytes_per_entry']:.0f} held by Python")
    stats = gens["cache"].prefix_cache.stats
    result["cache_stats"] = {**stats.__dict__, "entries": len(gens["cache"].prefix_cache),
                             "bytes": gens["cache"].prefix_cache.bytes}
    result["load_average_at_end"] = list(os.getloadavg())
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
