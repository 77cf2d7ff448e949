"""Soak: 100,000 decode steps of a refilled slot pool; memory, finiteness, steady speed.

    python -m bench.soak [--steps 100000] [--slots 64] [--every 5000]

Runs ``Generator.sample_many`` (the slot pool users run for hours) on a small
random SRM until the pool has made ``--steps`` decode steps, sampling at
temperature 1 with a stop token, so samples end at random lengths and slots are
refilled all the time. The engine is wrapped so that every prefill's logits and
states and every ``--check-every``-th decode's states are checked for NaN/Inf.
Every ``--every`` steps it records resident memory (RSS) and the tokens/s of
the interval. Writes ``bench/results/soak.json``; exits 1 on a non-finite value.

The default shape is the test suite's tiny config, so its compiled graphs are
reused; the point is leaks and numerical drift over time, not speed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


from bench.common import RESULTS, command_line, machine_info, rss_bytes, write_json  # noqa: E402

MiB = 1 << 20


class CheckedEngine:
    """Delegates to an Engine and counts non-finite values in what comes back."""

    def __init__(self, engine, check_every: int):
        self._engine = engine
        self._check_every = check_every
        self.decode_calls = 0
        self.checked = 0
        self.nonfinite: list[str] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _check(self, what: str, buffer) -> None:
        self.checked += 1
        if not np.isfinite(self._engine.host(buffer)).all():
            self.nonfinite.append(f"{what} after decode call {self.decode_calls}")

    def prefill(self, prompts, sampling=None, **options):
        result = self._engine.prefill(prompts, sampling, **options)
        self._check("prefill logits", result.logits)
        self._check("prefill states", result.states)
        return result

    def decode(self, ids, positions, states, sampling, steps=1, **options):
        result = self._engine.decode(ids, positions, states, sampling, steps, **options)
        self.decode_calls += 1
        if self.decode_calls % self._check_every == 0:
            self._check("decode states", result.states)
        return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100_000, help="decode steps of the pool")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--every", type=int, default=5_000, help="steps between memory/speed records")
    ap.add_argument("--check-every", type=int, default=100, help="decode calls between state checks")
    ap.add_argument("--d-model", type=int, default=16)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=96)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = ap.parse_args(argv)

    from srm_max.models.srm.config import SRMConfig
    from srm_max.models.srm.engine import Engine
    from srm_max.serve.generator import Generator
    from srm_max.reference.srm import random_srm
    from srm_max.serve.scheduler import PoolStats

    config = SRMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=2,
                       context_length=args.context)
    model = random_srm(config, 0, decay_low=0.85, bias_scale=0.1)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    engine = CheckedEngine(Engine(config, weights).warmup(), args.check_every)
    gen = Generator.from_engine(engine)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, args.vocab, int(rng.integers(1, 9))).tolist() for _ in range(256)]
    # More samples than the steps can finish: the run is cut at --steps.
    n = max(1, 2 * args.steps * args.slots // (len(prompts) * 8))
    stats = PoolStats()
    records = []
    start = last_t = time.perf_counter()
    last_tokens = last_steps = 0
    samples = 0
    print(f"{args.steps} decode steps, {args.slots} slots, config d{args.d_model} L{args.n_layers} "
          f"n{args.context} V{args.vocab}", flush=True)
    for sample in gen.sample_many(prompts, n, max_batch=args.slots, max_new_tokens=args.max_new_tokens,
                                  temperature=1.0, seed=1, stop=[0], stats=stats):
        samples += 1
        stats.active_per_step.clear()  # the pool's per-step log would grow for hours
        if stats.decode_steps - last_steps >= args.every or stats.decode_steps >= args.steps:
            now = time.perf_counter()
            tokens = stats.busy_slot_steps
            rec = {"step": stats.decode_steps, "seconds": now - start, "rss_mib": rss_bytes() / MiB,
                   "tokens_per_s": (tokens - last_tokens) / (now - last_t), "samples": samples,
                   "prefill_calls": stats.prefill_calls, "nonfinite": len(engine.nonfinite)}
            records.append(rec)
            print(f"step {rec['step']:7d}  rss {rec['rss_mib']:7.1f} MiB  {rec['tokens_per_s']:8.0f} tok/s  "
                  f"samples {samples}  non-finite {len(engine.nonfinite)}", flush=True)
            last_t, last_tokens, last_steps = now, tokens, stats.decode_steps
            if stats.decode_steps >= args.steps:
                break

    steady = records[1:] or records  # the first interval includes warm-up allocations
    rss = [r["rss_mib"] for r in steady]
    tps = np.array([r["tokens_per_s"] for r in steady])
    summary = {
        "decode_steps": stats.decode_steps, "samples": samples, "prefill_calls": stats.prefill_calls,
        "checks": engine.checked, "nonfinite": engine.nonfinite[:20],
        "rss_mib_first_steady": rss[0], "rss_mib_last": rss[-1], "rss_mib_max": max(rss),
        "rss_growth_mib": rss[-1] - rss[0],
        "tokens_per_s_mean": float(tps.mean()), "tokens_per_s_cv": float(tps.std() / tps.mean()),
        "seconds": time.perf_counter() - start,
    }
    print(f"rss {summary['rss_mib_first_steady']:.1f} -> {summary['rss_mib_last']:.1f} MiB "
          f"(max {summary['rss_mib_max']:.1f}); tokens/s mean {summary['tokens_per_s_mean']:.0f}, "
          f"cv {summary['tokens_per_s_cv']:.2f}; {engine.checked} checks, "
          f"{len(engine.nonfinite)} non-finite", flush=True)
    write_json(args.out, {
        "what": "soak: slot-pool decode steps, resident memory, finiteness, tokens/s per interval",
        "command": command_line(), "machine": machine_info(),
        "config": {"d_model": config.d_model, "n_layers": config.n_layers, "n_heads": config.n_heads,
                   "context_length": config.context_length, "vocab_size": config.vocab_size},
        "slots": args.slots, "records": records, "summary": summary,
    })
    print(f"wrote {args.out}")
    return 1 if engine.nonfinite else 0


if __name__ == "__main__":
    raise SystemExit(main())
