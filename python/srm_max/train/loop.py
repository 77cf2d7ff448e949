"""The training loop and validation, for any causal language model.

Any ``nn.Module`` mapping ids ``[B, T]`` to next-token logits ``[B, T, V]``
trains with :func:`train`: next-token cross-entropy at every position, the
batches of ``data``, the optimizer and precision of ``optim``, checkpoints of
``checkpoints`` every ``save_every`` steps. Validation always runs in fp32 (the
number reported is the one the shipped fp32 model gets). Under torchrun the
model is wrapped in DDP and every rank draws its own batches.

Outputs in ``out``:
    checkpoints/step-NNNNNN/{model.pt,trainer_state.pt}, checkpoints/latest
    model.pt         the final state_dict (fp32), ``torch.save(state_dict)``
    config.json      the model config (when one is given)
    metrics.jsonl    one line per log / eval event
    results.json     final validation loss and perplexity, tokens, timing
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..files import atomic_write_text
from ..progress import Progress
from .checkpoints import Resumed, latest_checkpoint, restore_checkpoint, save_training_state, save_final_model, unwrap
from .config import TrainConfig
from .data import batch_generator, eval_windows, sample_batch
from .errors import TrainError
from .optim import autocast_context, grad_scaler, lr_at, make_optimizer, resolve_precision
from .run_dir import (CONFIG_FILE, FINAL_MODEL_FILE, METRICS_FILE, RESULTS_FILE, check_out, check_run_config,
                      keep_metrics_through, start_over)


class TrainingDiverged(TrainError, FloatingPointError):
    """The loss stopped being finite. A ``TrainError``, so ``srm-max train`` reports it as one
    line, and a ``FloatingPointError`` for callers of :func:`train` that catch that."""


def _left_behind(out: Path) -> str:
    """What a run that stops here leaves in ``out``, so the message says what to keep or remove."""
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    try:
        ckpt = latest_checkpoint(out)
    except TrainError:
        ckpt = None
    found = ", ".join(names) if names else "nothing"
    if ckpt is None:
        return f"{out} holds {found}; no checkpoint to resume from (start over with --force)"
    return f"{out} holds {found}; --resume continues from its newest checkpoint, {ckpt.name}"


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


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def train(model: nn.Module, train_tokens: torch.Tensor, val_tokens: torch.Tensor | None,
          cfg: TrainConfig, out: str | Path, model_config=None, resume: bool = False, force: bool = False,
          device: str | torch.device | None = None, progress: bool = True) -> dict:
    """Train ``model`` in place; returns the results dict (also written to results.json).

    ``out`` must be absent or empty unless ``resume`` (continue the run in it) or ``force``
    (remove that run first); ``TrainError`` otherwise, before anything is written.
    Under torchrun (``WORLD_SIZE`` > 1) the process group must already be
    initialised (``cli.main`` does it); the model is wrapped in DDP here.
    """
    cfg.check()
    out = Path(out)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    is_main = rank == 0
    check_out(out, resume, force)
    if world > 1:
        torch.distributed.barrier()  # every rank has looked at out before the main one writes there
    device = torch.device(device) if device is not None else _default_device()
    precision = resolve_precision(cfg.precision, device)
    if is_main:
        if force:
            start_over(out)
        out.mkdir(parents=True, exist_ok=True)

    train_tokens = train_tokens.to(torch.int64).cpu()
    model.to(device)
    model.train()
    optimizer = make_optimizer(model, cfg, device)
    scaler = grad_scaler(precision)

    before = Resumed()
    if resume:
        ckpt = latest_checkpoint(out)
        if ckpt is not None:
            if model_config is not None:
                check_run_config(out, model_config)
            before = restore_checkpoint(ckpt, model, optimizer, scaler, device)
            if is_main and progress:
                print(f"resumed from {ckpt} at step {before.step}", file=sys.stderr)
        if is_main:
            keep_metrics_through(out, before.step)
    start_step = before.step

    ddp_model = model
    if world > 1:
        ddp_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    if is_main and model_config is not None:
        model_config.save(out / CONFIG_FILE)
    tokens_per_step = cfg.batch_size * cfg.context_length * world
    end_step = cfg.steps if not cfg.stop_at_step else min(cfg.steps, cfg.stop_at_step)
    metrics_path = out / METRICS_FILE

    def log(event: dict) -> None:
        if is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(event) + "\n")

    def checkpoint(step: int) -> None:
        if is_main:
            save_training_state(out, step, model, optimizer, scaler,
                            {"elapsed_s": before.elapsed_s + train_time, "tokens_seen": before.tokens_seen
                             + (step - start_step) * tokens_per_step, "train_config": dataclasses.asdict(cfg)},
                            keep=cfg.keep_checkpoints)
        if world > 1:
            torch.distributed.barrier()

    train_time = 0.0
    window_t0, window_steps, loss_sum = time.perf_counter(), 0, 0.0
    # log_interval=0: a log file gets one line per logged step, as metrics.jsonl does.
    bar = Progress(cfg.steps, desc="train", initial=start_step, unit="step", enabled=is_main and progress,
                   log_interval=0)
    with bar:
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
                raise TrainingDiverged(f"loss is {loss.item()} at step {step}; lower --lr or use fp32. "
                                       + _left_behind(out))
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
                bar.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
                bar.update_to(done)
                log({"step": done, "loss": mean_loss, "lr": lr, "tokens_per_s": tok_s,
                     "grad_norm": None if grad_norm is None else float(grad_norm),
                     "tokens_seen": before.tokens_seen + (done - start_step) * tokens_per_step})
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
        "tokens_seen": before.tokens_seen + (final_step - start_step) * tokens_per_step,
        "train_time_s": before.elapsed_s + train_time,
        "tokens_per_s": ((final_step - start_step) * tokens_per_step / train_time) if train_time else None,
        "world_size": world,
        "precision": precision,
        "device": str(device),
        "num_parameters": sum(p.numel() for p in unwrap(model).parameters()),
        "train_config": dataclasses.asdict(cfg),
    }
    if final_step >= cfg.steps:
        if val_tokens is not None:
            results.update(evaluate(model, val_tokens, cfg, device, "fp32", rank, world))
            if is_main and progress:
                print(f"final: val loss {results['val_loss']:.4f} ppl {results['val_ppl']:.2f}", file=sys.stderr)
            log({"step": final_step, **{k: results[k] for k in ("val_loss", "val_ppl", "val_tokens")}})
        if is_main:
            save_final_model(model, out / FINAL_MODEL_FILE)
    if model_config is not None:
        results["model_config"] = model_config.to_dict()
    if is_main:
        atomic_write_text(out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return results
