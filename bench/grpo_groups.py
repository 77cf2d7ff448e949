"""GRPO with large balanced groups against plain GRPO with small groups, same wall-clock budget.

    python -m bench.grpo_groups [--seconds 150] [--quick]

The paper's claim: balanced resampling on large groups (about 50 rollouts per prompt,
cheap with an SRM's batched sampling) reaches a higher single-sample accuracy than plain
GRPO on small groups (about 5). Here, on the addition task of bench/verifiable_demo.py
(the same tiny SRM, started from the same supervised checkpoint):

    large   balanced resampling: ``--large-samples`` rollouts per prompt, a training
            group of ``--large-group`` (up to half of it correct, the rest incorrect)
    small   plain GRPO: ``--small-samples`` rollouts per prompt, all of them the group

Both run for the same wall-clock budget (``--seconds``: rollouts on the MAX engine,
updates in PyTorch, the Generator rebuilt each iteration) on the same stream of prompts
(the small run gets further along it: its iterations are cheaper). Accuracy on the
held-out problems before and after: greedy, and the mean over ``--eval-samples``
samples at temperature 1 (the single-sample accuracy). Writes
bench/results/grpo_groups.json and .png.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import numpy as np

from bench.common import command_line, machine_info, write_json
from bench.verifiable_demo import add_start_arguments, evaluate, make_generator, supervised_start
from srm_max.rl import arithmetic as ar
from srm_max.rl.grpo import GRPOConfig, train_grpo, weights_numpy

ROOT = Path(__file__).resolve().parents[1]


def run(name: str, model, cfg, train, heldout, args, log, *, samples: int, group: int, balanced: bool) -> dict:
    policy = copy.deepcopy(model)
    gcfg = GRPOConfig(iterations=10_000, prompts_per_iter=args.prompts_per_iter, samples_per_prompt=samples,
                      group_size=group, balanced=balanced, lr=args.lr, beta=args.beta, epochs=2, temperature=1.0,
                      max_new_tokens=args.max_new, max_batch=args.max_batch, seed=args.seed,
                      max_seconds=args.seconds)
    t = time.perf_counter()
    hist = train_grpo(policy, lambda w: make_generator(cfg, w), [p.prompt_ids() for p in train],
                      lambda i, ids: train[i].verify(ids), gcfg, stop_id=ar.END_ID, pad_id=ar.PAD_ID)
    seconds = time.perf_counter() - t
    after = evaluate(make_generator(cfg, weights_numpy(policy)), heldout, args)
    log(f"{name}: {len(hist)} iterations in {seconds:.0f} s, {len(hist) * args.prompts_per_iter * samples} "
        f"rollouts; after {after}")
    return {"samples_per_prompt": samples, "group_size": group, "balanced": balanced, "seconds": seconds,
            "iterations": len(hist), "rollouts": len(hist) * args.prompts_per_iter * samples,
            "trained_sequences": len(hist) * args.prompts_per_iter * group, "after": after,
            "history": [e.__dict__ for e in hist], "config": gcfg.__dict__}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    before = result["before"]
    for name, r in result["runs"].items():
        label = f"{name}: {r['samples_per_prompt']} rollouts, group {r['group_size']}"
        ax[0].plot([h["elapsed"] for h in r["history"]], [h["reward_all"] for h in r["history"]], label=label)
    ax[0].set(xlabel="wall-clock seconds", ylabel="mean rollout reward (T=1)", title="GRPO under one time budget")
    ax[0].legend(fontsize=8)
    names = list(result["runs"])
    x = np.arange(len(names) + 1)
    for i, key in enumerate(("greedy_acc", "t1_acc")):
        vals = [before[key]] + [result["runs"][n]["after"][key] for n in names]
        ax[1].bar(x + (i - 0.5) * 0.35, vals, 0.35, label=key)
    ax[1].set_xticks(x, ["start"] + names)
    ax[1].set(ylabel="held-out accuracy", title="before and after")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=150.0, help="wall-clock budget of each GRPO run")
    ap.add_argument("--large-samples", type=int, default=64)
    ap.add_argument("--large-group", type=int, default=48)
    ap.add_argument("--small-samples", type=int, default=6)
    ap.add_argument("--prompts-per-iter", type=int, default=16)
    add_start_arguments(ap)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--beta", type=float, default=0.02)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 10 s budgets, a short SFT")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "grpo_groups.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.sft_steps, args.heldout, args.eval_samples = 10.0, 50, 40, 4
    log = lambda m: print(m, flush=True)  # noqa: E731
    cfg, train, heldout, model, sft = supervised_start(args, log)
    before = evaluate(make_generator(cfg, weights_numpy(model)), heldout, args)
    log(f"start: {before}")
    runs = {"large": run("large", model, cfg, train, heldout, args, log, samples=args.large_samples,
                         group=args.large_group, balanced=True),
            "small": run("small", model, cfg, train, heldout, args, log, samples=args.small_samples,
                         group=args.small_samples, balanced=False)}
    seqs = [[h["prompts"] for h in r["history"]] for r in runs.values()]
    shared = min(map(len, seqs))
    if seqs[0][:shared] != seqs[1][:shared]:
        raise RuntimeError("the two GRPO runs trained on different prompt streams")
    result = {"what": "GRPO: balanced resampling on large groups vs plain GRPO on small groups, same wall clock",
              "command": command_line(), "machine": machine_info(),
              "task": {"min_digits": args.min_digits, "max_digits": args.max_digits, "heldout": len(heldout)},
              "model": cfg.__dict__ | {"parameters": sum(p.numel() for p in model.parameters())},
              "budget_seconds": args.seconds, "eval_samples": args.eval_samples, "sft": sft, "before": before,
              "runs": runs}
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    for name, r in runs.items():
        log(f"| {name} | {r['samples_per_prompt']} | {r['group_size']} | {r['iterations']} | {r['rollouts']} | "
            f"{before['t1_acc']:.3f} -> {r['after']['t1_acc']:.3f} | {before['greedy_acc']:.3f} -> "
            f"{r['after']['greedy_acc']:.3f} |")
    return result


if __name__ == "__main__":
    main()
