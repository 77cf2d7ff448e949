"""Decode steps/s with the Mojo mixer kernel against the same graph of plain MAX ops.

    python bench/decode_kernels.py [--quick] [--batches 1 16 64 256] [--steps 32]

Two engines on the same weights, differing only in the mixer update of the
decode graph (``Engine(kernels=False)``: plain ops; ``kernels=True``: the
``srm_mixer_step_functional`` custom op of ``mojo/mixer_step.mojo``). For each
batch both run the same greedy multi-step decode, alternating, best of
``--repeats``; the tokens must agree. Prints tokens/s and the ratio per batch;
writes ``bench/results/decode_kernels.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from common import (RESULTS, build_srm_reference, command_line, machine_info,  # noqa: E402
                    srm_config, srm_weights, write_json)


def decode_seconds(engine, batch: int, steps: int, position: int) -> tuple[float, np.ndarray]:
    from srm_max.engine import SamplingArrays

    states = engine.empty_states(batch)
    sampling = engine.sampling_buffers(SamplingArrays.greedy(batch))
    ids = np.arange(batch, dtype=np.int64) % engine.config.vocab_size
    pos = np.full(batch, position, np.int64)
    t = time.perf_counter()
    res = engine.decode(ids, pos, states, sampling, steps)
    return time.perf_counter() - t, res.tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batches 1 16 64, 2 repeats")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per call (one call timed)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_kernels.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.repeats = [1, 16, 64], 2

    from srm_max.engine import Engine

    config = srm_config(d_model=args.d_model, n_layers=args.n_layers, context_length=args.context,
                        vocab_size=args.vocab)
    weights = srm_weights(build_srm_reference(config))
    engines = {"plain-ops": Engine(config, weights), "mojo-kernel": Engine(config, weights, kernels=True)}
    for name, eng in engines.items():
        t = time.perf_counter()
        eng.warmup()
        print(f"{name}: graphs ready in {time.perf_counter() - t:.1f} s", flush=True)

    rows = []
    for batch in args.batches:
        best = {name: float("inf") for name in engines}
        tokens = {}
        for name, eng in engines.items():  # warm-up call per batch shape
            decode_seconds(eng, batch, 2, 7)
        for _ in range(args.repeats):
            for name, eng in engines.items():
                s, tokens[name] = decode_seconds(eng, batch, args.steps, 7)
                best[name] = min(best[name], s)
        if not (tokens["plain-ops"] == tokens["mojo-kernel"]).all():
            print(f"batch {batch}: the two graphs' greedy tokens differ", file=sys.stderr)
            return 1
        tps = {name: batch * args.steps / s for name, s in best.items()}
        row = {"batch": batch, "steps": args.steps, "tokens_per_s": tps,
               "kernel_over_plain": tps["mojo-kernel"] / tps["plain-ops"]}
        rows.append(row)
        print(f"batch {batch:4d}: plain ops {tps['plain-ops']:9.0f} tok/s   mojo kernel "
              f"{tps['mojo-kernel']:9.0f} tok/s   ratio {row['kernel_over_plain']:.2f}x", flush=True)

    write_json(args.out, {
        "what": "SRM decode (greedy, multi-step graph): Mojo mixer kernel vs plain MAX ops, same weights",
        "command": command_line(), "machine": machine_info(),
        "config": {"d_model": config.d_model, "n_layers": config.n_layers, "n_heads": config.n_heads,
                   "context_length": config.context_length, "vocab_size": config.vocab_size},
        "repeats": args.repeats, "rows": rows,
    })
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
