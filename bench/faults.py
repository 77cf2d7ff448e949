"""Kill `srm-max convert` at many points of its run; the output must be the old or the new model.

    python -m bench.faults [--points 24]

Writes an old model (bfloat16), times one uninterrupted `srm-max convert --force`
to float32 over it, then repeats that convert ``--points`` times, killing it
(SIGKILL) at evenly spaced moments from start to finish. After each kill the
output directory must hold either the complete old model or the complete new
one (loads, parity certificate present), never a mix and never missing; hidden temporary folders
left by the kill are counted. Writes ``bench/results/faults.json``; exits 1 if
any kill left a broken model.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


from bench.common import RESULTS, command_line, machine_info, write_json  # noqa: E402


def convert_command(source: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "srm_max.cli", "convert", str(source), str(out), "--force",
            "--dtype", "float32", "--parity-tokens", "64"]


def outcome(out: Path, old_dtype: str) -> str:
    """'old', 'new' or 'broken: ...' (a missing output is broken: the destination must
    hold the complete old or new model at every instant)."""
    from srm_max.checkpoints.format import load_checkpoint

    if not out.exists():
        return "broken: the output is missing"
    try:
        ckpt = load_checkpoint(out)
    except Exception as e:  # noqa: BLE001 -- any failure to load is the finding
        return f"broken: {e}"
    if not (out / "parity.json").exists():
        return "broken: no parity.json"
    return "old" if ckpt.dtype == old_dtype else "new"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=24)
    ap.add_argument("--out", type=Path, default=RESULTS / "faults.json")
    args = ap.parse_args(argv)

    import torch

    from srm_max.models.srm.config import SRMConfig
    from srm_max.checkpoints.convert import convert
    from srm_max.reference.srm import SRM

    config = SRMConfig(2048, 128, 4, 2, 256)  # the fault test's model: a few seconds to convert
    work = Path(tempfile.mkdtemp(prefix="srm-faults-"))
    try:
        source = work / "model.pt"
        torch.manual_seed(0)
        torch.save(SRM(config).state_dict(), source)
        old = work / "old"
        convert(source, old, dtype="bfloat16", parity_tokens=16)

        out = work / "run" / "out"
        out.parent.mkdir()
        shutil.copytree(old, out)
        t = time.perf_counter()
        subprocess.run(convert_command(source, out), check=True, stdout=subprocess.DEVNULL)
        full = time.perf_counter() - t
        print(f"uninterrupted convert: {full:.2f} s; killing at {args.points} points", flush=True)

        rows = []
        for i in range(args.points):
            delay = full * (i + 0.5) / args.points
            run = work / f"kill{i}"
            run.mkdir()
            out = run / "out"
            shutil.copytree(old, out)
            process = subprocess.Popen(convert_command(source, out), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            time.sleep(delay)
            process.send_signal(signal.SIGKILL)
            code = process.wait()
            result = outcome(out, "bfloat16")
            hidden = sorted(p.name for p in run.iterdir() if p.name.startswith("."))
            rows.append({"kill_after_s": delay, "exit_code": code, "outcome": result,
                         "hidden_leftovers": hidden})
            print(f"  kill at {delay:5.2f} s: {result}{'  (hidden: ' + ', '.join(hidden) + ')' if hidden else ''}",
                  flush=True)
            shutil.rmtree(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    counts = Counter(r["outcome"] if not r["outcome"].startswith("broken") else "broken" for r in rows)
    summary = {"uninterrupted_seconds": full, "points": args.points, "outcomes": dict(counts),
               "runs_with_hidden_leftovers": sum(bool(r["hidden_leftovers"]) for r in rows)}
    print(f"outcomes: {dict(counts)}; hidden temporary folders left by {summary['runs_with_hidden_leftovers']} "
          f"kills", flush=True)
    write_json(args.out, {"what": "srm-max convert killed at evenly spaced moments over an existing model",
                          "command": command_line(), "machine": machine_info(), "summary": summary,
                          "runs": rows})
    print(f"wrote {args.out}")
    return 1 if counts.get("broken") else 0


if __name__ == "__main__":
    raise SystemExit(main())
