"""Where a PHA decode step's time goes: the wall time of each kind of phase of the decode
op (mojo/pha_decode_step.mojo, its ``PHASE_TIMES`` switch turned on in a copy of the
kernel sources), per model, context and batch, beside what each kind must move or compute:

  - the cache phases (the GSS update with the attention over the cached rows, then the
    attention's merge) read each sample's GSS state and write it back and read its KV rows
    (``pha_long_context.sample_bytes``): their bytes over their time, against the streaming
    bandwidth measured in the same run;
  - the product phases (from x, from the branches' hidden values, the gate's product, the
    logits) multiply every matrix by every row: 2 B FLOPs per matrix element, and read every
    matrix (a token needs the one before, so every step reads them again); their bound is
    the slower of the FLOPs at the FMA peak (bench/fma_peak.py) and the matrices' bytes at
    the re-read bandwidth of an array of their size (``pha_long_context.reread_bytes_per_s``:
    from the last-level cache where they fit), both measured in the same run;
  - the rest: the block norms and the choice of the tokens;
  - of each kind, the time the workers spent waiting for each other at its phases' ends
    (``wait_us``: a worker whose units are done waits for the others' last units).

A step whose phases run at their bounds, one after the other, takes the sum of the bounds
(``sum_of_bounds_us``); a faster step needs the memory-bound and the compute-bound phases
to overlap. Each timing is the best of ``--repeats`` calls of ``--steps`` greedy steps from
position n - steps - 1 into the states (as the slot pool decodes), after a warm-up call;
every call's step time is kept, with their spread (slowest / fastest - 1).
The switched-on op is compiled once per context and dtype (the KV cache length is a static shape).

    python -m bench.pha_phase_times                          # pha, pha-attn; 512 2048 8192; batch 1, 16
    python -m bench.pha_phase_times --models pha --contexts 512 --batches 16
    python -m bench.pha_phase_times --dtypes float32 bfloat16     # bfloat16 matrices beside float32
Writes bench/results/pha_phase_times.json (``--append`` keeps the earlier runs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench.common import command_line, machine_info, write_json

OUT = Path(__file__).resolve().parent / "results" / "pha_phase_times.json"
SWITCH_OFF = "comptime PHASE_TIMES = False"
SWITCH_ON = "comptime PHASE_TIMES = True"
# the op's phase kinds in the order it prints them
KINDS = ("from_x", "gss_and_attention", "merge", "from_hidden", "gate_product", "norm", "logits", "choice")
CACHE = ("gss_and_attention", "merge")
PRODUCTS = ("from_x", "from_hidden", "gate_product", "logits")
LINE = re.compile(r"pha_decode_steps phase times: B=(\d+) S=(\d+) workers=(\d+) ns=([\d,]+)(?: waits=([\d,]+))?")


def switched_on_kernels(source: Path, into: Path) -> Path:
    """A copy of the kernel sources in ``into`` with the decode op's PHASE_TIMES on."""
    copy = into / "mojo"
    shutil.copytree(source, copy)
    op = copy / "pha_decode_step.mojo"
    text = op.read_text()
    if text.count(SWITCH_OFF) != 1:
        raise SystemExit(f"{op}: expected one line '{SWITCH_OFF}' to turn on")
    op.write_text(text.replace(SWITCH_OFF, SWITCH_ON))
    return copy


def parse_times(out: str) -> list[tuple[dict, dict]]:
    """Each call's line as ({kind: microseconds per step}, {kind: of which waiting}): each
    worker's wall time in a phase, and the part it waited at the phase's end for the
    others, summed by the op, divided by the workers and the steps (no waits from an op
    older than their timing, as ``bench.pha_op_ab`` may build)."""
    calls = []
    for m in LINE.finditer(out):
        steps, workers = int(m[2]), int(m[3])
        times, waits = ([int(v) / 1e3 / steps / workers for v in group.split(",")] if group else []
                        for group in (m[4], m[5]))
        if len(times) != len(KINDS) or len(waits) not in (0, len(KINDS)):
            raise ValueError(f"expected {len(KINDS)} phase times and waits, got {len(times)} and {len(waits)}: {m[0]}")
        calls.append((dict(zip(KINDS, times)), dict(zip(KINDS, waits))))
    if not calls:
        raise ValueError("no 'pha_decode_steps phase times' line: is PHASE_TIMES on in the kernels used?")
    return calls


def summarize(times: dict, cache_bytes: float, product_flops: float, matrix_bytes: float, stream: float,
              peak: float, reread: float) -> dict:
    """One cell from its best call's ``times`` (microseconds per step), the bytes its cache
    phases move, the FLOPs of its products and the bytes of its matrices per step, the
    streaming bandwidth (bytes/s), the FMA peak (FLOP/s) and the matrices' re-read
    bandwidth (bytes/s)."""
    cache_us = sum(times[k] for k in CACHE)
    product_us = sum(times[k] for k in PRODUCTS)
    step_us = sum(times.values())
    cache_bound_us = 1e6 * cache_bytes / stream
    product_bound_us = 1e6 * max(product_flops / peak, matrix_bytes / reread)
    return {"phase_us": times, "step_us": step_us, "cache_us": cache_us, "product_us": product_us,
            "rest_us": step_us - cache_us - product_us,
            "cache_bytes": cache_bytes, "cache_gb_per_s": cache_bytes / cache_us / 1e3,
            "cache_percent_of_streaming": 100 * cache_bound_us / cache_us if cache_us else None,
            "product_flops": product_flops, "product_gflop_per_s": product_flops / product_us / 1e3,
            "product_percent_of_fma_peak": 100 * 1e6 * product_flops / peak / product_us,
            "matrix_bytes": matrix_bytes, "product_matrix_gb_per_s": matrix_bytes / product_us / 1e3,
            "product_percent_of_bound": 100 * product_bound_us / product_us,
            "sum_of_bounds_us": cache_bound_us + product_bound_us,
            "step_percent_of_sum_of_bounds": 100 * (cache_bound_us + product_bound_us) / step_us}


@contextmanager
def captured_stdout():
    """File descriptor 1 (where the op prints) into a temporary file, read back on exit."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        box = {}
        try:
            yield box
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            f.seek(0)
            box["out"] = f.read().decode(errors="replace")


def measure(name: str, n: int, batches, steps: int, repeats: int, stream: float, peak: float,
            dtype: str = "float32") -> list[dict]:
    from bench.pha_long_context import (configs, engine_of, matrix_bytes, reread_bytes_per_s, sample_bytes, spread,
                                        weight_bytes_of)
    from srm_max.runtime.call_types import SamplingArrays

    config = configs(name, n, False)
    engine = engine_of(name, config, "op", dtype)
    start = n - steps - 1
    mats = matrix_bytes(name, config, weight_bytes_of(dtype))
    reread = reread_bytes_per_s(mats)
    rows = []
    for B in batches:
        ids = np.random.default_rng(B).integers(0, config.vocab_size, B).astype(np.int64)
        pos = np.full(B, start, np.int64)
        states = engine.empty_states(B)
        greedy = SamplingArrays.greedy(B)
        with captured_stdout() as box:
            for _ in range(repeats + 1):  # the first is a warm-up
                engine.decode(ids, pos, states, greedy, steps, donate_states=True)
        calls = parse_times(box["out"])[1:]
        best, waits = min(calls, key=lambda c: sum(c[0].values()))
        per_sample = sum(sample_bytes(name, config, start + s) for s in range(steps)) / steps
        cell = summarize(best, B * per_sample, 2.0 * B * matrix_bytes(name, config, 1), mats, stream, peak, reread)
        runs = [sum(c[0].values()) for c in calls]
        rows.append({"model": name, "dtype": dtype, "context": n, "batch": B, "reread_bytes_per_s": reread, **cell,
                     "wait_us": waits, "step_us_runs": runs, "spread": spread(runs)})
        print(f"{name:9s} {dtype:8s} n={n:5d} B={B:3d}: step {cell['step_us']:7.1f} us = cache {cell['cache_us']:7.1f} "
              f"({cell['cache_percent_of_streaming']:.0f} % of streaming) + products {cell['product_us']:7.1f} "
              f"({cell['product_percent_of_bound']:.0f} % of their bound) + rest {cell['rest_us']:5.1f}; "
              f"sum of bounds {cell['sum_of_bounds_us']:.1f} us; waiting {sum(waits.values()):.1f} us", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["pha", "pha-attn"], choices=["pha", "pha-attn", "pha-gss"])
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 2048, 8192])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--dtypes", nargs="*", default=["float32"], choices=["float32", "bfloat16"],
                    help="the matrices' dtype (the states stay float32)")
    ap.add_argument("--steps", type=int, default=16, help="decode tokens per call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--append", action="store_true", help="add this run to the JSON's earlier ones")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)

    from srm_max.runtime.kernels import mojo_source_dir

    with tempfile.TemporaryDirectory() as folder:
        os.environ["SRM_MAX_MOJO_DIR"] = str(switched_on_kernels(mojo_source_dir(), Path(folder)))
        from bench.fma_peak import fma_peak
        from bench.pha_long_context import stream_bytes_per_s

        peak = fma_peak()
        run = {"command": command_line(), "machine": machine_info(), "note": args.note, "steps_per_call": args.steps,
               "repeats": args.repeats, "fma_peak": peak, "stream_bytes_per_s": {}, "rows": []}
        for n in args.contexts:
            stream = stream_bytes_per_s()
            for name in args.models:
                for dtype in args.dtypes:
                    run["rows"] += measure(name, n, args.batches, args.steps, args.repeats, stream, peak["flops"],
                                           dtype)
            stream = max(stream, stream_bytes_per_s())  # the best of before and after, as pha_long_context
            run["stream_bytes_per_s"][str(n)] = stream
            for row in run["rows"]:  # the context's cells against the best bandwidth
                if row["context"] == n:
                    row.update(summarize(row["phase_us"], row["cache_bytes"], row["product_flops"],
                                         row["matrix_bytes"], stream, peak["flops"], row["reread_bytes_per_s"]))
    runs = json.loads(args.out.read_text())["runs"] if args.append and args.out.is_file() else []
    print(f"wrote {write_json(args.out, {'runs': runs + [run]})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
