"""CPU decode speed: srm-max against PyTorch (the readable reference and the strongest plain
PyTorch step), and against the machine's limits.

    python -m bench.cpu_decode [--quick] [--profile] [--dtype float32|bfloat16]
                               [--batches 1 2 4 16 64 256] [--steps 32]
                               [--cpu-target x86-64-v3]

One SRM (d 256, 8 layers, 4 heads, n 1024, vocab 4096: 6.3M matmul parameters,
12.6 MFLOP per token), random weights, greedy decode from the same state, timed
side by side in one run (best of ``--repeats``, engines interleaved):

    srm-max          the project's greedy decode (``Engine``, CPU defaults: all
                     ``--steps`` steps of a call in one Mojo op, mojo/decode_step.mojo
                     ``srm_decode_steps``, on weights packed at load)
    srm-max-loop     the decode graph's loop: one whole-step op (``srm_decode_step``)
                     and MAX's sampler ops per step
    srm-max-unfused  that loop with the step as plain MAX ops (matmuls, norms,
                     adds, the Mojo mixer update): the step the whole-step op fuses
    torch-eager-1/2  the readable PyTorch reference's recurrent step (``SRM.step``: it
                     rebuilds the mixer parameters and runs one Linear per head every
                     step) at 1 and 2 threads
    torch-fused-1/2  the strongest eager PyTorch step (bench/torch_decode.py): heads in
                     one projection, mixer coefficients precomputed per position and
                     channel, the mixer update two elementwise ops; at 1 and 2 threads
    torch-compile-1/2
                     that step through ``torch.compile`` (inductor, static shapes, frozen
                     weights, "max-autotune-no-cudagraphs": each matrix product runs
                     the faster of inductor's C++ GEMM and the BLAS), compiled for each
                     batch and thread count before timing, at 1 and 2 threads

Each row gives srm-max's speed over each torch variant at its best thread count:
``srm_max_over_torch_reference`` (the readable reference step), ``_fused`` and
``_compile``, and over the fastest of them all, ``srm_max_over_strongest_torch``.

Limits, measured in the same run:
    roof (batch >= 64)      float32 2048x2048 matmul FLOP/s (the best of numpy and
                            2-thread torch) / FLOPs per token
    streaming (batch 1)     read bandwidth of a weights-sized array (the best of numpy
                            and 2-thread torch sums) / weight bytes per step
each both alongside every batch (timed once per repeat, interleaved with the
engines: the same minutes) and as the best of the whole run (also measured
before and after the engines). This machine's speed drifts by tens of percent
over minutes, so the first is the fair ratio and the second the demanding one;
the table shows both.
``--profile`` adds where the time of a step goes: a MAX graph of the step's
matrix products alone (same weights, same matmul ops as the unfused graph), timed
at each batch against the unfused step (the rest is norms, activations, adds,
the mixer, sampling and per-op overhead); and srm-max's step on a model too small
for its arithmetic to count (d 16, 2 layers): the fixed cost of a step (the op's
phases and its share of the call) against srm-max's step.

``--cpu-target x86-64-v3`` runs the whole comparison at the AVX2 level on a host with
AVX-512: MAX compiles its CPU kernels for that target (``SRM_MAX_CPU_TARGET``) and torch,
inductor, MKL, oneDNN and numpy's OpenBLAS are held to AVX2 (``AVX2_ONLY``), so every
engine and both limits run AVX2 code; the process restarts itself with that environment,
since the libraries read it when they load. It measures the instruction set on this
host's cores, caches and memory, not an AVX2 machine's.

Each timed run starts after a short pause (SETTLE_S), so no engine runs while the
previous one's worker threads still spin. The greedy tokens of all engines, every
torch variant included, must agree (with ``--dtype bfloat16``, where torch stays
float32, the agreement is recorded instead). Writes bench/results/cpu_decode[_bf16].json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np


from bench.common import (RESULTS, build_srm_reference, command_line, machine_info, markdown_table,  # noqa: E402
                    loop_engine, srm_config, srm_matmul_params, srm_weights, unfused_engine, write_json)
from bench.torch_decode import TorchFusedDecode  # noqa: E402

START_POSITION = 100  # decode from a mid-context position (the mixer reads w[t], beta[t])
# A pause before each timed run: MAX's and torch's worker threads keep spinning for a
# while after a call, and must not eat into the next engine's time.
SETTLE_S = 0.25
# What holds torch (its kernels, inductor's generated code, MKL, oneDNN) and numpy's OpenBLAS
# to AVX2 and FMA; each library reads its variable when it loads.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "OPENBLAS_CORETYPE": "Haswell"}
CPU_TARGET_LIMITS = {"x86-64-v3": AVX2_ONLY}
# The torch variants by the engine names' prefixes; each is reported at its best thread count.
TORCH_KINDS = {"reference": "torch-eager-", "fused": "torch-fused-", "compile": "torch-compile-"}


def _best(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


# ------------------------------------------------------------------ engines
class MaxDecode:
    """``Engine.decode``: ``steps`` greedy steps per call from zero states."""

    def __init__(self, engine):
        self.engine = engine

    def prepare(self, batch: int, steps: int):
        from srm_max.runtime.call_types import SamplingArrays

        e = self.engine
        self.args = (np.arange(batch, dtype=np.int64) * 7 % e.config.vocab_size,
                     np.full(batch, START_POSITION, np.int64), e.empty_states(batch),
                     e.sampling_buffers(SamplingArrays.greedy(batch)), steps)
        self.run()  # first call at this batch: allocations

    def run(self) -> np.ndarray:
        return self.engine.decode(*self.args).tokens


class TorchDecode:
    """The readable reference's recurrent step (``SRM.step``), ``steps`` greedy steps, at
    ``threads``."""

    def __init__(self, model, threads: int):
        self.model, self.threads = model, threads

    def prepare(self, batch: int, steps: int):
        import torch

        torch.set_num_threads(self.threads)
        c = self.model.config
        self.ids = torch.arange(batch, dtype=torch.int64) * 7 % c.vocab_size
        self.pos = torch.full((batch,), START_POSITION, dtype=torch.int64)
        self.states = self.model.empty_state(batch)
        self.steps = steps
        self.run()

    def run(self) -> np.ndarray:
        import torch

        torch.set_num_threads(self.threads)
        ids, pos, states, out = self.ids, self.pos, self.states, []
        with torch.inference_mode():
            for _ in range(self.steps):
                logits, states = self.model.step(ids, pos, states)
                ids, pos = logits.argmax(-1), pos + 1
                out.append(ids)
        return torch.stack(out, 1).numpy()


# ------------------------------------------------------------------ limits
class LimitsProbe:
    """The roof and streaming rates: one ``run`` times a 2048x2048 float32 matmul in numpy
    and in 2-thread torch and five sums over a weights-sized array in each, keeping the
    best since ``reset``. Run once per repeat next to the engines, every batch has limits
    measured in the same minutes as its engines (this machine's speed drifts by tens of
    percent); ``measure`` takes the best of ten runs, before and after the engines."""

    def __init__(self, weight_bytes: int, n: int = 2048):
        import torch

        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((n, n), dtype=np.float32)
        self.b = rng.standard_normal((n, n), dtype=np.float32)
        self.ta, self.tb = torch.from_numpy(self.a), torch.from_numpy(self.b)
        self.w = np.ones(weight_bytes // 4, np.float32)
        self.tw = torch.from_numpy(self.w)
        self.flop = 2.0 * n ** 3
        self.bytes = weight_bytes
        self.reset()

    def reset(self):
        self.flops, self.bytes_per_s = 0.0, 0.0

    def measure(self, runs: int = 10) -> dict:
        """The best of ``runs`` fresh runs: the limits before and after the engines."""
        self.reset()
        for _ in range(runs):
            self.run()
        return self.limits()

    def limits(self) -> dict:
        return {"matmul_flops": self.flops, "read_bytes_per_s": self.bytes_per_s}

    def run(self):
        import torch

        torch.set_num_threads(2)
        for mm in (lambda: self.a @ self.b, lambda: self.ta @ self.tb):
            t = time.perf_counter()
            mm()
            self.flops = max(self.flops, self.flop / (time.perf_counter() - t))
        for total in (self.w.sum, self.tw.sum):
            for _ in range(5):  # a sum takes about a millisecond: the first may find cold threads
                t = time.perf_counter()
                total()
                self.bytes_per_s = max(self.bytes_per_s, self.bytes / (time.perf_counter() - t))


def fixed_step_seconds(batches, steps, repeats) -> dict:
    """Seconds per step of srm-max's decode on a model too small for its arithmetic to
    count (d 16, 2 layers, vocab 64): the phases' waits, the greedy choice and the
    step's share of the call, which every step pays whatever the model."""
    from srm_max.models.srm.engine import Engine

    config = srm_config(d_model=16, n_layers=2, n_heads=2, context_length=96, vocab_size=64)
    decode = MaxDecode(Engine(config, srm_weights(build_srm_reference(config)), kernels=True).warmup())
    out = {}
    for b in batches:
        decode.prepare(b, steps)
        out[b] = _best(decode.run, repeats) / steps
    return out


def matmul_chain_seconds(config, weights, batches, steps, repeats) -> dict:
    """Seconds per step of a MAX graph holding only the step's matrix products."""
    from max.driver import Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, Weight, ops
    from srm_max.runtime.compile_cache import load_compiled
    from srm_max.models.srm.schema import derived_weights

    c, dev = config, DeviceRef.CPU()
    names = []
    for l in range(c.n_layers):
        p = f"mixer_blocks.{l}."
        names += [p + "channel_mixing_layer.0.weight", p + "channel_mixing_layer.2.weight",
                  f"mixer_blocks.{l}.token_mixing_layer.proj.weight", p + "token_mixing_layer.out_proj.weight"]
    names.append("output_layer.weight")
    all_w = weights | derived_weights(c, weights)
    with Graph("srm_matmul_chain", input_types=[TensorType(DType.float32, ["batch", c.d_model], dev)]) as g:
        x = g.inputs[0].tensor
        for n in names:
            w = all_w[n]
            x = ops.matmul(x, ops.transpose(Weight(n, DType.float32, list(w.shape), dev), 0, 1))
        g.output(x)
    model = load_compiled(InferenceSession(), g, {n: all_w[n] for n in names})
    out = {}
    for b in batches:
        xb = Buffer.from_numpy(np.ones((b, c.d_model), np.float32))
        model.execute(xb)
        out[b] = _best(lambda: [model.execute(xb) for _ in range(steps)], repeats) / steps
    return out


# ------------------------------------------------------------------ main
def cpu_target_environment(target: str) -> dict[str, str]:
    """The variables that hold MAX's kernels and every library here to ``target``."""
    from srm_max.runtime import cpu_target

    return {cpu_target.ENV: target, **CPU_TARGET_LIMITS[target]}


def _restart_for_cpu_target(target: str, argv: list[str]) -> None:
    """Run this benchmark again in a process whose libraries load held to ``target``
    (returns when this process already is that one)."""
    env = cpu_target_environment(target)
    if all(os.environ.get(k) == v for k, v in env.items()):
        return
    os.execve(sys.executable, [sys.executable, "-m", "bench.cpu_decode", *argv], os.environ | env)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batches 1 4 64, 3 repeats")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also time the step's matmuls alone")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="srm-max's weights (torch stays float32: then tokens are compared, "
                         "not required to agree)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default bench/results/cpu_decode[_bf16][_<cpu target>].json")
    ap.add_argument("--cpu-target", choices=sorted(CPU_TARGET_LIMITS), default=None,
                    help="run every engine and limit at this x86-64 level (see above)")
    a = ap.parse_args(argv)
    if a.cpu_target:
        _restart_for_cpu_target(a.cpu_target, sys.argv[1:] if argv is None else argv)
    if a.quick:
        a.batches, a.repeats = [1, 4, 64], 3
    name = "cpu_decode" + ("" if a.dtype == "float32" else "_bf16") + (f"_{a.cpu_target}" if a.cpu_target else "")
    a.out = a.out or RESULTS / f"{name}.json"

    import torch

    from srm_max.models.srm.engine import Engine

    config = srm_config()
    model = build_srm_reference(config).eval()
    weights = srm_weights(model)
    # The limits first, before any MAX session exists (its worker threads spin).
    params = srm_matmul_params(config)
    flops_per_token = 2 * params
    weight_bytes = params * (4 if a.dtype == "float32" else 2)
    probe = LimitsProbe(weight_bytes)
    limits = [probe.measure()]

    engines = {"srm-max": MaxDecode(Engine(config, weights, a.dtype, kernels=True)),
               "srm-max-loop": MaxDecode(loop_engine(config, weights, a.dtype)),
               "srm-max-unfused": MaxDecode(unfused_engine(config, weights, a.dtype)),
               "torch-eager-1": TorchDecode(model, 1), "torch-eager-2": TorchDecode(model, 2),
               "torch-fused-1": TorchFusedDecode(model, 1, start_position=START_POSITION),
               "torch-fused-2": TorchFusedDecode(model, 2, start_position=START_POSITION),
               "torch-compile-1": TorchFusedDecode(model, 1, compile=True, start_position=START_POSITION),
               "torch-compile-2": TorchFusedDecode(model, 2, compile=True, start_position=START_POSITION)}
    for name in ("srm-max", "srm-max-loop", "srm-max-unfused"):
        t = time.perf_counter()
        engines[name].engine.warmup()
        print(f"{name}: graphs ready in {time.perf_counter() - t:.1f} s", flush=True)

    chain = matmul_chain_seconds(config, weights, a.batches, a.steps, a.repeats) if a.profile else {}
    fixed = fixed_step_seconds(a.batches, a.steps, a.repeats) if a.profile else {}

    rows = []
    for b in a.batches:
        for name, e in engines.items():
            t = time.perf_counter()
            e.prepare(b, a.steps)
            if name.startswith("torch-compile"):
                print(f"batch {b}: {name} compiled in {time.perf_counter() - t:.1f} s", flush=True)
        best = {name: math.inf for name in engines}
        tokens = {}
        probe.reset()
        for _ in range(a.repeats):
            for name, e in engines.items():
                time.sleep(SETTLE_S)
                t = time.perf_counter()
                tokens[name] = e.run()
                best[name] = min(best[name], time.perf_counter() - t)
            time.sleep(SETTLE_S)
            probe.run()
        agreement = {n: float((tokens[n] == tokens["srm-max"]).mean()) for n in engines}
        if a.dtype == "float32" and min(agreement.values()) < 1:
            print(f"batch {b}: greedy tokens differ from srm-max: {agreement}", file=sys.stderr)
            return 1
        tps = {n: b * a.steps / s for n, s in best.items()}
        torch_tps = {kind: max(v for n, v in tps.items() if n.startswith(prefix))
                     for kind, prefix in TORCH_KINDS.items()}
        strongest = max(torch_tps.values())
        row = {"batch": b, "steps": a.steps, "tokens_per_s": tps, "token_agreement_with_srm_max": agreement,
               "torch_tokens_per_s_best_threads": torch_tps,
               **{f"srm_max_over_torch_{kind}": tps["srm-max"] / v for kind, v in torch_tps.items()},
               "srm_max_over_strongest_torch": tps["srm-max"] / strongest,
               "srm_max_over_loop": tps["srm-max"] / tps["srm-max-loop"],
               "srm_max_over_unfused": tps["srm-max"] / tps["srm-max-unfused"],
               "limits_alongside": probe.limits(),
               "percent_of_roof_alongside": 100 * tps["srm-max"] * flops_per_token / probe.flops,
               "percent_of_streaming_alongside": 100 * (tps["srm-max"] / b) * weight_bytes / probe.bytes_per_s}
        if b in chain:  # the unfused graph's step against its matrix products alone
            step_s = b / tps["srm-max-unfused"]
            row["profile"] = {"unfused_step_seconds": step_s, "matmul_chain_seconds": chain[b],
                              "matmul_share_of_unfused_step": chain[b] / step_s,
                              "fused_step_seconds": b / tps["srm-max"],
                              "fixed_step_seconds": fixed[b],
                              "fixed_share_of_fused_step": fixed[b] / (b / tps["srm-max"])}
        rows.append(row)
        print(f"batch {b:4d}: srm-max {tps['srm-max']:9,.0f}  loop {tps['srm-max-loop']:9,.0f}  "
              f"unfused {tps['srm-max-unfused']:9,.0f}  "
              f"torch reference {torch_tps['reference']:9,.0f}  fused {torch_tps['fused']:9,.0f}  "
              f"compile {torch_tps['compile']:9,.0f} tok/s   x{row['srm_max_over_torch_reference']:.2f} "
              f"reference  x{row['srm_max_over_strongest_torch']:.2f} strongest torch   "
              f"{row['percent_of_roof_alongside']:.0f}% roof   {row['percent_of_streaming_alongside']:.0f}% "
              f"streaming (limits measured alongside)", flush=True)

    time.sleep(SETTLE_S)
    limits.append(probe.measure())
    every = limits + [row["limits_alongside"] for row in rows]
    flops = max(m["matmul_flops"] for m in every)
    bandwidth = max(m["read_bytes_per_s"] for m in every)
    roof_tps = flops / flops_per_token
    stream_tps = bandwidth / weight_bytes
    print(f"roof {roof_tps:,.0f} tok/s ({flops / 1e9:.0f} GFLOP/s); weight streaming {stream_tps:,.0f} "
          f"steps/s ({bandwidth / 1e9:.1f} GB/s over {weight_bytes / 1e6:.1f} MB): the best of the "
          f"whole run (before, alongside every batch, after)")
    for row in rows:
        tok_s = row["tokens_per_s"]["srm-max"]
        row["percent_of_roof"] = 100 * tok_s / roof_tps
        row["percent_of_streaming"] = 100 * (tok_s / row["batch"]) / stream_tps

    table = markdown_table(
        ["batch", "srm-max tok/s", "loop tok/s", "unfused tok/s", "torch reference tok/s (best threads)",
         "torch fused tok/s (best threads)", "torch.compile tok/s (best threads)", "srm-max / torch reference",
         "srm-max / strongest torch", "% of roof: alongside / run's best",
         "% of weight streaming: alongside / run's best"],
        [[r["batch"], f"{r['tokens_per_s']['srm-max']:,.0f}", f"{r['tokens_per_s']['srm-max-loop']:,.0f}",
          f"{r['tokens_per_s']['srm-max-unfused']:,.0f}",
          *(f"{r['torch_tokens_per_s_best_threads'][kind]:,.0f}" for kind in TORCH_KINDS),
          f"{r['srm_max_over_torch_reference']:.2f}x", f"{r['srm_max_over_strongest_torch']:.2f}x",
          f"{r['percent_of_roof_alongside']:.0f} / {r['percent_of_roof']:.0f}%",
          f"{r['percent_of_streaming_alongside']:.0f} / {r['percent_of_streaming']:.0f}%"]
         for r in rows])
    print(table)
    write_json(a.out, {
        "what": "SRM greedy decode on the CPU: srm-max vs its graph loop vs its unfused graph vs PyTorch "
                "(the readable reference step, the fused eager step, the fused step compiled), one run",
        "dtype": a.dtype, "weight_bytes_per_step": weight_bytes, "settle_seconds": SETTLE_S,
        "command": command_line(), "machine": machine_info(), "torch_version": torch.__version__,
        "cpu_target": a.cpu_target or "the host's own", "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "instruction_set_limits": {k: os.environ[k] for k in CPU_TARGET_LIMITS.get(a.cpu_target, {})},
        "config": config.to_dict(), "matmul_params": params, "flops_per_token": flops_per_token,
        "start_position": START_POSITION, "repeats": a.repeats,
        "limits_measured": {"before": limits[0], "after": limits[1]},
        "roof": {"flops": flops, "tokens_per_s": roof_tps},
        "streaming": {"bytes_per_s": bandwidth, "steps_per_s": stream_tps},
        "rows": rows, "markdown": table,
    })
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
