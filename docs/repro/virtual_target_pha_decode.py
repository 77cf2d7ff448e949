"""Reproducer: the PHA decode graph compiled for a virtual CPU target crashes on a later call.

    SRM_MAX_CPU_TARGET=x86-64-v3 python docs/repro/virtual_target_pha_decode.py all attn gss ffn

For each variant (a PHA config: ``all`` = every branch, ``attn`` / ``gss`` / ``ffn`` =
that branch alone, no FFN unless named; ``gss,ffn`` etc. combine them) a child process
builds the tiny PHA engine (d 16, 1 block, context 32, random weights), then runs the
same one-step decode call ``--calls`` times from zero states (``--prefill``: a prefill of a
random prompt and a 3-step decode from its states per call; ``--engines 2``: two engines
on the same weights, called in turn; ``--preload``: every graph loaded before the first
call, which avoids the fault), and this process reports
whether the child finished or which signal ended it (and after how many calls). The
children inherit ``SRM_MAX_CPU_TARGET``, so without it they compile for the host.
Each variant is a cold compile of minutes the first time (then cached as a .mef file).
docs/avx2_crash.md says what was observed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def child(branches: tuple[str, ...], calls: int, layers: int, context: int, engines: int, prefill: bool,
          preload: bool) -> None:
    import numpy as np

    from srm_max.models.pha.config import PHAConfig
    from srm_max.models.pha.engine import PHAEngine
    from srm_max.models.pha.schema import checkpoint_shapes
    from srm_max.runtime.compiled import SamplingArrays

    extra = {} if "ffn" in branches else {"ffn_dims": ()}
    config = PHAConfig(vocab_size=40, d_model=16, n_layers=layers, context_length=context, n_q_heads=4,
                       n_kv_heads=2, dss_state_size=8, branches=branches, **extra)
    rng = np.random.default_rng(0)
    weights = {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in checkpoint_shapes(config).items()}
    # several engines on the same weights: each its own InferenceSession, as separate
    # engines in one process are
    all_engines = [PHAEngine(config, weights, dtype="float32", device="cpu") for _ in range(engines)]
    for engine in all_engines:  # without --preload, each graph loads at its first call, as MAX allows
        engine.preload_under_virtual_target = preload
    for i in range(calls):
        engine = all_engines[i % engines]
        if prefill:  # a prompt of 1-19 tokens, then a 3-step decode from its states
            prompt = list(rng.integers(0, config.vocab_size, size=int(rng.integers(1, 20))))
            pre = engine.prefill([prompt])
            engine.decode(pre.next_ids, np.array([len(prompt)], np.int64), pre.states, SamplingArrays.greedy(1), 3)
        else:
            engine.decode(np.ones(1, np.int64), np.zeros(1, np.int64), engine.empty_states(1),
                          SamplingArrays.greedy(1), 1)
        print(f"call {i + 1} done", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", default=["all"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--engines", type=int, default=1, help="engines in the process, called in turn")
    ap.add_argument("--prefill", action="store_true", help="each call: a prefill, then a 3-step decode")
    ap.add_argument("--preload", action="store_true",
                    help="load every graph before the first call (what PHAEngine does under a virtual target)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        branches = ("gss", "attn", "ffn") if args.child == "all" else tuple(args.child.split(","))
        child(branches, args.calls, args.layers, args.context, args.engines, args.prefill, args.preload)
        return
    target = os.environ.get("SRM_MAX_CPU_TARGET") or "the host CPU"
    for variant in args.variants:
        proc = subprocess.run([sys.executable, __file__, "--child", variant, "--calls", str(args.calls),
                               "--layers", str(args.layers), "--context", str(args.context),
                               "--engines", str(args.engines)] + (["--prefill"] if args.prefill else [])
                              + (["--preload"] if args.preload else []),
                              capture_output=True, text=True)
        done = proc.stdout.count("done")
        result = "ran" if proc.returncode == 0 else (
            f"signal {-proc.returncode} after {done} calls" if proc.returncode < 0 else f"exit {proc.returncode}")
        print(f"{variant:12s} compiled for {target}: {result}", flush=True)
        if proc.returncode > 0:
            print(proc.stderr[-2000:])


if __name__ == "__main__":
    main()
