"""A change to the CPU decode op, timed by itself: the op of a git revision (A) against the
working tree's (B), in interleaved rounds.

    python -m bench.decode_op_ab [--base HEAD] [--cpu-target x86-64-v3] [--batches 1 16 64 256]
                                 [--dtype float32] [--workers 2] [--rounds 8] [--calls 5] [--out PATH]
                                 [--note "what B changes"]

Builds bench/decode_op.mojo (the op alone on bench/cpu_decode.py's model, greedy calls of 32
steps, float32 or bfloat16 matrices) against ``mojo/`` at ``--base`` and against the working
tree's ``mojo/``, for this host's CPU or for ``--cpu-target`` (an LLVM CPU name: ``x86-64-v3``
builds the AVX2 code on an AVX-512 host). Then, per batch, ``--rounds`` rounds of one run of
each binary (the order alternating), each run the median tokens/s of ``--calls`` calls. A
round's ratio B/A compares two runs a few seconds apart, so the machine's drift over minutes
(tens of percent on a shared machine) largely cancels; the median of the rounds' ratios is the
change's effect, and how many rounds B won says how consistent it is. Comparing two runs of
bench/cpu_decode.py cannot show a change of a few percent on such a machine.

Prints a line per batch; ``--out`` also writes the rounds as JSON, with what B is (``--note``
and the working tree's changes to ``mojo/``: ``working_tree_change``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from bench.common import command_line, machine_info, rounds_verdict, write_json

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).with_name("decode_op.mojo")
PACKAGE = "ops"  # the name bench/decode_op.mojo imports the op's package by


def export_ops(revision: str, into: Path) -> Path:
    """``mojo/`` as of ``revision``, written as the package directory ``into/ops``."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "mojo"],
                                 check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"decode_op_ab: cannot read mojo/ at {revision!r}: {e.stderr.decode().strip()}")
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "mojo").rename(into / PACKAGE)
    return into


def commit_of(revision: str) -> str:
    """The commit a revision names (the JSON keeps it: HEAD moves on)."""
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", revision], check=True, capture_output=True,
                          text=True).stdout.strip()


def working_tree_change(base: str, note: str, root: Path = ROOT) -> dict:
    """What B is, for the JSON: ``note`` (the change in words, ``--note``) and the working
    tree's ``mojo/`` as a diff against ``base`` (empty when B is A), so the result names the
    exact code it timed."""
    done = subprocess.run(["git", "-C", str(root), "diff", base, "--", "mojo"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cannot compare the working tree's mojo/ with {base!r}: {done.stderr.strip()}")
    return {"note": note, "mojo_diff": done.stdout}


def link_ops(source: Path, into: Path) -> Path:
    """The working tree's ``mojo/`` as the package directory ``into/ops``."""
    into.mkdir(parents=True, exist_ok=True)
    (into / PACKAGE).symlink_to(source, target_is_directory=True)
    return into


def build(include: Path, output: Path, cpu_target: str | None, driver: Path = DRIVER) -> Path:
    """``driver`` (a Mojo file importing the op's package as ``ops``) built against
    ``include/ops``, for this host or ``cpu_target``."""
    from srm_max.runtime.kernels import run_mojo

    command = ["build", "-I", str(include)]
    if cpu_target:
        command += ["--target-cpu", cpu_target]
    done = run_mojo([*command, str(driver), "-o", str(output)])
    if done.returncode != 0 or not output.is_file():
        raise SystemExit(f"building {driver.name} against {include / PACKAGE} failed:\n{done.stdout}{done.stderr}")
    return output


def driver_parser(description: str, out: Path | None, out_help: str | None = None) -> argparse.ArgumentParser:
    """The options of a benchmark that builds one driver and times it on every core in
    interleaved rounds: ``--rounds``, ``--workers``, ``--cpu-target`` and ``--out``
    (default ``out``); ``parse_driver_args`` reads them."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cpu-target", default=None, help="LLVM CPU name to build for (default: this host)")
    p.add_argument("--out", type=Path, default=out, help=out_help or (f"default {out.name}" if out else None))
    return p


def parse_driver_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``driver_parser``'s options parsed, refusing a non-positive ``--rounds`` or ``--workers``."""
    args = p.parse_args(argv)
    if args.rounds < 1 or args.workers < 1:
        p.error("--rounds and --workers must be positive")
    return args


def value_after(output: str, first: str, key: str) -> float:
    """The number after ``key`` on the first line of a driver's ``output`` that starts with
    the word ``first`` and holds ``key`` (the Mojo drivers print ``first ... key value``)."""
    for line in output.splitlines():
        words = line.split()
        if words[:1] == [first] and key in words:
            return float(words[words.index(key) + 1])
    raise ValueError(f"no '{first} ... {key}' line in the driver's output: {output[-500:]!r}")


def run_driver(binary: Path, args: list, first: str, key: str) -> float:
    """Runs a built driver with ``args`` and returns the number after ``key`` on its line
    that starts with ``first`` (``value_after``); a driver that fails ends the benchmark
    with its exit status and its error output."""
    done = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{binary.name} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return value_after(done.stdout, first, key)


def run_binary(binary: Path, batch: int, calls: int, workers: int, dtype: str = "float32") -> float:
    """The median tokens/s of a run of bench/decode_op.mojo."""
    return run_driver(binary, [batch, calls, workers, dtype], "batch", "median_tok_s")


def summarize(rounds: list[tuple[float, float]]) -> dict:
    """Per-round ratios B/A of (A, B) tokens/s pairs: their median, range and B's wins."""
    ratios = [b / a for a, b in rounds]
    verdict = rounds_verdict(ratios)
    return {
        "a_median_tok_s": statistics.median(a for a, _ in rounds),
        "b_median_tok_s": statistics.median(b for _, b in rounds),
        "ratio_median": verdict["median"],
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "b_faster_rounds": verdict["above_1"],
        "rounds": verdict["rounds"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision of A's mojo/ (default HEAD)")
    p.add_argument("--cpu-target", default=None, help="LLVM CPU name to build for (default: this host)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the matrices' dtype")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=5, help="calls per run; a run reports their median")
    p.add_argument("--out", type=Path, default=None, help="also write the rounds here as JSON")
    p.add_argument("--note", default="", help="what the working tree's op (B) changes, kept in the JSON")
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.rounds < 1 or args.calls < 1 or args.workers < 1:
        p.error("--batches, --rounds, --calls and --workers must be positive")

    b_is = working_tree_change(args.base, args.note)  # before the rounds: the tree may change meanwhile
    with tempfile.TemporaryDirectory(prefix="decode_op_ab-") as tmp:
        tmp = Path(tmp)
        a = build(export_ops(args.base, tmp / "a"), tmp / "decode_op_a", args.cpu_target)
        b = build(link_ops(ROOT / "mojo", tmp / "b"), tmp / "decode_op_b", args.cpu_target)
        rows = []
        for batch in args.batches:
            rounds = []
            for i in range(args.rounds):
                if i % 2 == 0:
                    ta = run_binary(a, batch, args.calls, args.workers, args.dtype)
                    tb = run_binary(b, batch, args.calls, args.workers, args.dtype)
                else:
                    tb = run_binary(b, batch, args.calls, args.workers, args.dtype)
                    ta = run_binary(a, batch, args.calls, args.workers, args.dtype)
                rounds.append((ta, tb))
            row = {"batch": batch, **summarize(rounds), "pairs_tok_s": rounds}
            rows.append(row)
            print(f"batch {batch:4d}: A {row['a_median_tok_s']:,.0f}  B {row['b_median_tok_s']:,.0f} tok/s (medians)"
                  f"   B/A per round: median {row['ratio_median']:.3f}, {row['ratio_min']:.3f}-{row['ratio_max']:.3f},"
                  f" B faster in {row['b_faster_rounds']}/{row['rounds']}", flush=True)
    if args.out:
        write_json(args.out, {
            "what": "the CPU decode op alone (bench/decode_op.mojo): mojo/ at a revision (A) against the "
                    "working tree (B), interleaved rounds",
            "base": args.base, "base_commit": commit_of(args.base), "b": b_is, "dtype": args.dtype,
            "cpu_target": args.cpu_target or "host", "workers": args.workers,
            "calls_per_run": args.calls, "command": command_line(), "machine": machine_info(), "rows": rows,
        })
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
