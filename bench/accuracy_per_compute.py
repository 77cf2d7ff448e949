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
   engine, slot refill); the Transformer by the fastest, at each k, of a Hugging Face GPT-2
   (``bench.hf_transformer``, checked logit for logit against the reference) under
   ``generate`` with a static KV cache, a plain PyTorch KV-cache loop (``bench.kv_decode``),
   and llama.cpp (``bench.llama_cpp_transformer``: the model exported to GGUF, float32,
   ``--llama-batch`` sequences per batch in a unified float32 KV cache, flash attention;
   ``--transformer-engines kv,hf`` leaves it out where llama-cpp-python is not installed).
   All Transformer engines run ``--threads`` threads.
4. For each k in ``--ks``, every engine draws k samples of every test problem, interleaved
   (SRM k, the Transformer's engines k, next k) so all see the same machine load; the
   wall-clock seconds of each such run is its compute. pass@k is the unbiased estimator over
   the samples of the largest run (``srm_max.rl.groups.pass_at_k``): n = max(ks) per problem
   for the SRM, 2n for the Transformer (its PyTorch and HF engines compute the same model;
   each engine has its own seeds, so the 2n samples are independent).
   llama.cpp computes it with ggml's approximate GELU (see its module), so its samples are
   kept apart: its own pass@k is reported beside the pooled one, not mixed into it.
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
        # --force: a run with other arguments or data is replaced, not resumed
        procs[arch] = (subprocess.Popen([sys.executable, "-m", "srm_max.cli", "train", *argv, "--force"],
                                        env=os.environ | {"OMP_NUM_THREADS": "1"}), stamp, key)
    for arch, (proc, stamp, key) in procs.items():
        if proc.wait():
            raise SystemExit(f"error: training {arch} failed (exit {proc.returncode})")
        stamp.write_text(json.dumps(key))
    return {arch: json.loads((workdir / arch / "results.json").read_text()) for arch in ARCHS}


# ------------------------------------------------------------------ the engines
def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


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


def probe_ids(context_length: int) -> list[int]:
    """A context's worth of task text, the ids every engine's logits are checked on."""
    return wa.encode("".join(p.line() for p in wa.problems(3, 3, 3, seed=5)))[:context_length]


def load_transformer(workdir: Path):
    """(reference Transformer, its GPT-2 twin, their relative logit error on a probe)."""
    import torch

    from bench import hf_transformer as ht
    from srm_max.reference.transformer import Transformer, TransformerConfig

    cfg = TransformerConfig.load(workdir / "transformer" / "config.json")
    model = Transformer(cfg).eval()
    model.load_state_dict(torch.load(workdir / "transformer" / "model.pt", map_location="cpu"))
    hf = ht.to_gpt2(model)
    probe = torch.tensor(probe_ids(cfg.context_length))
    return model, hf, ht.max_logit_error(model, hf, probe[None])


def load_llama_cpp(model, workdir: Path, args):
    """(llama.cpp engine over ``model`` exported to GGUF, a record of its settings and of the
    relative logit errors on the probe, with flash attention on and off, against the exact
    reference and against the reference with ggml's GELU, the function llama.cpp computes)."""
    import torch

    from bench import llama_cpp_transformer as lt

    cfg = model.config
    path = lt.write_gguf(model, workdir / "transformer" / "model.gguf")
    ids = probe_ids(cfg.context_length)
    with torch.no_grad():
        exact = model(torch.tensor([ids]))[0]
        ggml = lt.with_ggml_gelu(model)(torch.tensor([ids]))[0]
    rel = lambda got, ref: float((got - ref).abs().max() / ref.abs().max())  # noqa: E731
    errors = {"reference_with_ggml_gelu_vs_reference": rel(ggml, exact)}
    engine = None
    for fa in ("off", "on"):
        e = lt.LlamaCppEngine(path, cfg.context_length, n_seq_max=min(args.llama_batch, args.max_batch,
                                                                       lt.MAX_SEQUENCES),
                              threads=args.threads, flash_attn=fa == "on", kv_unified=True)
        got = torch.from_numpy(e.logits(ids))
        errors[f"flash_attn_{fa}"] = {"vs_reference": rel(got, exact), "vs_reference_with_ggml_gelu": rel(got, ggml)}
        if fa == args.llama_flash_attn:
            engine = e
        else:
            e.close()
    return engine, {"logit_errors": errors, "used": errors[f"flash_attn_{args.llama_flash_attn}"]}


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
    """Correct counts [P] through ``bench.hf_transformer``, ``bench.kv_decode`` or
    ``bench.llama_cpp_transformer`` (the same contract; ``model`` is what each serves)."""
    out = module.sample(model, [p.prompt_ids() for p in test], k, args.max_new, args.temperature, wa.NEWLINE_ID,
                        seed=seed, max_batch=args.max_batch)
    return np.array([sum(int(p.verify(c)) for c in samples) for p, samples in zip(test, out)])


ENGINES = {"srm": "srm-max sample_many (MAX engine, slot refill)",
           "transformer-kv": "plain PyTorch KV-cache decode (bench/kv_decode.py)",
           "transformer-hf": "HF transformers GPT2LMHeadModel.generate, static cache (bench/hf_transformer.py)",
           "transformer-llama": "llama.cpp via llama-cpp-python, GGUF float32, batched sequences "
                                "(bench/llama_cpp_transformer.py)"}
TRANSFORMER_ENGINES = {"kv": "transformer-kv", "hf": "transformer-hf", "llama": "transformer-llama"}
# the engines computing the reference exactly: their samples are pooled for the Transformer's pass@k
EXACT = ("transformer-kv", "transformer-hf")


def best_transformer(*engine_runs) -> list[dict]:
    """Per k, the fastest of the Transformer's engines (each a list of runs, one per k)."""
    return [dict(min(runs, key=lambda r: r["seconds"])) for runs in zip(*engine_runs)]


# ------------------------------------------------------------------ the measurement
def measure(args, log) -> dict:
    import torch

    from bench import hf_transformer as ht
    from bench import kv_decode as kv

    engines = ["srm", *args.transformer_engines]
    if not set(EXACT) <= set(engines):
        raise SystemExit("error: --transformer-engines must include kv and hf (their samples give pass@k)")
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
    llama = None
    if "transformer-llama" in engines:
        from bench import llama_cpp_transformer as lt

        engine, llama = load_llama_cpp(model, workdir, args)
        llama.update(engine.params, llama_cpp_python=_version("llama_cpp_python"), gguf=_version("gguf"))
        err = llama["used"]
        log(f"llama.cpp vs reference: max relative logit error {err['vs_reference']:.2e} "
            f"({err['vs_reference_with_ggml_gelu']:.2e} against the reference with ggml's GELU; all: "
            f"{llama['logit_errors']})")
        # ggml's float16-table GELU alone moves the logits by about 1e-3 on a trained model, and
        # float32 rounding can move a GELU input across a float16 step; a wrong export is O(1) off
        if err["vs_reference"] > 1e-2:
            raise SystemExit(f"error: llama.cpp disagrees with the reference (logit error {err['vs_reference']:.2e})")
        samplers["transformer-llama"] = lambda k, s: sample_torch(lt, engine, test, k, args, s)
    # First calls, not timed: graph loading or compiling, allocator and cache set-up. The MAX
    # engine compiles a graph per pool size (min(max_batch, problems x k)), once, cached on disk:
    # it runs every k; the others have no per-shape compile and run k = 1.
    for k in args.ks:
        samplers["srm"](k, 999)
    for name in engines[1:]:
        samplers[name](1, 999)
    runs = {name: [] for name in engines}
    counts = {}
    for k in args.ks:
        for name in engines:  # interleaved, so every engine sees the same machine load
            # a seed per engine and k: the PyTorch and HF engines draw identical tokens from one
            # seed (same logits, same torch sampler), which would pool one set of samples twice
            seed = 1000 * (1 + list(ENGINES).index(name)) + k
            t = time.perf_counter()
            c = samplers[name](k, seed)
            sec = time.perf_counter() - t
            runs[name].append({"k": k, "engine": name, "seconds": sec, "samples": k * len(test),
                               "samples_per_s": k * len(test) / sec, "observed_pass": float(np.mean(c > 0)),
                               "sample_accuracy": float(c.sum() / (k * len(test)))})
            counts[name] = c
            log(f"  {name:14s} k={k:3d}: {sec:7.2f}s, {k * len(test) / sec:7.0f} samples/s, "
                f"correct {c.sum() / (k * len(test)):.3f}, any-correct {np.mean(c > 0):.3f}")
    n = max(args.ks)
    # The exact engines sample one model: their 2n samples per problem estimate its pass@k.
    pooled = {"srm": (counts["srm"], n), "transformer": (sum(counts[e] for e in EXACT), len(EXACT) * n)}
    timed = {"srm": runs["srm"], "transformer": best_transformer(*(runs[e] for e in engines if e != "srm"))}
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
    if llama is not None:  # llama.cpp's own samples: does ggml's GELU change the accuracy?
        c = counts["transformer-llama"]
        llama.update(correct_counts=c.tolist(), pass_at_k=pass_at_k_curve(c, n, range(1, n + 1)))
    return {"command": command_line(), "machine": machine_info(),
            "task": {"name": "worked two-step arithmetic", "min_digits": args.min_digits,
                     "max_digits": args.max_digits, "test_problems": len(test),
                     "train_problems": args.train_problems, "example": test[0].prompt + test[0].worked},
            "train_recipe": {k: getattr(args, k) for k in ("steps", "batch_size", "lr", "warmup", "context")},
            "sampling": {"temperature": args.temperature, "max_new_tokens": args.max_new, "n": n,
                         "max_batch": args.max_batch, "threads": args.threads,
                         "engines": {e: ENGINES[e] for e in engines}},
            "gpt2_logit_error": logit_error, "llama_cpp": llama, "engine_runs": runs, "models": models,
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
    if r.get("llama_cpp"):
        lines.append(f"| transformer on llama.cpp (ggml GELU) | | | | {r['llama_cpp']['pass_at_k'][0]:.3f} |")
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
    for name, color in (("transformer-kv", "tab:gray"), ("transformer-hf", "tab:olive"),
                        ("transformer-llama", "tab:purple")):
        if name not in r["engine_runs"]:
            continue
        runs = r["engine_runs"][name]
        ax[0].plot([t["seconds"] for t in runs], [curve[t["k"] - 1] for t in runs], ":", color=color,
                   alpha=0.7, label=f"{name} (engine alone)")
    if r.get("llama_cpp"):  # llama.cpp's own samples (ggml's GELU) against the pooled exact ones
        own = r["llama_cpp"]["pass_at_k"]
        ax[1].plot(range(1, len(own) + 1), own, ":", color="tab:purple", label="transformer on llama.cpp, own samples")
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
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ks", default="1,2,4,8,16,32,64", help="samples per problem of the timed runs")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-batch", type=int, default=1024, help="largest decode batch of either engine")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of every Transformer engine (torch, llama.cpp) (1: on a shared, "
                         "oversubscribed CPU more threads wait on each other)")
    ap.add_argument("--transformer-engines", default="kv,hf,llama",
                    help="the Transformer's engines: kv (PyTorch loop), hf (transformers), llama (llama.cpp, "
                         "needs pip install -e '.[llama]')")
    ap.add_argument("--llama-batch", type=int, default=16,
                    help="llama.cpp's rows per batch (n_seq_max; its fastest here, see bench/llama_cpp_transformer.py)")
    ap.add_argument("--llama-flash-attn", choices=("on", "off"), default="on", help="llama.cpp's flash attention")
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
    names = [e for e in args.transformer_engines.split(",") if e]
    if unknown := set(names) - set(TRANSFORMER_ENGINES):
        raise SystemExit(f"error: unknown --transformer-engines {sorted(unknown)}; choose from "
                         f"{sorted(TRANSFORMER_ENGINES)}")
    args.transformer_engines = [TRANSFORMER_ENGINES[e] for e in TRANSFORMER_ENGINES if e in names]
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
