"""How fast the decode ops' one-row product reads its matrices: the op's register tile
against a plain read of the same bytes, the bfloat16 widening before and after
``load_weights``, and the PHA op's ways of sharing a phase between the workers
(bench/product_read_rate.mojo, built against ``mojo/``).

    python -m bench.product_read_rate [--rounds 5] [--cpu-target x86-64-v3] [--sweep] [--out PATH]

A batch-1 decode step multiplies one row by every matrix, phase after phase, each phase
ending when every worker is done with it. The driver runs such phases of 2 MiB of packed
panels (K 256), cycling through a total of 12 MiB (about the bench PHA's bfloat16 matrices,
12.7 MB) or 28 MiB (its float32 ones, 29.6 MB), in float32 and bfloat16. Modes:
``stream`` (a plain read), ``tile`` (the op's tile, each worker a contiguous share),
``per_unit`` (the tile, a panel per claim), ``claimed`` (the tile, runs of panels per claim
as the PHA op claims at batch 1) and, for bfloat16, ``widen_each`` (each vector of weights
widened alone, as before ``load_weights``). Each cell is the median of ``--rounds``
interleaved rounds (every round runs every cell once, so the machine's drift falls on all
of them alike).

``--sweep`` asks what else sets a batch-1 step's product rate, with bfloat16 panels read as
the op reads them at batch 1 (``claimed``) beside the plain read: phases of 128 KiB to 2 MiB
over 12 MiB (a step's product phases are 0.25-2 MiB: the fixed cost of a phase), and 1 MiB
phases over 8 to 28 MiB (how much of the last-level cache a step's matrices and caches can
count on). Written to product_read_rate_sweep.json by default.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.common import command_line, machine_info, write_json
from bench.decode_op_ab import ROOT, build, driver_parser, link_ops, parse_driver_args, run_driver

DRIVER = Path(__file__).with_name("product_read_rate.mojo")
OUT = Path(__file__).with_name("results") / "product_read_rate.json"
SWEEP_OUT = Path(__file__).with_name("results") / "product_read_rate_sweep.json"
PHASE_KIB = 2048
TOTALS_MIB = (12, 28)
PHASES = 1000  # per run with PHASE_KIB phases; smaller phases get more, for the same bytes
SWEEP_PHASES_KIB = (128, 256, 512, 1024, 2048)  # over SWEEP_TOTAL_MIB
SWEEP_TOTAL_MIB = 12
SWEEP_TOTALS_MIB = (8, 12, 16, 20, 24, 28)  # with SWEEP_PHASE_KIB phases
SWEEP_PHASE_KIB = 1024
SWEEP_MODES = ("stream", "claimed")
DTYPES = ("float32", "bfloat16")
MODES = ("stream", "tile", "per_unit", "claimed", "widen_each")


def modes_for(dtype: str) -> tuple[str, ...]:
    return MODES if dtype == "bfloat16" else tuple(m for m in MODES if m != "widen_each")


def sweep_cells() -> list[tuple[int, int]]:
    """The sweep's (phase KiB, total MiB) cells: the phase sizes over one total, then the
    totals with one phase size (their shared cell once)."""
    cells = [(kib, SWEEP_TOTAL_MIB) for kib in SWEEP_PHASES_KIB]
    cells += [(SWEEP_PHASE_KIB, mib) for mib in SWEEP_TOTALS_MIB if (SWEEP_PHASE_KIB, mib) not in cells]
    return cells


def run_cell(binary: Path, mode: str, dtype: str, total_mib: int, workers: int, phase_kib: int = PHASE_KIB) -> float:
    phases = PHASES * PHASE_KIB // phase_kib
    return run_driver(binary, [mode, dtype, phase_kib, total_mib * 1024, workers, phases], "mode", "gbps")


def summarize(cells: dict[str, list[float]]) -> dict:
    """Each mode's median GB/s, and the ratios that say what sets the rate: the tile
    against a plain read, claims in runs against a claim per panel, and (bfloat16) the
    pairwise widening against widening each vector alone."""
    med = {mode: statistics.median(values) for mode, values in cells.items()}
    out = {f"{mode}_gbps": round(v, 2) for mode, v in med.items()}
    out["tile_over_stream"] = round(med["tile"] / med["stream"], 3)
    out["claimed_over_per_unit"] = round(med["claimed"] / med["per_unit"], 3)
    if "widen_each" in med:
        out["tile_over_widen_each"] = round(med["tile"] / med["widen_each"], 3)
    out["rounds_gbps"] = {mode: [round(v, 2) for v in values] for mode, values in cells.items()}
    return out


def summarize_sweep(cells: dict[str, list[float]]) -> dict:
    """A sweep cell's medians and the op's share of the plain read."""
    med = {mode: statistics.median(values) for mode, values in cells.items()}
    return {**{f"{mode}_gbps": round(v, 2) for mode, v in med.items()},
            "claimed_over_stream": round(med["claimed"] / med["stream"], 3),
            "rounds_gbps": {mode: [round(v, 2) for v in values] for mode, values in cells.items()}}


def sweep(binary: Path, rounds: int, workers: int) -> list[dict]:
    cells = {cell: {mode: [] for mode in SWEEP_MODES} for cell in sweep_cells()}
    for _ in range(rounds):
        for (kib, mib), runs in cells.items():
            for mode in SWEEP_MODES:
                runs[mode].append(run_cell(binary, mode, "bfloat16", mib, workers, kib))
    rows = []
    for (kib, mib), runs in cells.items():
        rows.append({"dtype": "bfloat16", "phase_kib": kib, "total_mib": mib, **summarize_sweep(runs)})
        print(f"bfloat16 phases of {kib:4d} KiB over {mib:2d} MiB: plain read {rows[-1]['stream_gbps']}, "
              f"the op's claimed tile {rows[-1]['claimed_gbps']} GB/s ({rows[-1]['claimed_over_stream']}x)")
    return rows


def main(argv=None) -> int:
    p = driver_parser(__doc__.split("\n\n")[0], None, f"default {OUT.name}, or {SWEEP_OUT.name} with --sweep")
    p.add_argument("--sweep", action="store_true", help="phase sizes and totals instead (see above)")
    args = parse_driver_args(p, argv)
    with tempfile.TemporaryDirectory(prefix="product_read_rate-") as tmp:
        binary = build(link_ops(ROOT / "mojo", Path(tmp)), Path(tmp) / "product_read_rate", args.cpu_target, DRIVER)
        rows = (sweep if args.sweep else measure)(binary, args.rounds, args.workers)
    if args.sweep:
        what = {"what": "bfloat16 panels multiplied by one row as the op claims them at batch 1 (the driver's "
                        "'claimed') beside a plain read, over phase sizes and totals; medians of interleaved rounds"}
    else:
        what = {"what": "the decode ops' one-row product tile (bench/product_read_rate.mojo) against a plain read of "
                        "the same panels, the bfloat16 widening before and after load_weights, and a claim per panel "
                        "against claims in runs; phases of 2 MiB, medians of interleaved rounds",
                "phase_mib": PHASE_KIB // 1024, "phases_per_run": PHASES}
    out = args.out or (SWEEP_OUT if args.sweep else OUT)
    write_json(out, {**what, "panel_rows": 256, "workers": args.workers, "rounds": args.rounds,
                     "cpu_target": args.cpu_target or "host", "command": command_line(), "machine": machine_info(),
                     "rows": rows})
    print(f"wrote {out}")
    return 0


def measure(binary: Path, rounds: int, workers: int) -> list[dict]:
    """Every mode of both dtypes over TOTALS_MIB, in phases of PHASE_KIB."""
    keys = [(dtype, total) for dtype in DTYPES for total in TOTALS_MIB]
    cells = {key: {mode: [] for mode in modes_for(key[0])} for key in keys}
    for _ in range(rounds):
        for dtype, total in keys:
            for mode in modes_for(dtype):
                cells[(dtype, total)][mode].append(run_cell(binary, mode, dtype, total, workers))
    rows = []
    for dtype, total in keys:
        row = {"dtype": dtype, "total_mib": total, **summarize(cells[(dtype, total)])}
        rows.append(row)
        line = ", ".join(f"{mode} {row[f'{mode}_gbps']}" for mode in modes_for(dtype))
        print(f"{dtype:8s} {total:3d} MiB: {line} GB/s; tile / stream {row['tile_over_stream']}, "
              f"claimed / per_unit {row['claimed_over_per_unit']}"
              + (f", tile / widen_each {row['tile_over_widen_each']}" if "tile_over_widen_each" in row else ""))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
