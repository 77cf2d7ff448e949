"""Where the PHA decode op's attention time goes: its block loop over the cached keys and
values (bench/pha_attention_loop.mojo, the op's own functions) against a plain read of the
same bytes, from memory and from the cache, on 1 and 2 cores; and the op's loop with the
group's query heads together (``loop``) against one head after the other (``per_head``,
what the op runs for head widths it does not group).

    python -m bench.pha_attention_loop [--rounds 5] [--cpu-target x86-64-v3] [--base REV] [--out PATH]

Four cells per worker count, each the median of ``--rounds`` interleaved rounds (each round
runs every cell once, so the machine's drift over minutes falls on all of them alike):

- ``stream_memory``: a plain sum over 128 MiB of keys and values (128 units of 2,048 rows);
- ``loop_memory``: the op's block loop over the same bytes (2 query heads per KV head,
  head width 64: the group's heads together); ``per_head_memory``: a head at a time;
- ``stream_cache``, ``loop_cache`` and ``per_head_cache``: the same over 1 MiB (8 blocks of
  256 rows) read by 800 units, so it stays in the cache: the loops' own speed, memory aside.

Before timing, the driver checks that both loops give the same sums (``check``).

With ``--base REV`` the op's loop of git revision REV (its ``mojo/``) runs too, in the same
rounds, beside the working tree's (``loop_memory_base``, ``loop_cache_base``; which of the two
goes first alternates between rounds): ``loop_*_over_base`` is the median of the rounds'
ratios (above 1 where the working tree's loop is faster), and ``*_rounds_won`` how many
rounds it was faster, a change's effect with the machine's drift over minutes divided out.

If reading and computing did not overlap at all, the loop from memory would run at
``1 / (1 / stream_memory + 1 / loop_cache)`` (``no_overlap_gbps``); if they overlapped
fully, at ``min(stream_memory, loop_cache)``. Where ``loop_memory`` falls between the two
says what to change: a faster loop, or more of its reads in flight while it computes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.common import command_line, machine_info, rounds_verdict, write_json
from bench.decode_op_ab import ROOT, build, commit_of, export_ops, link_ops, run_driver, value_after

DRIVER = Path(__file__).with_name("pha_attention_loop.mojo")
OUT = Path(__file__).with_name("results") / "pha_attention_loop.json"
# (rows per unit, units, distinct blocks of data, passes): 128 MiB from memory; 1 MiB read
# over and over from the cache, in passes of about 100 MiB
SHAPES = {"memory": (2048, 128, 128, 3), "cache": (256, 800, 8, 5)}
MODES = ("stream", "loop", "per_head")


def check_loops_agree(binary: Path) -> None:
    """The op's grouped loop and the per-head loop must give the same sums (rows across
    blocks and a short tail)."""
    for rows in (2048, 1000, 36):
        done = subprocess.run([str(binary), "check", str(rows), "1", "1", "1", "1"], capture_output=True, text=True)
        if done.returncode != 0 or value_after(done.stdout, "check", "max_difference") != 0:
            raise SystemExit(f"pha_attention_loop: the two loops differ at {rows} rows:\n{done.stdout}{done.stderr[-2000:]}")


def run_cell(binary: Path, mode: str, where: str, workers: int) -> float:
    rows, units, distinct, passes = SHAPES[where]
    return run_driver(binary, [mode, rows, units, distinct, workers, passes], "mode", "gbps")


def summarize(cells: dict[str, list[float]]) -> dict:
    """Medians of each cell's rounds, and what the loop from memory would reach with its
    reads and its computing not overlapping at all, or overlapping fully."""
    med = {name: statistics.median(values) for name, values in cells.items()}
    no_overlap = 1 / (1 / med["stream_memory"] + 1 / med["loop_cache"])
    full_overlap = min(med["stream_memory"], med["loop_cache"])
    return {**{f"{name}_gbps": round(v, 2) for name, v in med.items()},
            "no_overlap_gbps": round(no_overlap, 2), "full_overlap_gbps": round(full_overlap, 2),
            "loop_memory_over_stream_memory": round(med["loop_memory"] / med["stream_memory"], 3),
            "loop_over_per_head_memory": round(med["loop_memory"] / med["per_head_memory"], 3),
            "rounds_gbps": {name: [round(v, 2) for v in values] for name, values in cells.items()}}


def against_base(cells: dict[str, list[float]]) -> dict:
    """Per place (memory, cache) with a base loop: the median of the rounds' ratios of the
    working tree's loop to the base's, and the rounds the working tree's was faster."""
    out = {}
    for where in SHAPES:
        if f"loop_{where}_base" in cells:
            verdict = rounds_verdict(new / old for new, old in zip(cells[f"loop_{where}"], cells[f"loop_{where}_base"]))
            out[f"loop_{where}_over_base"] = round(verdict["median"], 3)
            out[f"loop_{where}_rounds_won"] = verdict["above_1"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cpu-target", default=None, help="LLVM CPU name to build for (default: this host)")
    p.add_argument("--base", default=None, help="also time the op's loop of this git revision, in the same rounds")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if args.rounds < 1 or min(args.workers) < 1:
        p.error("--rounds and --workers must be positive")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pha_attention_loop-") as tmp:
        binary = build(link_ops(ROOT / "mojo", Path(tmp)), Path(tmp) / "pha_attention_loop", args.cpu_target,
                       DRIVER)
        check_loops_agree(binary)
        loops = {"": binary}  # by the suffix of their cells' names
        if args.base:
            loops["_base"] = build(export_ops(args.base, Path(tmp) / "base"), Path(tmp) / "pha_attention_loop_base",
                                       args.cpu_target, DRIVER)
            check_loops_agree(loops["_base"])
        for workers in args.workers:
            cells: dict[str, list[float]] = {f"{m}_{w}": [] for w in SHAPES for m in MODES}
            cells |= {f"loop_{w}{suffix}": [] for w in SHAPES for suffix in loops}
            for round_ in range(args.rounds):
                for where in SHAPES:
                    for mode in MODES:
                        if mode != "loop":
                            cells[f"{mode}_{where}"].append(run_cell(binary, mode, where, workers))
                            continue
                        for suffix in (list(loops) if round_ % 2 == 0 else list(loops)[::-1]):
                            cells[f"loop_{where}{suffix}"].append(run_cell(loops[suffix], "loop", where, workers))
            row = {"workers": workers, **summarize(cells), **against_base(cells)}
            rows.append(row)
            print(f"{workers} worker(s): loop from memory {row['loop_memory_gbps']} GB/s "
                  f"(a head at a time: {row['per_head_memory_gbps']}), a plain read "
                  f"{row['stream_memory_gbps']}; the loop from the cache {row['loop_cache_gbps']}; "
                  f"no overlap would give {row['no_overlap_gbps']}, full overlap {row['full_overlap_gbps']}",
                  flush=True)
            if args.base:
                print(f"  against {args.base}: the loop from memory {row['loop_memory_over_base']}x (faster in "
                      f"{row['loop_memory_rounds_won']} of {args.rounds} rounds), from the cache "
                      f"{row['loop_cache_over_base']}x ({row['loop_cache_rounds_won']} of {args.rounds})", flush=True)
    write_json(args.out, {
        "what": "the PHA decode op's attention block loop (bench/pha_attention_loop.mojo), with the group's "
                "query heads together (loop) and a head at a time (per_head), against a plain read of the same "
                "keys and values, from memory and from the cache; medians of interleaved rounds",
        "head_width": 64, "query_heads_per_kv_head": 2, "shapes": SHAPES, "rounds": args.rounds,
        "cpu_target": args.cpu_target or "host", "base": args.base and commit_of(args.base),
        "command": command_line(), "machine": machine_info(),
        "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
