"""Massive sampling on the engine: the refilled slot pool against pure decode and fixed batches.

    python -m bench.sampling [--quick] [--models bench embedded] [--prompts 256] [--n 64]
                             [--slots 256] [--mean-length 64] [--max-new 256]

For each model (``bench``: the SRM of bench/cpu_decode.py, d 256, 8 layers, n 1024,
vocab 4096, random weights; ``embedded``: the package's embedded model), ``--prompts``
random prompts (8-32 tokens) x ``--n`` samples at temperature 1, measured side by side
in one run:

    pool         ``sample_many`` with ``--slots`` slots, each refilled the moment its
                 sample finishes (the samples of one prompt share its prefill)
    fixed        ``Generator.generate`` on consecutive batches of ``--slots`` samples,
                 each batch running until its longest sample ends (finished rows are
                 compacted away, but no new sample joins)
    pure decode  the engine's decode call alone on a full pool of ``--slots`` samples at
                 the same sampling parameters, no prefill, no refill: the speed the pool
                 would have if starting samples cost nothing

Completion lengths: a set of stop tokens is chosen so that a sample stops at a random
step with probability 1 / ``--mean-length`` (the tokens' frequencies measured in the
pure-decode run), capped at ``--max-new``: a wide, geometric spread of lengths. The
pool and the fixed batches produce the same samples (same seeds, checked); tokens are
generated tokens (the stop token included: it was decoded too). Writes
bench/results/sampling.json and sampling.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.common import build_srm_reference, machine_info, command_line, srm_config, srm_weights, write_json
from srm_max.runtime.call_types import SamplingArrays
from srm_max.serve.generator import Generator
from srm_max.serve.sample_many import sample_many, sample_seed
from srm_max.serve.scheduler import PoolStats

ROOT = Path(__file__).resolve().parents[1]
SEED = 5


def generator_for(name: str) -> Generator:
    if name == "embedded":
        return Generator.from_pretrained(device="cpu")
    config = srm_config()
    return Generator(config, srm_weights(build_srm_reference(config)))


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(8, 33))).tolist() for _ in range(count)]


def pure_decode(gen: Generator, prompts: list[list[int]], slots: int, steps: int, calls: int) -> tuple[float, np.ndarray]:
    """tokens/s of the decode call alone on ``slots`` samples (temperature 1), and the
    tokens it drew [slots, steps * calls]."""
    eng = gen.engine
    batch = [prompts[i % len(prompts)] for i in range(slots)]
    sampling = SamplingArrays(np.ones(slots, np.float32), np.zeros(slots, np.int64), np.ones(slots, np.float32),
                              np.arange(slots, dtype=np.uint64) + 1)
    pre = eng.prefill(batch, sampling)
    ids, positions, states = pre.next_ids, np.array([len(p) for p in batch], np.int64), pre.states
    buffers = eng.sampling_buffers(sampling)
    res = eng.decode(ids, positions, states, buffers, steps)  # warm
    t = time.perf_counter()
    drawn = []
    for _ in range(calls):
        res = eng.decode(res.ids, res.positions, res.states, buffers, steps)
        drawn.append(res.tokens)
    seconds = time.perf_counter() - t
    return slots * steps * calls / seconds, np.concatenate(drawn, axis=1)


def stop_tokens(drawn: np.ndarray, vocab: int, mean_length: float, seed: int = 0) -> list[int]:
    """Tokens whose summed frequency in ``drawn`` is about 1 / ``mean_length``."""
    freq = np.bincount(drawn.ravel(), minlength=vocab) / drawn.size
    target = 1.0 / mean_length
    chosen, total = [], 0.0
    for t in np.random.default_rng(seed).permutation(vocab):
        if 0 < freq[t] and total + freq[t] <= 1.1 * target:
            chosen.append(int(t))
            total += freq[t]
        if total >= 0.9 * target:
            break
    return sorted(chosen)


def run_pool(gen, prompts, n, slots, kw) -> tuple[dict, float, PoolStats]:
    stats = PoolStats()
    t = time.perf_counter()
    out = {(s.prompt_index, s.sample_index): (s.ids, s.finish_reason)
           for s in sample_many(gen, prompts, n, max_batch=slots, seed=SEED, stats=stats, **kw)}
    return out, time.perf_counter() - t, stats


def run_fixed(gen, prompts, n, slots, kw) -> tuple[dict, float]:
    jobs = [(p, s) for p in range(len(prompts)) for s in range(n)]
    out = {}
    t = time.perf_counter()
    for i in range(0, len(jobs), slots):
        chunk = jobs[i: i + slots]
        res = gen.generate([prompts[p] for p, _ in chunk], seed=[sample_seed(SEED, p, s) for p, s in chunk], **kw)
        out.update({job: (r.ids, r.finish_reason) for job, r in zip(chunk, res)})
    return out, time.perf_counter() - t


def measure(name: str, args) -> dict:
    t = time.perf_counter()
    gen = generator_for(name)
    gen.engine.warmup()
    build = time.perf_counter() - t
    vocab = gen.config.vocab_size
    prompts = random_prompts(args.prompts, vocab)
    decode_rate, drawn = pure_decode(gen, prompts, args.slots, args.steps, args.calls)
    stop = stop_tokens(drawn, vocab, args.mean_length)
    kw = dict(max_new_tokens=args.max_new, temperature=1.0, stop=stop)
    run_pool(gen, prompts[:2], 2, min(args.slots, 4), kw)  # warm the pool's paths
    pool, pool_s, stats = run_pool(gen, prompts, args.n, args.slots, kw)
    fixed, fixed_s = run_fixed(gen, prompts, args.n, args.slots, kw)
    decode_rate_after, _ = pure_decode(gen, prompts, args.slots, args.steps, args.calls)
    if pool != fixed:
        raise AssertionError(f"{name}: the pool and the fixed batches produced different samples")
    lengths = np.array([len(ids) + (reason == "stop") for ids, reason in pool.values()])
    tokens, samples = int(lengths.sum()), len(pool)
    decode_best = max(decode_rate, decode_rate_after)
    row = {
        "model": name, "config": gen.config.__dict__, "slots": args.slots, "prompts": args.prompts, "n": args.n,
        "samples": samples, "tokens": tokens, "stop_tokens": len(stop), "max_new_tokens": args.max_new,
        "length_mean": float(lengths.mean()), "length_std": float(lengths.std()),
        "length_p10_p50_p90": [float(x) for x in np.percentile(lengths, [10, 50, 90])],
        "length_max": int(lengths.max()),
        "pool_seconds": pool_s, "pool_samples_per_s": samples / pool_s, "pool_tokens_per_s": tokens / pool_s,
        "fixed_seconds": fixed_s, "fixed_samples_per_s": samples / fixed_s, "fixed_tokens_per_s": tokens / fixed_s,
        "pure_decode_tokens_per_s": [decode_rate, decode_rate_after],
        "pool_over_pure_decode": tokens / pool_s / decode_best,
        "pool_over_fixed": fixed_s / pool_s,
        "pool_prefill_calls": stats.prefill_calls, "pool_prompts_prefilled": stats.prompts_prefilled,
        "pool_decode_steps": stats.decode_steps,
        "pool_slot_utilisation": stats.busy_slot_steps / max(1, stats.decode_steps * stats.slots),
        "generator_build_seconds": build,
    }
    print(f"{name}: {samples} samples, {tokens} tokens (length {lengths.mean():.1f} +- {lengths.std():.1f}, "
          f"max {lengths.max()}), {args.slots} slots\n"
          f"  pool        {row['pool_samples_per_s']:8.1f} samples/s {row['pool_tokens_per_s']:9,.0f} tokens/s\n"
          f"  fixed       {row['fixed_samples_per_s']:8.1f} samples/s {row['fixed_tokens_per_s']:9,.0f} tokens/s\n"
          f"  pure decode {'':18s} {decode_best:9,.0f} tokens/s (before {decode_rate:,.0f}, after "
          f"{decode_rate_after:,.0f})\n"
          f"  pool / pure decode {row['pool_over_pure_decode']:.2f}x, pool / fixed {row['pool_over_fixed']:.2f}x",
          flush=True)
    return row


def plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    for i, (key, label) in enumerate([("pure", "pure decode"), ("pool_tokens_per_s", "slot pool"),
                                      ("fixed_tokens_per_s", "fixed batches")]):
        values = [max(r["pure_decode_tokens_per_s"]) if key == "pure" else r[key] for r in rows]
        ax.bar(np.arange(len(rows)) + (i - 1) * width, values, width, label=label)
    ax.set_xticks(np.arange(len(rows)), [f"{r['model']} ({r['slots']} slots, mean {r['length_mean']:.0f} tok)"
                                         for r in rows])
    ax.set_ylabel("generated tokens/s")
    ax.set_title("massive sampling, temperature 1 (bench/sampling.py)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bench", "embedded"], choices=["bench", "embedded"])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=64, help="samples per prompt")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--mean-length", type=float, default=64.0)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16, help="steps per pure-decode call")
    ap.add_argument("--calls", type=int, default=4, help="timed pure-decode calls")
    ap.add_argument("--quick", action="store_true", help="8 prompts x 8 samples, 16 slots, lengths ~16")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sampling.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.slots, args.mean_length, args.max_new, args.calls = 8, 8, 16, 16.0, 48, 2
    rows = [measure(name, args) for name in args.models]
    result = {"what": "massive sampling: slot pool vs fixed batches vs pure decode, one run",
              "command": command_line(), "machine": machine_info(), "rows": rows}
    write_json(args.out, result)
    plot(rows, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
