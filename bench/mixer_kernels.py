"""The Mojo mixer ops against the same graphs of plain MAX ops: prefill and decode tokens/s.

    python -m bench.mixer_kernels [--quick] [--batches 1 16 64 256] [--steps 32]

Two engines on the same weights, differing only in the token mixer
(``Engine(kernels=False)``: plain ops, the chunked-scan prefill and the
elementwise decode update; ``kernels=True``: ``srm_mixer_scan`` of
``mojo/mixer_scan.mojo`` in prefill and ``srm_mixer_step_functional`` of
``mojo/mixer_step.mojo`` in decode, without the whole-step op that the engine's
default CPU decode graph runs instead: bench/cpu_decode.py times that). Decode: for each batch both run the same
greedy multi-step decode, alternating, best of ``--repeats``. Prefill: prompts
of ``--prefill-shapes`` (batch x length). Tokens must agree. Prints tokens/s and
the ratio; writes ``bench/results/mixer_kernels.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


from bench.common import (RESULTS, build_srm_reference, command_line, machine_info,  # noqa: E402
                    srm_config, srm_weights, unfused_engine, write_json)


def decode_seconds(engine, batch: int, steps: int, position: int) -> tuple[float, np.ndarray]:
    from srm_max.runtime.call_types import SamplingArrays

    states = engine.empty_states(batch)
    sampling = engine.sampling_buffers(SamplingArrays.greedy(batch))
    ids = np.arange(batch, dtype=np.int64) % engine.config.vocab_size
    pos = np.full(batch, position, np.int64)
    t = time.perf_counter()
    res = engine.decode(ids, pos, states, sampling, steps)
    return time.perf_counter() - t, res.tokens


def prefill_seconds(engine, batch: int, length: int) -> tuple[float, np.ndarray]:
    prompts = (np.arange(batch * length, dtype=np.int64).reshape(batch, length) * 7919
               % engine.config.vocab_size).tolist()
    t = time.perf_counter()
    res = engine.prefill(prompts)
    return time.perf_counter() - t, res.next_ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batches 1 16 64, 2 repeats")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per call (one call timed)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-shapes", nargs="+", default=["1x1024", "16x1024", "64x256"],
                    help="batch x prompt length")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=RESULTS / "mixer_kernels.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.repeats, args.prefill_shapes = [1, 16, 64], 2, ["1x1024", "16x256"]

    from srm_max.models.srm.engine import Engine

    config = srm_config(d_model=args.d_model, n_layers=args.n_layers, context_length=args.context,
                        vocab_size=args.vocab)
    weights = srm_weights(build_srm_reference(config))
    engines = {"plain-ops": Engine(config, weights, kernels=False), "mojo-kernel": unfused_engine(config, weights)}
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

    prefill_rows = []
    for shape in args.prefill_shapes:
        batch, length = (int(x) for x in shape.split("x"))
        best = {name: float("inf") for name in engines}
        first = {}
        for name, eng in engines.items():  # warm-up call per shape
            prefill_seconds(eng, batch, length)
        for _ in range(args.repeats):
            for name, eng in engines.items():
                s, first[name] = prefill_seconds(eng, batch, length)
                best[name] = min(best[name], s)
        if not (first["plain-ops"] == first["mojo-kernel"]).all():
            print(f"prefill {shape}: the two graphs' first tokens differ", file=sys.stderr)
            return 1
        tps = {name: batch * length / s for name, s in best.items()}
        row = {"batch": batch, "prompt_len": length, "tokens_per_s": tps,
               "kernel_over_plain": tps["mojo-kernel"] / tps["plain-ops"]}
        prefill_rows.append(row)
        print(f"prefill {batch:3d} x {length:4d}: plain ops {tps['plain-ops']:9.0f} tok/s   mojo scan "
              f"{tps['mojo-kernel']:9.0f} tok/s   ratio {row['kernel_over_plain']:.2f}x", flush=True)

    write_json(args.out, {
        "what": "SRM prefill and decode (greedy): Mojo mixer ops vs plain MAX ops, same weights",
        "command": command_line(), "machine": machine_info(),
        "config": {"d_model": config.d_model, "n_layers": config.n_layers, "n_heads": config.n_heads,
                   "context_length": config.context_length, "vocab_size": config.vocab_size},
        "repeats": args.repeats, "decode": rows, "prefill": prefill_rows,
    })
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
