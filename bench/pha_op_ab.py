"""A change to the PHA decode op, timed by itself: the op of a git revision (A) against the
working tree's (B), in interleaved rounds of bench/pha_phase_times.py.

    python -m bench.pha_op_ab [--base HEAD] [--models pha pha-attn] [--contexts 512 2048]
                              [--batches 1 16] [--dtypes float32 bfloat16] [--rounds 6]
                              [--repeats 7] [--out PATH] [--note "what B changes"]

Each round runs bench/pha_phase_times.py once with the kernel sources of ``--base`` and once
with the working tree's (``SRM_MAX_MOJO_DIR``; the order alternating between rounds), and
takes, per model, dtype, context and batch, the ratio of the two runs' step times (A / B:
above 1 where B is faster) and of their product phases' times. Two runs a few seconds apart
share the machine's drift over minutes, which on a shared VM moves a run's times by tens of
percent; the median of the rounds' ratios is the change's effect, and how many rounds B won
says how consistent it is. The JSON says what B is: ``--note`` and the working tree's
changes to ``mojo/`` (``decode_op_ab.working_tree_change``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import command_line, machine_info, rounds_verdict, write_json
from bench.decode_op_ab import PACKAGE, ROOT, commit_of, export_ops, working_tree_change
from srm_max.runtime import cpu_target

OUT = Path(__file__).with_name("results") / "pha_op_ab.json"


def cell_key(row: dict) -> str:
    return f"{row['model']} {row['dtype']} n={row['context']} B={row['batch']}"


def run_phase_times(kernels: Path, out: Path, args: argparse.Namespace) -> dict[str, dict]:
    """One run of bench/pha_phase_times.py on the kernel sources in ``kernels``: its rows by cell."""
    command = [sys.executable, "-m", "bench.pha_phase_times", "--models", *args.models,
               "--contexts", *map(str, args.contexts), "--batches", *map(str, args.batches),
               "--dtypes", *args.dtypes, "--repeats", str(args.repeats), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "SRM_MAX_MOJO_DIR": str(kernels)},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pha_op_ab: bench.pha_phase_times failed on {kernels}:\n{done.stderr[-3000:]}")
    return {cell_key(row): row for row in json.loads(out.read_text())["runs"][-1]["rows"]}


def summarize(rounds: list[dict[str, tuple[dict, dict]]]) -> dict[str, dict]:
    """Per cell: the median step, product and cache-phase times of A and B, the median of
    the rounds' ratios A / B of each, and the rounds B won (its step faster)."""
    out = {}
    for key in rounds[0]:
        pairs = [r[key] for r in rounds]
        step_ratios = [a["step_us"] / b["step_us"] for a, b in pairs]
        step = rounds_verdict(step_ratios)
        products = rounds_verdict(a["product_us"] / b["product_us"] for a, b in pairs)
        cache_ratios = [a["cache_us"] / b["cache_us"] for a, b in pairs if a["cache_us"] and b["cache_us"]]
        out[key] = {
            "step_us_a": round(statistics.median(a["step_us"] for a, _ in pairs), 1),
            "step_us_b": round(statistics.median(b["step_us"] for _, b in pairs), 1),
            "product_us_a": round(statistics.median(a["product_us"] for a, _ in pairs), 1),
            "product_us_b": round(statistics.median(b["product_us"] for _, b in pairs), 1),
            "cache_us_a": round(statistics.median(a["cache_us"] for a, _ in pairs), 1),
            "cache_us_b": round(statistics.median(b["cache_us"] for _, b in pairs), 1),
            "step_ratio": round(step["median"], 3),
            "product_ratio": round(products["median"], 3),
            # a model without attention or GSS has no cache phase
            "cache_ratio": round(rounds_verdict(cache_ratios)["median"], 3) if cache_ratios else None,
            "rounds_b_won": step["above_1"],
            "rounds": step["rounds"],
            "step_ratios": [round(r, 3) for r in step_ratios],
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="the git revision whose mojo/ is A")
    p.add_argument("--models", nargs="+", default=["pha", "pha-attn"])
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--note", default="", help="what the working tree's op (B) changes, kept in the JSON")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        p.error("--rounds and --repeats must be positive")
    b_is = working_tree_change(args.base, args.note)  # before the rounds: the tree may change meanwhile
    rounds = []
    with tempfile.TemporaryDirectory(prefix="pha_op_ab-") as tmp:
        base = export_ops(args.base, Path(tmp) / "base") / PACKAGE
        variants = {"a": base, "b": ROOT / "mojo"}
        for i in range(args.rounds):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            rows = {v: run_phase_times(variants[v], Path(tmp) / f"{v}{i}.json", args) for v in order}
            rounds.append({key: (rows["a"][key], rows["b"][key]) for key in rows["a"]})
            print(f"round {i + 1}: " + ", ".join(f"{key} {rows['a'][key]['step_us'] / rows['b'][key]['step_us']:.2f}"
                                                 for key in rows["a"]), flush=True)
    cells = summarize(rounds)
    for key, c in cells.items():
        print(f"{key}: step {c['step_us_a']} -> {c['step_us_b']} us, A / B {c['step_ratio']} (products "
              f"{c['product_ratio']}, cache phases {c['cache_ratio']}), B won {c['rounds_b_won']} of {c['rounds']}")
    write_json(args.out, {
        "what": "the PHA decode op of --base (A) against the working tree's (B): interleaved rounds of "
                "bench/pha_phase_times.py, per cell the medians and the median of the rounds' ratios A / B",
        "base": args.base, "base_commit": commit_of(args.base), "b": b_is,
        "rounds": args.rounds, "repeats": args.repeats,
        "command": command_line(), "cpu_target": cpu_target.requested() or "the host's",
        "machine": machine_info(), "cells": cells})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
