"""Verifiable-task demo: pass@k from massive sampling, and GRPO with and without balanced resampling.

    python -m bench.verifiable_demo            # a few minutes on CPU

1. Train a tiny SRM on multi-digit addition ("12+34=" -> "46<e>") by supervised
   learning, briefly, so that it is partly right.
2. (a) Sample 64 completions of every held-out problem with the MAX Generator
   (slot refill, ``sample_many``) and report pass@k for k = 1..64 against the
   number of samples and against seconds (timed pools of k samples/problem).
3. (b) From the same start, run GRPO twice -- balanced resampling vs plain
   (the first G samples) -- on the same prompts, with the same number of
   updates and the same rollout budget; report greedy and temperature-1
   accuracy on the held-out set before and after.

Writes ``bench/results/verifiable_demo.json`` and ``.png`` and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from srm_max.rl import arithmetic as ar  # noqa: E402
from srm_max.models.srm.config import SRMConfig  # noqa: E402
from srm_max.serve.generator import Generator  # noqa: E402
from srm_max.rl.grpo import GRPOConfig, pad_sequences, train_grpo, weights_numpy  # noqa: E402
from srm_max.reference.srm import SRM  # noqa: E402
from srm_max.serve.sample_many import sample_many  # noqa: E402
from srm_max.serve.scheduler import PoolStats  # noqa: E402
from srm_max.rl.groups import mean_pass_at_k  # noqa: E402


def config(args) -> SRMConfig:
    return SRMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=2,
                     context_length=args.context)


def make_generator(cfg, weights):
    return Generator(cfg, weights, dtype="float32", device="cpu")


# ------------------------------------------------------------------ supervised start
@torch.no_grad()
def torch_greedy_accuracy(model, probs, max_new):
    prompts = [p.prompt_ids() for p in probs]
    lens = torch.tensor([len(p) for p in prompts])
    T = int(lens.max()) + max_new
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    rows = torch.arange(len(prompts))
    out = []
    for j in range(max_new):
        logits = model(ids[:, : int(lens.max()) + j])
        nxt = logits[rows, lens + j - 1].argmax(-1)
        ids[rows, lens + j] = nxt
        out.append(nxt)
    gen = torch.stack(out, 1).tolist()
    return float(np.mean([p.verify(g) for p, g in zip(probs, gen)]))


def supervised(model, train, probe, args, log):
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.01)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    acc, step = 0.0, 0
    for step in range(1, args.sft_steps + 1):
        batch = [train[i] for i in rng.integers(0, len(train), args.sft_batch)]
        ids, mask = pad_sequences([p.prompt_ids() for p in batch], [p.target_ids() for p in batch], ar.PAD_ID)
        model.train()
        logits = model(ids)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask], ids[:, 1:][mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.eval()
        if step % 25 == 0:
            acc = torch_greedy_accuracy(model, probe, args.max_new)
            log(f"  sft step {step}: loss {float(loss.detach()):.3f}, greedy acc {acc:.2f} ({time.perf_counter() - t0:.0f}s)")
            if acc >= args.sft_target or time.perf_counter() - t0 > args.sft_seconds:
                break
    return {"steps": step, "seconds": time.perf_counter() - t0, "probe_greedy_acc": acc}


def add_start_arguments(ap: argparse.ArgumentParser) -> None:
    """The task, the model and its supervised start (also bench/grpo_groups.py's)."""
    ap.add_argument("--min-digits", type=int, default=1)
    ap.add_argument("--max-digits", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--sft-steps", type=int, default=1500)
    ap.add_argument("--sft-seconds", type=float, default=150)
    ap.add_argument("--sft-target", type=float, default=0.3, help="stop SFT at this greedy accuracy")
    ap.add_argument("--sft-batch", type=int, default=128)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--heldout", type=int, default=200)


def supervised_start(args, log):
    """-> (config, train problems, held-out problems, the model after SFT, the SFT record)."""
    args.max_new = args.max_digits + 2
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    cfg = config(args)
    assert ar.max_length(args.max_digits) <= cfg.context_length
    heldout = ar.problems(args.heldout, args.min_digits, args.max_digits, seed=10_000)
    train = ar.problems(4000, args.min_digits, args.max_digits, seed=args.seed, exclude=set(heldout))
    log(f"SFT: {cfg}")
    model = SRM(cfg).eval()
    with torch.no_grad():
        model.output_layer.weight.mul_(0.1)
    return cfg, train, heldout, model, supervised(model, train, heldout[:100], args, log)


# ------------------------------------------------------------------ evaluation with MAX
def scored(gen, probs, n, args, seed, stats=None):
    """correct counts [P] of n samples each at temperature 1."""
    counts = np.zeros(len(probs), int)
    for s in sample_many(gen, [p.prompt_ids() for p in probs], n, max_batch=args.max_batch,
                         max_new_tokens=args.max_new, temperature=1.0, seed=seed, stop=[ar.END_ID], stats=stats):
        counts[s.prompt_index] += int(probs[s.prompt_index].verify(s.ids))
    return counts


def evaluate(gen, probs, args):
    outs = gen.generate([p.prompt_ids() for p in probs], max_new_tokens=args.max_new, temperature=0.0,
                        stop=[ar.END_ID])
    greedy = float(np.mean([p.verify(o.ids) for p, o in zip(probs, outs)]))
    counts = scored(gen, probs, args.eval_samples, args, seed=12345)
    return {"greedy_acc": greedy, "t1_acc": float(counts.mean() / args.eval_samples)}


def pass_at_k_report(gen, probs, args, log):
    K = args.k_max
    stats = PoolStats()
    t0 = time.perf_counter()
    counts = scored(gen, probs, K, args, seed=7, stats=stats)
    total = time.perf_counter() - t0
    ks = list(range(1, K + 1))
    curve = [mean_pass_at_k(counts.tolist(), K, k) for k in ks]
    timed = []
    for k in [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= K]:
        st = PoolStats()
        t = time.perf_counter()
        c = scored(gen, probs, k, args, seed=1000 + k, stats=st)
        sec = time.perf_counter() - t
        timed.append({"k": k, "samples": k * len(probs), "seconds": sec, "pass_at_k": float(np.mean(c > 0)),
                      "samples_per_s": k * len(probs) / sec, "slots": st.slots})
        log(f"  k={k}: {k * len(probs)} samples in {sec:.2f}s, pass@{k} (observed) {np.mean(c > 0):.3f}")
    return {"problems": len(probs), "n": K, "correct_counts": counts.tolist(), "k": ks, "pass_at_k": curve,
            "seconds_for_n": total, "samples_per_s": K * len(probs) / total, "slots": stats.slots,
            "timed": timed}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_start_arguments(ap)
    ap.add_argument("--k-max", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--prompts-per-iter", type=int, default=16)
    ap.add_argument("--samples", type=int, default=32, help="rollouts per prompt (both modes)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--beta", type=float, default=0.02)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    t_all = time.perf_counter()
    cfg, train, heldout, model, sft = supervised_start(args, log)

    t = time.perf_counter()
    gen = make_generator(cfg, weights_numpy(model))
    build_s = time.perf_counter() - t
    log(f"Generator built in {build_s:.1f}s; pass@k with slot refill...")
    pk = pass_at_k_report(gen, heldout, args, log)
    start_eval = evaluate(gen, heldout, args)
    log(f"  start: {start_eval}")

    runs = {}
    for balanced in (True, False):
        name = "balanced" if balanced else "plain"
        policy = copy.deepcopy(model)
        gcfg = GRPOConfig(iterations=args.iterations, prompts_per_iter=args.prompts_per_iter,
                          samples_per_prompt=args.samples, group_size=args.group, balanced=balanced,
                          lr=args.lr, beta=args.beta, epochs=2, temperature=1.0, max_new_tokens=args.max_new,
                          max_batch=args.max_batch, seed=args.seed)
        t = time.perf_counter()
        hist = train_grpo(policy, lambda w: make_generator(cfg, w), [p.prompt_ids() for p in train],
                          lambda i, ids: train[i].verify(ids), gcfg, stop_id=ar.END_ID, pad_id=ar.PAD_ID,
                          log=lambda e, n=name: log(
                              f"  {n} it {e.iteration}: reward {e.reward_all:.3f} group {e.reward_group:.3f} "
                              f"useful {e.useful_groups}/{args.prompts_per_iter} kl {e.kl:.4f} "
                              f"(rollout {e.rollout_seconds:.1f}s update {e.update_seconds:.1f}s "
                              f"rebuild {e.rebuild_seconds:.1f}s)"))
        seconds = time.perf_counter() - t
        end = evaluate(make_generator(cfg, weights_numpy(policy)), heldout, args)
        log(f"  {name} end: {end}")
        runs[name] = {"config": gcfg.__dict__, "seconds": seconds, "before": start_eval, "after": end,
                      "history": [e.__dict__ for e in hist],
                      "rollouts": args.iterations * args.prompts_per_iter * args.samples,
                      "updates": args.iterations * 2}

    prompt_sequences = [[e["prompts"] for e in run["history"]] for run in runs.values()]
    if prompt_sequences[0] != prompt_sequences[1]:
        raise RuntimeError("the balanced and the plain GRPO runs trained on different prompts")

    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "task": {"min_digits": args.min_digits, "max_digits": args.max_digits, "heldout": len(heldout),
                       "train_problems": len(train)},
              "model": cfg.__dict__ | {"parameters": sum(p.numel() for p in model.parameters())},
              "sft": sft, "generator_build_seconds": build_s, "pass_at_k": pk, "grpo": runs,
              "total_seconds": time.perf_counter() - t_all}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verifiable_demo.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, args.out / "verifiable_demo.png")
    print(table(result))
    return result


def table(r) -> str:
    pk = r["pass_at_k"]
    lines = [f"Addition, {r['task']['min_digits']}-{r['task']['max_digits']} digit operands; SRM "
             f"d={r['model']['d_model']} L={r['model']['n_layers']} n={r['model']['context_length']} "
             f"({r['model']['parameters']:,} params), {r['task']['heldout']} held-out problems.", "",
             f"| k | pass@k (unbiased, n={pk['n']}) | samples | seconds (timed pool) | samples/s |", "|---|---|---|---|---|"]
    timed = {t["k"]: t for t in pk["timed"]}
    for k in (1, 2, 4, 8, 16, 32, 64):
        if k <= pk["n"]:
            t = timed.get(k)
            lines.append(f"| {k} | {pk['pass_at_k'][k - 1]:.3f} | {k * pk['problems']} | "
                         f"{t['seconds']:.2f} | {t['samples_per_s']:.0f} |" if t else f"| {k} | {pk['pass_at_k'][k - 1]:.3f} | | | |")
    lines += ["", "| GRPO (same start, updates, rollouts) | greedy acc before | after | T=1 acc before | after | rollouts | wall s |",
              "|---|---|---|---|---|---|---|"]
    for name, run in r["grpo"].items():
        b, a = run["before"], run["after"]
        lines.append(f"| {name} | {b['greedy_acc']:.3f} | {a['greedy_acc']:.3f} | {b['t1_acc']:.3f} | "
                     f"{a['t1_acc']:.3f} | {run['rollouts']} | {run['seconds']:.0f} |")
    return "\n".join(lines)


def plot(r, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pk = r["pass_at_k"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(pk["k"], pk["pass_at_k"], marker=".")
    ax[0].set(xscale="log", xlabel="k (samples per problem)", ylabel="pass@k", title="pass@k vs samples")
    ax[1].plot([t["seconds"] for t in pk["timed"]], [t["pass_at_k"] for t in pk["timed"]], marker="o")
    for t in pk["timed"]:
        ax[1].annotate(f"k={t['k']}", (t["seconds"], t["pass_at_k"]), fontsize=7)
    ax[1].set(xscale="log", xlabel=f"seconds ({pk['problems']} problems, MAX, slot refill)", ylabel="pass@k",
              title="pass@k vs compute")
    for name, run in r["grpo"].items():
        ax[2].plot([h["reward_all"] for h in run["history"]], label=f"{name}: rollout reward")
    ax[2].set(xlabel="GRPO iteration", ylabel="mean reward (T=1)", title="GRPO: balanced vs plain")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
