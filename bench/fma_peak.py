"""The CPU's float32 FMA peak, measured (bench/fma_peak.mojo: every core on register-only
vector FMAs): the yardstick for "a fraction of the FMA peak".

    python -m bench.fma_peak [--seconds 0.2] [--rounds 10]

``fma_peak()`` builds the program (``mojo build``, for this host's CPU), runs it and
returns FLOP/s per core-second of CPU time (the FLOPs it did over the CPU time its
process used: robust to other jobs sharing the cores, which a wall clock is not) times
the physical cores, next to the best wall-clock round.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
from pathlib import Path

PROGRAM = Path(__file__).with_name("fma_peak.mojo")


def build(output: Path) -> Path:
    from srm_max.runtime.kernels import run_mojo

    done = run_mojo(["build", str(PROGRAM), "-o", str(output)])
    if done.returncode != 0 or not output.is_file():
        raise SystemExit(f"fma_peak: building {PROGRAM} failed:\n{done.stdout}{done.stderr}")
    return output


def fma_peak(seconds: float = 0.2, rounds: int = 10) -> dict:
    """{"flops": peak FLOP/s of all cores (per CPU-second x cores), "flops_per_core", "cores",
    "simd_width", "best_wall_flops", "load_average"}."""
    with tempfile.TemporaryDirectory() as folder:
        exe = build(Path(folder) / "fma_peak")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([str(exe), str(seconds), str(rounds)], capture_output=True, text=True, check=True).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    fields = out.split()
    value = {fields[i]: float(fields[i + 1]) for i in range(0, len(fields) - 1, 2)}
    cpu_seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    per_core = value["total_flop"] / cpu_seconds
    cores = int(value["workers"])
    return {"what": "register-only float32 vector FMAs on every core (bench/fma_peak.mojo)",
            "flops": per_core * cores, "flops_per_core": per_core, "cores": cores,
            "simd_width": int(value["simd_width"]), "best_wall_flops": value["best_flops"],
            "cpu_seconds": cpu_seconds, "load_average": list(os.getloadavg())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=0.2, help="per round")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    peak = fma_peak(args.seconds, args.rounds)
    print(f"FMA peak: {peak['flops'] / 1e9:.1f} GFLOP/s ({peak['cores']} cores x "
          f"{peak['flops_per_core'] / 1e9:.1f} per core-second; best wall-clock round "
          f"{peak['best_wall_flops'] / 1e9:.1f}), load average {peak['load_average'][0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
