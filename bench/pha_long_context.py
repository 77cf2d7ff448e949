"""PHA at long context on the MAX engines: PHA vs the same model without its GSS branch
(attention alone) vs the SRM, at contexts 512 .. 8,192 (docs/pha_engine.md).

Per model and context n (each engine built at context n, random weights: speed and
memory depend only on shapes):
  - decode state bytes per sample (the engine's state tensor for one sample),
  - prefill tokens/s at batch 1 (one prompt of n tokens),
  - decode tokens/s at batch 1 and 16: ``--steps`` tokens per call from states at
    position n - steps - 1 (zero states from ``empty_states``: a step's cost does not
    depend on what the state holds, and the PHA's attention reads all n cache rows),
    for the PHA models on each ``--paths``: "graph", one plain-op decode graph call per
    step (graphs/pha/decode.py), and "op", every step of a call in one Mojo op
    (mojo/pha_decode_step.mojo, ``PHAEngine(kernels=True)``);
  - against the memory-streaming limit: the bytes a step must read (every matrix it
    multiplies by, once per step whatever the batch; per sample its GSS state, read and
    written, and the KV rows before its position) over the read bandwidth measured in
    the same run (the best 2-thread torch sum over a 256 MiB array, before and after
    each context's engines): ``percent_of_streaming_b{B}`` = that time / the step's.
Best of ``--repeats`` timed calls after one warm-up call; graphs are compiled (or
loaded from the cache) before anything is timed, and the PHA's are compiled per
context (the KV cache length is a static shape). Writes
bench/results/pha_long_context_max[-quick].json and .png.

    python -m bench.pha_long_context            # d 256, 4 blocks, contexts 512, 2048, 8192
    python -m bench.pha_long_context --quick    # d 64, 2 blocks, context 128: a smoke run
    python -m bench.pha_long_context --state-only   # state bytes only: no compile, no timing
    python -m bench.pha_long_context --models pha --no-prefill --contexts 512 2048   # decode paths only
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, command_line, machine_info, write_json  # noqa: E402

MODELS = ("pha", "pha-attn", "srm")
PATHS = ("graph", "op")
STREAM_BYTES = 256 << 20  # far beyond the caches


def configs(name: str, n: int, quick: bool):
    from srm_max.models.pha.config import PHAConfig
    from srm_max.models.srm.config import SRMConfig

    d, layers, vocab = (64, 2, 512) if quick else (256, 4, 4096)
    # PHA: the paper's block (GSS + GQA + Dual-FFN), PHAConfig defaults (F 4d, H d/4, N 512
    # or 64 in quick mode); pha-attn: the same without GSS.
    pha = dict(vocab_size=vocab, d_model=d, n_layers=layers, context_length=n, n_q_heads=4, n_kv_heads=2,
               dss_state_size=64 if quick else 512)
    if name == "pha":
        return PHAConfig(**pha)
    if name == "pha-attn":
        return PHAConfig(**pha, branches=("attn", "ffn"))
    return SRMConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=4, context_length=n)


def engine_of(name: str, config, path: str = "graph"):
    """A MAX engine with random weights (the PyTorch references' initialisation); a PHA
    one decodes on ``path`` (see the module docs)."""
    import torch

    if name == "srm":
        from srm_max.models.srm.engine import Engine
        from srm_max.reference.srm import random_srm

        model, cls = random_srm(config, 0, decay_low=0.9, bias_scale=0.02), Engine
    else:
        from srm_max.models.pha.engine import PHAEngine
        from srm_max.reference.pha import PHA

        torch.manual_seed(0)
        model, cls = PHA(config), PHAEngine
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if name == "srm":
        return cls(config, weights, dtype="float32", device="cpu")
    engine = cls(config, weights, dtype="float32", device="cpu", kernels=path == "op")
    assert engine.steps_in_one_op == (path == "op")
    return engine


def matrix_bytes(name: str, config) -> int:
    """float32 bytes of every matrix a decode step multiplies by (the output head included;
    the embedding row is a gather)."""
    c = config
    if name == "srm":
        d, f, L, V = c.d_model, c.ffn_dim, c.n_layers, c.vocab_size
        return 4 * (L * (2 * d * f + 2 * d * d) + V * d)
    E, F, H = c.d_model, c.gss_expansion_dim, c.gss_hidden_dim
    dq, dk = c.n_q_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_block = 2 * E * sum(c.ffn_dims)
    if "gss" in c.branches:
        per_block += F * E + H * E + F * H + E * F
    if "attn" in c.branches:
        per_block += 2 * dq * E + 2 * dk * E
    return 4 * (c.n_layers * per_block + c.vocab_size * E)


def sample_bytes(name: str, config, position: int) -> int:
    """float32 bytes one sample's step reads of its state at ``position``: the SRM's and
    the GSS state read and written, the KV rows before it."""
    c = config
    if name == "srm":
        return 4 * 2 * c.n_layers * c.d_model
    gss = 2 * c.gss_hidden_dim * c.dss_state_size if "gss" in c.branches else 0  # real and imaginary parts
    kv = 2 * c.n_kv_heads * min(position, c.context_length) * c.head_dim if "attn" in c.branches else 0
    return 4 * c.n_layers * (2 * gss + kv)


def stream_bytes_per_s(repeats: int = 5) -> float:
    """The best read bandwidth of 2-thread torch sums over STREAM_BYTES."""
    import torch

    torch.set_num_threads(2)
    a = torch.ones(STREAM_BYTES // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = max(best, STREAM_BYTES / (time.perf_counter() - t))
    return best


def graphs_used(engine, prefill: bool = True) -> list:
    """The graphs ``measure`` loads: prefill, and the one a greedy decode runs (each cold
    compile takes minutes here, so the sampler graph and the unused decode are left out)."""
    greedy = "decode_steps" if engine.steps_in_one_op else "decode"
    return ([engine.graph_job("prefill")] if prefill else []) + [engine.graph_job(greedy)]


def best_of(repeats: int, run) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(name: str, engine, n: int, steps: int, batches, repeats: int, rng, timed: bool = True,
            prefill: bool = True, path: str = "graph") -> dict:
    from srm_max.runtime.compiled import SamplingArrays

    c = engine.config
    row = {"model": name, "path": path, "context": n,
           "state_bytes_per_sample": int(engine.host(engine.empty_states(1)).nbytes)}
    if not timed:
        return row
    if prefill:
        prompt = [rng.integers(0, c.vocab_size, n).tolist()]
        row["prefill_seconds"] = best_of(repeats, lambda: engine.prefill(prompt))
        row["prefill_tokens_per_s"] = n / row["prefill_seconds"]
    for B in batches:
        ids = rng.integers(0, c.vocab_size, B).astype(np.int64)
        start = n - steps - 1
        pos = np.full(B, start, np.int64)
        states = engine.empty_states(B)
        greedy = SamplingArrays.greedy(B)
        t = best_of(repeats, lambda: engine.decode(ids, pos, states, greedy, steps))
        row[f"decode_tokens_per_s_b{B}"] = B * steps / t
        row[f"step_ms_b{B}"] = 1e3 * t / steps
        # the steps read the KV rows before positions start .. start + steps - 1
        step_bytes = matrix_bytes(name, c) + B * sum(sample_bytes(name, c, start + s) for s in range(steps)) / steps
        row[f"bytes_per_step_b{B}"] = int(step_bytes)
    return row


def ratios(rows: list[dict], n: int) -> list[dict]:
    """At context n, PHA over attention alone for every measured quantity (the paper's
    claims at 8,192: state 0.78x, throughput 1.239x)."""
    at = {r["model"]: r for r in rows if r["context"] == n and r.get("path", "graph") == "graph"}
    if "pha" not in at or "pha-attn" not in at:
        return []
    pha, attn = at["pha"], at["pha-attn"]
    return [{"context": n} | {k: pha[k] / attn[k] for k in pha
                              if k not in ("model", "path", "context", "prefill_seconds") and k in attn and attn[k]}]


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = [("state_bytes_per_sample", "decode state per sample (MiB)", 1 / (1 << 20)),
            ("prefill_tokens_per_s", "prefill tokens/s, batch 1", 1.0),
            ("decode_tokens_per_s_b1", "decode tokens/s, batch 1", 1.0),
            ("decode_tokens_per_s_b16", "decode tokens/s, batch 16", 1.0)]
    keys = [k for k in keys if any(k[0] in r for r in rows)]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    axes = axes[0]
    for ax, (key, label, scale) in zip(axes, keys):
        for name in MODELS:
            for path in PATHS:
                pts = sorted((r["context"], r[key] * scale) for r in rows
                             if r["model"] == name and r.get("path", "graph") == path and key in r)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name if path == "graph" else f"{name} ({path})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, context 128")
    ap.add_argument("--contexts", type=int, nargs="*", help="default: 512 2048 8192")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    ap.add_argument("--paths", nargs="*", default=list(PATHS), choices=PATHS,
                    help="the PHA models' decode paths (the SRM has one)")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--no-prefill", action="store_true", help="time decode only")
    ap.add_argument("--steps", type=int, default=16, help="decode tokens per call")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--state-only", action="store_true",
                    help="only the decode state per sample (nothing compiled or timed)")
    ap.add_argument("--out", type=Path, help="the JSON path (the plot goes next to it)")
    ap.add_argument("--note", default="", help="a remark stored in the JSON (e.g. why repeats were reduced)")
    args = ap.parse_args(argv)
    contexts = args.contexts or ([128] if args.quick else [512, 2048, 8192])
    batches = tuple(args.batches)
    suffix = ("-quick" if args.quick else "") + ("-state" if args.state_only else "")
    out = args.out or RESULTS / f"pha_long_context_max{suffix}.json"
    from srm_max.runtime.precompile import precompile

    rng = np.random.default_rng(0)
    result = {"command": command_line(), "machine": machine_info(), "quick": args.quick,
              "steps_per_call": args.steps, "repeats": args.repeats, "note": args.note,
              "state_only": args.state_only, "batches": list(batches), "configs": {}, "compile_seconds": {},
              "stream_bytes_per_s": {}, "rows": [], "pha_vs_attention": []}
    prefill = not args.no_prefill
    for n in contexts:
        engines = {(name, path): engine_of(name, configs(name, n, args.quick), path)
                   for name in args.models for path in (["graph"] if name == "srm" else args.paths)}
        if not args.state_only:
            t0 = time.perf_counter()
            precompile([job for e in engines.values() for job in graphs_used(e, prefill)])
            result["compile_seconds"][str(n)] = round(time.perf_counter() - t0, 1)
            print(f"context {n}: graphs ready in {time.perf_counter() - t0:.0f} s", flush=True)
        bandwidth = 0.0 if args.state_only else stream_bytes_per_s()
        rows = []
        for (name, path), engine in engines.items():
            result["configs"][name] = {k: v for k, v in vars(engine.config).items()}
            row = measure(name, engine, n, args.steps, batches, args.repeats, rng, timed=not args.state_only,
                          prefill=prefill and path == "graph", path=path)
            rows.append(row)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        if not args.state_only:
            # the best bandwidth of the minutes around the engines
            bandwidth = max(bandwidth, stream_bytes_per_s())
            result["stream_bytes_per_s"][str(n)] = bandwidth
            for row in rows:
                for B in batches:
                    limit = 1e3 * row[f"bytes_per_step_b{B}"] / bandwidth
                    row[f"streaming_limit_ms_b{B}"] = limit
                    row[f"percent_of_streaming_b{B}"] = 100 * limit / row[f"step_ms_b{B}"]
        result["rows"] += rows
        write_json(out, result)  # partial results survive an interrupted run
        del engines
        result["pha_vs_attention"] += ratios(result["rows"], n)
    write_json(out, result)
    png = plot(result["rows"], out.with_suffix(".png"), f"MAX engines, CPU: {result['machine']['processor']}")
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return result


if __name__ == "__main__":
    main()
