"""How the decode ops' products at batch 16 keep their panels coming: a unit of 16 batch rows
times a 64-column panel, as the decode ops run it, with each way of prefetching the panels
(bench/product_prefetch.mojo, built against ``mojo/``).

    python -m bench.product_prefetch [--rounds 5] [--cpu-target x86-64-v3] [--out PATH]

At batch 16 a unit's tiles compute about as long as its panel takes to stream in, so the
product runs near the FMA peak only if the next panel streams while this one computes.
The modes: ``none`` (the hardware's prefetchers alone), ``own`` (the unit's later sub-panels
prefetched by its first sub-panel's tiles), ``crowded`` (the next unit's
panel prefetched by a few tiles, a line per step of k) and ``spread`` (every tile a share of
it, a line per 4 steps: both decode ops' with AVX2, whose tiles of 4 rows by 2 vectors this
unit has; with AVX-512 the ops prefetch no next panel). Panels of K 256 and 512 cycle
through 128 KiB (the L2 cache holds them: the tiles' own rate), 16 MiB (the last-level
cache) and 64 MiB (memory). Each cell is the median of ``--rounds`` interleaved rounds;
the verdict per total and K is each mode's ratio to ``own``.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from bench.common import command_line, machine_info, write_json
from bench.decode_op_ab import ROOT, build, driver_parser, link_ops, parse_driver_args, run_driver

DRIVER = Path(__file__).with_name("product_prefetch.mojo")
OUT = Path(__file__).with_name("results") / "product_prefetch.json"
MODES = ("none", "own", "crowded", "spread")
BASELINE = "own"
TOTALS_KIB = (128, 16 * 1024, 64 * 1024)
PANEL_ROWS = (256, 512)


def summarize(runs: dict[str, list[float]]) -> dict:
    """Each mode's median GFLOP/s over the rounds, its ratio to BASELINE's and every round's value."""
    med = {mode: statistics.median(values) for mode, values in runs.items()}
    return {**{f"{mode}_gflops": round(v, 1) for mode, v in med.items()},
            **{f"{mode}_over_{BASELINE}": round(v / med[BASELINE], 3) for mode, v in med.items() if mode != BASELINE},
            "rounds_gflops": {mode: [round(v, 1) for v in values] for mode, values in runs.items()}}


def measure(binary: Path, rounds: int, workers: int) -> list[dict]:
    cells = [(kib, k) for kib in TOTALS_KIB for k in PANEL_ROWS]
    runs = {cell: {mode: [] for mode in MODES} for cell in cells}
    for _ in range(rounds):
        for kib, k in cells:
            for mode in MODES:
                runs[(kib, k)][mode].append(run_driver(binary, [mode, kib, k, workers], "mode", "gflops"))
    rows = []
    for (kib, k), cell in runs.items():
        rows.append({"total_kib": kib, "panel_rows": k, **summarize(cell)})
        r = rows[-1]
        print(f"{kib:6d} KiB, K {k}: " + ", ".join(f"{m} {r[f'{m}_gflops']}" for m in MODES)
              + f" GFLOP/s; spread / own {r['spread_over_own']}")
    return rows


def main(argv=None) -> int:
    args = parse_driver_args(driver_parser(__doc__.split("\n\n")[0], OUT), argv)
    with tempfile.TemporaryDirectory(prefix="product_prefetch-") as tmp:
        binary = build(link_ops(ROOT / "mojo", Path(tmp)), Path(tmp) / "product_prefetch", args.cpu_target, DRIVER)
        rows = measure(binary, args.rounds, args.workers)
    write_json(args.out, {
        "what": "a batch-16 product unit (16 rows x a 64-column float32 panel, the decode ops' tiles and claims "
                "in runs) with each way of prefetching the panels (bench/product_prefetch.mojo); medians of "
                "interleaved rounds, GFLOP/s on all workers",
        "modes": MODES, "workers": args.workers, "rounds": args.rounds, "cpu_target": args.cpu_target or "host",
        "command": command_line(), "machine": machine_info(), "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
