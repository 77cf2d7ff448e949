"""Accuracy per compute, side by side: pass@k against wall-clock seconds for an SRM and a
Transformer of the same parameter count, trained with the same recipe and steps.

    python -m bench.accuracy_per_compute            # trains both (minutes each), then samples
    python -m bench.accuracy_per_compute --quick    # a smoke run: few steps, problems and samples

1. Task: two-step arithmetic with a worked answer (``srm_max.rl.worked_arithmetic``),
   ``"\\n347+85-129="`` -> ``"347+85=432;432-129=303\\n"``; held-out test problems never
   appear in the training text. The checker scores the final answer.
2. Training: ``python -m srm_max.cli train --arch srm|transformer`` with identical
   arguments (the Transformer's MLP width is matched to the SRM's parameter count by the
   trainer), both runs side by side with one thread each. Trained models are reused from
   ``--workdir`` when their arguments match.
3. Serving, each model by its best engine here: the SRM by srm-max (``sample_many``, the MAX
   engine, slot refill); the Transformer by the faster, at each k, of a Hugging Face GPT-2
   (``bench.hf_transformer``, checked logit for logit against the reference) under
   ``generate`` with a static KV cache, and a plain PyTorch KV-cache loop (``bench.kv_decode``).
4. For each k in ``--ks``, every engine draws k samples of every test problem, interleaved
   (SRM k, the Transformer's engines k, next k) so all see the same machine load; the
   wall-clock seconds of each such run is its compute. pass@k is the unbiased estimator over
   the samples of the largest run (``srm_max.rl.groups.pass_at_k``): n = max(ks) per problem
   for the SRM, 2n for the Transformer (its two engines sample the same model).
5. Compute-matched gain: at each of the Transformer's measured seconds, the SRM's pass@k
   interpolated on its own pass@k-vs-seconds curve (log seconds), against the Transformer's.

Writes ``bench/results/accuracy_per_compute[-quick].{json,png}`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, command_line, machine_info, write_json
from srm_max.rl import worked_arithmetic as wa
from srm_max.rl.groups import mean_pass_at_k

ARCHS = ("srm", "transformer")


# ------------------------------------------------------------------ pure functions
def pass_at_k_curve(correct_counts, n: int, ks) -> list[float]:
    """Unbiased pass@k averaged over problems, for each k in ``ks``."""
    return [mean_pass_at_k(list(correct_counts), n, k) for k in ks]


def interpolate_log_seconds(seconds, values, at: float) -> float | None:
    """The best of ``values`` reachable within ``at`` seconds: over the running maximum of the
    points sorted by seconds (with that budget, the run of any k that fits can be chosen; timing
    noise can make a larger k finish sooner), linear in log(seconds) between points; held at the
    last value beyond the curve's end (more samples never lower pass@k, so this is a lower
    bound), ``None`` before its start (fewer than one sample per problem is not defined)."""
    s, v = np.asarray(seconds, float), np.asarray(values, float)
    order = np.argsort(s)
    s, v = s[order], np.maximum.accumulate(v[order])
    if at < s[0]:
        return None
    if at >= s[-1]:
        return float(v[-1])
    return float(np.interp(np.log(at), np.log(s), v))


def compute_matched(srm_points, tf_points) -> list[dict]:
    """At each Transformer point (seconds, pass@k), the SRM's pass@k at the same seconds."""
    rows = []
    for tf in tf_points:
        srm = interpolate_log_seconds([p["seconds"] for p in srm_points], [p["pass_at_k"] for p in srm_points],
                                      tf["seconds"])
        gain = None if srm is None or tf["pass_at_k"] == 0 else srm / tf["pass_at_k"] - 1
        rows.append({"seconds": tf["seconds"], "transformer_k": tf["k"], "transformer_pass": tf["pass_at_k"],
                     "srm_pass": srm, "relative_gain": gain,
                     "absolute_gain": None if srm is None else srm - tf["pass_at_k"]})
    return rows


# ------------------------------------------------------------------ data and training
def write_task(workdir: Path, args) -> tuple[list, Path, Path, Path]:
    test = wa.problems(args.problems, args.min_digits, args.max_digits, seed=10_000)
    train = wa.problems(args.train_problems, args.min_digits, args.max_digits, seed=0, exclude=set(test))
    val = wa.problems(1000, args.min_digits, args.max_digits, seed=20_000, exclude=set(test) | set(train))
    workdir.mkdir(parents=True, exist_ok=True)
    paths = workdir / "tokenizer.json", workdir / "train.txt", workdir / "val.txt"
    wa.save_tokenizer(paths[0])
    paths[1].write_text(wa.corpus_text(train))
    paths[2].write_text(wa.corpus_text(val))
    return test, *paths


def train_arguments(args, tokenizer: Path, train_text: Path, val_text: Path) -> list[str]:
    """The ``srm-max train`` arguments both architectures share."""
    return ["--tokenizer", str(tokenizer), "--train-text", str(train_text), "--val-text", str(val_text),
            "--d-model", str(args.d_model), "--n-layers", str(args.n_layers), "--n-heads", str(args.n_heads),
            "--context-length", str(args.context), "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), "--lr", str(args.lr), "--warmup-steps", str(args.warmup),
            "--eval-every", "0", "--eval-max-windows", "200", "--save-every", "0", "--seed", "0",
            "--precision", "fp32", "--threads", "1", "--quiet"]


def train_both(workdir: Path, shared: list[str], data: list[Path], log) -> dict:
    """Train both architectures side by side, or reuse earlier runs with the same arguments
    and the same ``data`` files (their paths stay the same when the task changes)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in data)).hexdigest()
    procs = {}
    for arch in ARCHS:
        out = workdir / arch
        stamp = out / "train_args.json"
        argv = ["--out", str(out), "--arch", arch, *shared]
        key = {"argv": argv, "data_sha256": digest}
        if (out / "results.json").exists() and stamp.exists() and json.loads(stamp.read_text()) == key:
            log(f"{arch}: reusing {out}")
            continue
        out.mkdir(parents=True, exist_ok=True)
        log(f"{arch}: training -> {out}")
        procs[arch] = (subprocess.Popen([sys.executable, "-m", "srm_max.cli", "train", *argv],
                                        env=os.environ | {"OMP_NUM_THREADS": "1"}), stamp, key)
    for arch, (proc, stamp, key) in procs.items():
        if proc.wait():
            raise SystemExit(f"error: training {arch} failed (exit {proc.returncode})")
        stamp.write_text(json.dumps(key))
    return {arch: json.loads((workdir / arch / "results.json").read_text()) for arch in ARCHS}


# ------------------------------------------------------------------ the two engines
def load_srm(workdir: Path):
    import torch

    from srm_max.models.srm.config import SRMConfig
    from srm_max.reference.srm import SRM
    from srm_max.rl.grpo import weights_numpy
    from srm_max.serve.generator import Generator

    cfg = SRMConfig.load(workdir / "srm" / "config.json")
    model = SRM(cfg)
    model.load_state_dict(torch.load(workdir / "srm" / "model.pt", map_location="cpu"))
    # No warmup: sampling never uses the greedy decode graph; the untimed first call loads
    # (or compiles) the graphs it needs.
    return Generator(cfg, weights_numpy(model), dtype="float32", device="cpu", warmup=False)


def load_transformer(workdir: Path):
    """(reference Transformer, its GPT-2 twin, their relative logit error on a probe)."""
    import torch

    from bench import hf_transformer as ht
    from srm_max.reference.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig.load(workdir / "transformer" / "config.json")
    model = Transformer(cfg).eval()
    model.load_state_dict(torch.load(workdir / "transformer" / "model.pt", map_location="cpu"))
    hf = ht.to_gpt2(model)
    probe = torch.tensor(wa.encode("".join(p.line() for p in wa.problems(3, 3, 3, seed=5)))[: cfg.context_length])
    return model, hf, ht.max_logit_error(model, hf, probe[None])


def sample_srm(gen, test, k: int, args, seed: int) -> np.ndarray:
    """Correct counts [P] of k samples per problem."""
    from srm_max.serve.sample_many import sample_many

    counts = np.zeros(len(test), int)
    for s in sample_many(gen, [p.prompt_ids() for p in test], k, max_batch=args.max_batch,
                         max_new_tokens=args.max_new, temperature=args.temperature, seed=seed,
                         stop=[wa.NEWLINE_ID]):
        counts[s.prompt_index] += int(test[s.prompt_index].verify(s.ids))
    return counts


def sample_torch(module, model, test, k: int, args, seed: int) -> np.ndarray:
    """Correct counts [P] through ``bench.hf_transformer`` or ``bench.kv_decode`` (same contract)."""
    out = module.sample(model, [p.prompt_ids() for p in test], k, args.max_new, args.temperature, wa.NEWLINE_ID,
                        seed=seed, max_batch=args.max_batch)
    return np.array([sum(int(p.verify(c)) for c in samples) for p, samples in zip(test, out)])


ENGINES = {"srm": "srm-max sample_many (MAX engine, slot refill)",
           "transformer-kv": "plain PyTorch KV-cache decode (bench/kv_decode.py)",
           "transformer-hf": "HF transformers GPT2LMHeadModel.generate, static cache (bench/hf_transformer.py)"}


def best_transformer(kv_runs, hf_runs) -> list[dict]:
    """Per k, the faster of the Transformer's two engines (they sample the same model)."""
    return [dict(min(a, b, key=lambda r: r["seconds"])) for a, b in zip(kv_runs, hf_runs)]


# ------------------------------------------------------------------ the measurement
def measure(args, log) -> dict:
    import torch

    from bench import hf_transformer as ht
    from bench import kv_decode as kv

    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir).expanduser()
    test, tok, train_text, val_text = write_task(workdir, args)
    training = train_both(workdir, train_arguments(args, tok, train_text, val_text), [tok, train_text, val_text],
                          log)
    gen = load_srm(workdir)
    model, hf, logit_error = load_transformer(workdir)
    log(f"GPT-2 vs reference Transformer: max relative logit error {logit_error:.2e}")
    if logit_error > 1e-4:
        raise SystemExit(f"error: the GPT-2 mapping disagrees with the reference (logit error {logit_error:.2e})")
    samplers = {"srm": lambda k, s: sample_srm(gen, test, k, args, s),
                "transformer-kv": lambda k, s: sample_torch(kv, model, test, k, args, s),
                "transformer-hf": lambda k, s: sample_torch(ht, hf, test, k, args, s)}
    for name in ENGINES:  # first calls: graph loading, allocator and cache set-up, not timed
        samplers[name](1, 999)
    runs = {name: [] for name in ENGINES}
    counts = {}
    for k in args.ks:
        for name in ENGINES:  # interleaved, so every engine sees the same machine load
            t = time.perf_counter()
            c = samplers[name](k, 1000 + k)
            sec = time.perf_counter() - t
            runs[name].append({"k": k, "engine": name, "seconds": sec, "samples": k * len(test),
                               "samples_per_s": k * len(test) / sec, "observed_pass": float(np.mean(c > 0)),
                               "sample_accuracy": float(c.sum() / (k * len(test)))})
            counts[name] = c
            log(f"  {name:14s} k={k:3d}: {sec:7.2f}s, {k * len(test) / sec:7.0f} samples/s, "
                f"correct {c.sum() / (k * len(test)):.3f}, any-correct {np.mean(c > 0):.3f}")
    n = max(args.ks)
    # The Transformer's two engines sample one model: their 2n samples per problem estimate its pass@k.
    pooled = {"srm": (counts["srm"], n), "transformer": (counts["transformer-kv"] + counts["transformer-hf"], 2 * n)}
    timed = {"srm": runs["srm"], "transformer": best_transformer(runs["transformer-kv"], runs["transformer-hf"])}
    models = {}
    for arch in ARCHS:
        c, total = pooled[arch]
        curve = pass_at_k_curve(c, total, range(1, n + 1))
        for r in timed[arch]:
            r["pass_at_k"] = curve[r["k"] - 1]
        models[arch] = {"parameters": training[arch]["num_parameters"], "config": training[arch]["model_config"],
                        "train_seconds": training[arch]["train_time_s"], "val_loss": training[arch]["val_loss"],
                        "single_sample_accuracy": curve[0], "samples_per_problem": total,
                        "correct_counts": c.tolist(), "pass_at_k": curve, "timed": timed[arch]}
    return {"command": command_line(), "machine": machine_info(),
            "task": {"name": "worked two-step arithmetic", "min_digits": args.min_digits,
                     "max_digits": args.max_digits, "test_problems": len(test),
                     "train_problems": args.train_problems, "example": test[0].prompt + test[0].worked},
            "train_recipe": {k: getattr(args, k) for k in ("steps", "batch_size", "lr", "warmup", "context")},
            "sampling": {"temperature": args.temperature, "max_new_tokens": args.max_new, "n": n,
                         "max_batch": args.max_batch, "torch_threads": args.threads, "engines": ENGINES},
            "gpt2_logit_error": logit_error, "engine_runs": runs, "models": models,
            "compute_matched": compute_matched(timed["srm"], timed["transformer"])}


def table(r) -> str:
    m = r["models"]
    lines = [f"Task: {r['task']['name']}, {r['task']['min_digits']}-{r['task']['max_digits']} digit operands, "
             f"{r['task']['test_problems']} held-out problems, T={r['sampling']['temperature']}, "
             f"n={r['sampling']['n']} samples per problem.", ""]
    lines += ["| model | parameters | train s | val loss | single-sample acc |", "|---|---|---|---|---|"]
    for arch in ARCHS:
        lines.append(f"| {arch} | {m[arch]['parameters']:,} | {m[arch]['train_seconds']:.0f} | "
                     f"{m[arch]['val_loss']:.3f} | {m[arch]['single_sample_accuracy']:.3f} |")
    lines += ["", "| k | SRM s | SRM pass@k | Transformer s (engine) | Transformer pass@k | "
              "SRM pass@k at the Transformer's s | gain |", "|---|---|---|---|---|---|---|"]
    for s, t, c in zip(m["srm"]["timed"], m["transformer"]["timed"], r["compute_matched"]):
        srm_at = "-" if c["srm_pass"] is None else f"{c['srm_pass']:.3f}"
        gain = "-" if c["relative_gain"] is None else f"{100 * c['relative_gain']:+.0f} %"
        lines.append(f"| {s['k']} | {s['seconds']:.2f} | {s['pass_at_k']:.3f} | {t['seconds']:.2f} "
                     f"({t['engine'].removeprefix('transformer-')}) | "
                     f"{t['pass_at_k']:.3f} | {srm_at} | {gain} |")
    return "\n".join(lines)


def plot(r, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    for arch, style in zip(ARCHS, ("o-", "s--")):
        m = r["models"][arch]
        label = f"{arch} ({m['parameters']:,} params)"
        ax[0].plot([t["seconds"] for t in m["timed"]], [t["pass_at_k"] for t in m["timed"]], style, label=label)
        for t in m["timed"]:
            ax[0].annotate(f"k={t['k']}", (t["seconds"], t["pass_at_k"]), fontsize=7)
        ax[1].plot(range(1, len(m["pass_at_k"]) + 1), m["pass_at_k"], style[1:] or "-", label=label)
    curve = r["models"]["transformer"]["pass_at_k"]
    for name, style in (("transformer-kv", ":"), ("transformer-hf", "-.")):
        runs = r["engine_runs"][name]
        ax[0].plot([t["seconds"] for t in runs], [curve[t["k"] - 1] for t in runs], style, color="gray",
                   alpha=0.6, label=f"{name} (engine alone)")
    ax[0].set(xscale="log", xlabel=f"wall-clock seconds, {r['task']['test_problems']} problems x k samples",
              ylabel="pass@k", title="pass@k vs compute (each model on its best engine)")
    ax[1].set(xscale="log", xlabel="k (samples per problem)", ylabel="pass@k (unbiased)", title="pass@k vs samples")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (few steps, problems, samples)")
    ap.add_argument("--workdir", default="~/.cache/srm-max-accuracy-per-compute",
                    help="task files and trained models (reused when the arguments match)")
    ap.add_argument("--min-digits", type=int, default=1)
    ap.add_argument("--max-digits", type=int, default=2)
    ap.add_argument("--problems", type=int, default=100, help="held-out test problems")
    ap.add_argument("--train-problems", type=int, default=100_000)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ks", default="1,2,4,8,16,32,64", help="samples per problem of the timed runs")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-batch", type=int, default=1024, help="largest decode batch of either engine")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the Transformer (1: on a shared, oversubscribed CPU more "
                         "threads wait on each other)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.workdir = args.workdir.rstrip("/") + "-quick"
        args.problems, args.train_problems, args.steps, args.warmup, args.ks = 20, 5000, 60, 10, "1,2,4"
    try:
        args.ks = sorted({int(k) for k in args.ks.split(",")})
    except ValueError:
        raise SystemExit(f"error: --ks must be comma-separated integers, got {args.ks!r}") from None
    if not args.ks or args.ks[0] < 1:
        raise SystemExit("error: --ks must be integers >= 1")
    args.max_new = wa.max_length(args.max_digits) - (1 + 3 * args.max_digits + 3)
    if wa.max_length(args.max_digits) > args.context:
        raise SystemExit(f"error: --context {args.context} is shorter than a problem with "
                         f"{args.max_digits}-digit operands ({wa.max_length(args.max_digits)} tokens)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    r = measure(args, log)
    name = "accuracy_per_compute" + ("-quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / f"{name}.json", r)
    plot(r, args.out / f"{name}.png")
    print(table(r))
    return r


if __name__ == "__main__":
    main()
