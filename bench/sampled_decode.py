"""Sampled against greedy decode on the CPU, side by side in one run.

    python -m bench.sampled_decode [--batches 1 16 64 256] [--steps 32] [--repeats 7]
                                   [--dtype float32|bfloat16] [--no-loop]

One SRM of the benchmark size (d 256, 8 layers, 4 heads, n 1024, vocab 4096; random
weights, as bench/cpu_decode.py), ``Engine.decode`` of ``--steps`` steps per call from
the same state, the rows interleaved in every repeat (best of ``--repeats``):

    greedy           temperature 0: every step in one op, each token the first argmax
    plain            temperature 1.0, no filter: the draw inside the same op
    top-k 50 + top-p 0.9
                     temperature 1.0 with both filters (a sorted buffer of 50 values
                     per row, filled from the few tokens above a bound)
    top-p 0.9        temperature 1.0, top-p alone (the few tokens near the max on a
                     peaked row, else the row binned below its max and one bin sorted:
                     no sort of the vocabulary)
    plain (loop)     plain sampling through the decode graph's loop: one whole-step op
                     and MAX's sampler ops per step (``--no-loop`` leaves it out)

Reports tokens/s per row and batch (best call) and each sampled row over greedy at the same
batch twice: the best calls' ratio, and the median over rounds of the ratio within a round
(calls seconds apart: robust to the drift of a shared machine's speed between rounds).
Writes bench/results/sampled_decode[_bf16].json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.common import (RESULTS, build_srm_reference, command_line, loop_engine, machine_info, markdown_table,
                          srm_config, srm_weights, write_json)

START_POSITION = 100  # a mid-context position, as bench/cpu_decode.py
SETTLE_S = 0.25  # a pause before each timed call: the previous call's worker threads stop spinning
# row name -> (temperature, top_k, top_p, runs on the loop engine)
ROWS = {
    "greedy": (0.0, 0, 1.0, False),
    "plain": (1.0, 0, 1.0, False),
    "top-k 50 + top-p 0.9": (1.0, 50, 0.9, False),
    "top-p 0.9": (1.0, 0, 0.9, False),
    "plain (loop)": (1.0, 0, 1.0, True),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--no-loop", action="store_true", help="leave out the decode graph's loop")
    ap.add_argument("--out", type=Path, default=None,
                    help="default bench/results/sampled_decode.json (_bf16.json with --dtype bfloat16)")
    args = ap.parse_args(argv)

    from srm_max.models.srm.engine import Engine
    from srm_max.runtime.call_types import SamplingArrays
    from srm_max.runtime.cpu_target import current

    from srm_max.runtime.precompile import precompile

    config = srm_config()
    weights = srm_weights(build_srm_reference(config))
    engines = {False: Engine(config, weights, args.dtype)}
    rows = {k: v for k, v in ROWS.items() if not (v[3] and args.no_loop)}
    if any(v[3] for v in rows.values()):
        engines[True] = loop_engine(config, weights, args.dtype)
    # only the decode graphs this run calls (cold ones compile side by side)
    precompile([engines[False].graph_job("decode_steps")] + ([engines[True].graph_job("decode")] if True in engines
                                                                else []))

    calls = {}
    for B in args.batches:
        ids = np.arange(B, dtype=np.int64) * 7 % config.vocab_size
        for name, (t, k, p, loop) in rows.items():
            e = engines[loop]
            s = SamplingArrays(np.full(B, t, np.float32), np.full(B, k, np.int64), np.full(B, p, np.float32),
                               np.arange(B, dtype=np.uint64) + 11)
            call = (e, (ids, np.full(B, START_POSITION, np.int64), e.empty_states(B), e.sampling_buffers(s),
                        args.steps))
            e.decode(*call[1])  # first call at this batch: allocations
            calls[(B, name)] = call

    seconds = {key: [] for key in calls}
    for _ in range(args.repeats):
        for key, (e, call) in calls.items():
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            e.decode(*call)
            seconds[key].append(time.perf_counter() - t0)

    results, table = [], []
    for B in args.batches:
        greedy = np.asarray(seconds[(B, "greedy")])
        for name in rows:
            mine = np.asarray(seconds[(B, name)])
            tps = B * args.steps / mine.min()
            best_ratio = greedy.min() / mine.min()
            # each round's greedy and sampled calls ran a few seconds apart: their ratio
            # is robust to the machine's drift between rounds, the best-of ratio is not
            round_ratio = float(np.median(greedy / mine))
            results.append({"batch": B, "row": name, "tokens_per_s": round(tps, 1),
                            "over_greedy": round(best_ratio, 3), "over_greedy_median_of_rounds": round(round_ratio, 3),
                            "seconds": [round(x, 5) for x in mine]})
            table.append([B, name, f"{tps:,.0f}", f"{best_ratio:.2f}x", f"{round_ratio:.2f}x"])
    print(markdown_table(["batch", "row", "tokens/s (best)", "over greedy (best of each)",
                          "over greedy (median of rounds)"], table))
    out = args.out or RESULTS / ("sampled_decode.json" if args.dtype == "float32" else "sampled_decode_bf16.json")
    write_json(out, {
        "command": command_line(), "machine": machine_info(), "cpu_target": current(),
        "model": {"d_model": config.d_model, "n_layers": config.n_layers, "n_heads": config.n_heads,
                  "context_length": config.context_length, "vocab_size": config.vocab_size,
                  "weights": args.dtype},
        "steps_per_call": args.steps, "repeats": args.repeats, "start_position": START_POSITION,
        "rows": {k: {"temperature": v[0], "top_k": v[1], "top_p": v[2], "decode_graph_loop": v[3]}
                 for k, v in rows.items()},
        "results": results,
    })
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
