"""Slot refill against fixed batches, on completions of varied length.

    python -m bench.slot_refill [--slots 64] [--prompts 16] [--n 32]

The same samples (same prompts, same per-sample seeds, hence the same tokens)
are produced twice with the MAX Generator:

* slot refill: ``sample_many`` with a pool of B slots, each refilled the moment
  its sample finishes;
* fixed batches: ``Generator.generate`` on consecutive batches of B samples,
  each batch waiting for its longest member before the next one starts.

Lengths vary because sampling at temperature 1 stops at a random stop token
(or the length limit). Prints samples/s of both and the ratio; writes
``bench/results/slot_refill.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from srm_max.models.srm.config import SRMConfig  # noqa: E402
from srm_max.serve.generator import Generator  # noqa: E402
from srm_max.serve.sample_many import sample_many, sample_seed  # noqa: E402
from srm_max.serve.scheduler import PoolStats  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # default: the shape of bench/verifiable_demo.py, so its compiled graphs are reused
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=32, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--stop", type=int, nargs="*", default=[1], help="stop token ids")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "slot_refill.json")
    args = ap.parse_args(argv)

    import torch

    from srm_max.reference.srm import SRM

    cfg = SRMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=2,
                    context_length=args.context)
    torch.manual_seed(0)
    model = SRM(cfg)
    with torch.no_grad():
        model.output_layer.weight.mul_(0.1)  # near-uniform: the stop token comes at random
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    t = time.perf_counter()
    gen = Generator(cfg, weights)
    build = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, args.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    max_new = args.context - args.prompt_len
    kw = dict(max_new_tokens=max_new, temperature=1.0, stop=args.stop)
    seed = 5
    jobs = [(p, s) for p in range(len(prompts)) for s in range(args.n)]

    def refill():
        stats = PoolStats()
        out = {(x.prompt_index, x.sample_index): x.ids
               for x in sample_many(gen, prompts, args.n, max_batch=args.slots, seed=seed, stats=stats, **kw)}
        return out, stats

    def fixed():
        out, steps = {}, 0
        for i in range(0, len(jobs), args.slots):
            chunk = jobs[i: i + args.slots]
            res = gen.generate([prompts[p] for p, _ in chunk], seed=[sample_seed(seed, p, s) for p, s in chunk],
                               steps_per_call=1, **kw)
            steps += max(len(r.ids) + (r.finish_reason == "stop") for r in res)
            for job, r in zip(chunk, res):
                out[job] = r.ids
        return out, steps

    refill()  # warm
    times = {"refill": [], "fixed": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        a, stats = refill()
        times["refill"].append(time.perf_counter() - t)
        t = time.perf_counter()
        b, fixed_steps = fixed()
        times["fixed"].append(time.perf_counter() - t)
    assert a == b, "slot refill and fixed batches produced different samples"
    lengths = np.array([len(v) for v in a.values()])
    tokens = int(lengths.sum())
    best = {k: min(v) for k, v in times.items()}
    result = {
        "config": cfg.__dict__, "slots": args.slots, "samples": len(jobs), "tokens": tokens,
        "length_mean": float(lengths.mean()), "length_std": float(lengths.std()), "length_max": int(lengths.max()),
        "max_new_tokens": max_new, "stop": args.stop,
        "refill_seconds": best["refill"], "fixed_seconds": best["fixed"],
        "refill_samples_per_s": len(jobs) / best["refill"], "fixed_samples_per_s": len(jobs) / best["fixed"],
        "speedup": best["fixed"] / best["refill"],
        "refill_decode_steps": stats.decode_steps, "fixed_decode_steps_approx": fixed_steps,
        "refill_prefill_calls": stats.prefill_calls,
        "refill_slot_utilisation": stats.busy_slot_steps / max(1, stats.decode_steps * stats.slots),
        "idle_slot_steps_while_pending": stats.idle_slot_steps_while_pending,
        "generator_build_seconds": build, "times": times, "machine": platform.platform(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{len(jobs)} samples ({tokens} tokens, length {lengths.mean():.1f} +- {lengths.std():.1f}, "
          f"max {lengths.max()}), {args.slots} slots")
    print(f"slot refill : {result['refill_samples_per_s']:.0f} samples/s ({stats.decode_steps} decode steps, "
          f"utilisation {result['refill_slot_utilisation']:.2f})")
    print(f"fixed batch : {result['fixed_samples_per_s']:.0f} samples/s (~{fixed_steps} decode steps)")
    print(f"ratio       : {result['speedup']:.2f}x")
    return result


if __name__ == "__main__":
    main()
