"""The CPU decode op inside the engine against the same op built alone, in paired runs.

    python -m bench.op_in_engine [--batches 64 256] [--rounds 3] [--calls 5] [--misalign] [--out PATH]

The engine (``Engine``, CPU defaults, bench/cpu_decode.py's model and greedy calls of 32
steps) runs mojo/decode_step.mojo's op inside a MAX graph on weights packed at load;
bench/decode_op.mojo is that op alone, built from the working tree's ``mojo/`` for this
host, on the same shapes. Per batch, ``--rounds`` rounds of: the engine's median of
``--calls`` calls, then one run of the standalone binary (its median of ``--calls``), a
pause before each. The ratio engine / op alone says what running inside MAX costs the op;
about 1.0 is the goal. ``--misalign`` hands MAX every weight 16 bytes past a cache line
(where a large numpy array starts by itself): what ``runtime.device.cache_aligned`` saves.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import build_srm_reference, command_line, machine_info, srm_config, srm_weights, write_json
from bench.cpu_decode import SETTLE_S, MaxDecode
from bench.decode_op_ab import ROOT, build, link_ops, run_binary

STEPS = 32  # bench/decode_op.mojo's steps per call


def misaligned(a: np.ndarray, offset: int = 16) -> np.ndarray:
    """A copy of ``a`` that starts ``offset`` bytes past a cache line."""
    from srm_max.runtime.device import cache_aligned

    raw = cache_aligned(np.empty(a.nbytes + offset, np.uint8))
    out = raw[offset:].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def engine(misalign: bool):
    from srm_max.models.srm import engine as srm_engine

    config = srm_config()
    weights = srm_weights(build_srm_reference(config))
    if not misalign:
        return srm_engine.Engine(config, weights, kernels=True)
    registry = srm_engine.weights_registry(config, weights, "float32", packed=True)
    moved = {name: misaligned(arr) for name, arr in registry.items()}
    original = srm_engine.weights_registry
    srm_engine.weights_registry = lambda *args, **kwargs: moved
    try:
        return srm_engine.Engine(config, weights, kernels=True)
    finally:
        srm_engine.weights_registry = original


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5, help="calls per run; a run reports their median")
    p.add_argument("--workers", type=int, default=2, help="the standalone op's worker threads")
    p.add_argument("--misalign", action="store_true", help="hand MAX the weights 16 bytes past a cache line")
    p.add_argument("--out", type=Path, default=None, help="also write the rounds here as JSON")
    a = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        binary = build(link_ops(ROOT / "mojo", Path(tmp) / "b"), Path(tmp) / "decode_op", None)
        decode = MaxDecode(engine(a.misalign).warmup())
        rows = []
        for batch in a.batches:
            decode.prepare(batch, STEPS)
            rounds = []
            for _ in range(a.rounds):
                time.sleep(SETTLE_S)
                seconds = []
                for _ in range(a.calls):
                    t = time.perf_counter()
                    decode.run()
                    seconds.append(time.perf_counter() - t)
                in_engine = batch * STEPS / statistics.median(seconds)
                time.sleep(SETTLE_S)
                alone = run_binary(binary, batch, a.calls, a.workers)
                rounds.append({"engine_tok_s": in_engine, "op_alone_tok_s": alone, "ratio": in_engine / alone})
                print(f"batch {batch:4d}: engine {in_engine:8,.0f}  op alone {alone:8,.0f} tok/s  "
                      f"engine / op alone {in_engine / alone:.3f}", flush=True)
            ratios = [r["ratio"] for r in rounds]
            rows.append({"batch": batch, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "rounds": rounds})
            print(f"batch {batch:4d}: engine / op alone, median of {len(ratios)} rounds: "
                  f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    if a.out:
        write_json(a.out, {"what": __doc__.split("\n\n")[0], "command": command_line(), "machine": machine_info(),
                           "misalign": a.misalign, "steps": STEPS, "calls": a.calls, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
