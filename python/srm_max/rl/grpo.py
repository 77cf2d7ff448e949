"""GRPO on the PyTorch reference SRM, with rollouts from the MAX Generator.

One iteration:

1. Rebuild a ``Generator`` with the policy's current weights (the compiled
   graphs of this config shape come from the .mef cache: milliseconds).
2. Sample ``samples_per_prompt`` completions of each prompt with slot refill
   (``serve.sample_many``) and score them with the verifier.
3. Pick a group of ``group_size`` per prompt: with ``balanced=True`` the
   paper's balanced resampling (``groups.balanced_group``: up to G/2
   correct, filled with incorrect), otherwise plain GRPO (the first G samples).
   Both see the same prompts (prompt choice has its own random stream) and
   the same rollout budget.
4. Group-normalised advantages, then ``epochs`` gradient steps on the clipped
   ratio objective with a KL penalty to the frozen reference (k3 estimator):

       loss = mean_seq mean_tok [ -min(r A, clip(r, 1-eps, 1+eps) A) + beta * k3 ]
       r = exp(logp - logp_old),  k3 = exp(ref - logp) - (ref - logp) - 1

Per-token log-probabilities come from the parallel form on right-padded
batches: prompts start at position 0, so padding after a sequence never
changes its positions (causality). The old and the reference log-probabilities
need no gradient: with ``GRPOConfig.engine_logprobs`` they come from the MAX
engine's scoring path instead (``engine_token_logprobs``: the iteration's rollout
engine holds the old policy's weights, and one engine of the frozen reference is
built once), and only the policy's own pass runs in PyTorch.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..scalars import is_int, is_real, out_of_range
from ..serve.sample_many import sample_many
from ..serve.scoring import score_continuations
from ..serve.scheduler import PoolStats
from .groups import balanced_group, group_advantages


# ------------------------------------------------------------------ log-probs
def pad_sequences(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int = 0):
    """Right-padded ``prompt + completion`` ids [B, T] and the completion mask [B, T-1].

    ``mask[b, t]`` is True where token ``t + 1`` belongs to completion ``b``
    (the token predicted by the logits at position ``t``).
    """
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), max(T - 1, 1)), dtype=torch.bool)
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, len(p) - 1: len(s) - 1] = True
    return ids, mask


def token_logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token [B, T-1] (zero outside ``mask``), parallel form."""
    logits = model(ids).float()[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return logp * mask


def engine_token_logprobs(engine, prompts, completions, shape) -> torch.Tensor:
    """``token_logprobs``' [B, T-1] layout (zero outside the completions) from a MAX engine's
    scoring path: each prompt read once and its completion scored after it, no gradient."""
    out = torch.zeros(shape, dtype=torch.float32)
    scores = score_continuations(engine, [list(p) for p in prompts], [list(c) for c in completions], 0)
    for b, (p, s) in enumerate(zip(prompts, scores)):
        out[b, len(p) - 1: len(p) - 1 + len(s)] = torch.from_numpy(s.logprobs)
    return out


def completion_logprobs(model, prompts, completions, pad_id: int = 0) -> torch.Tensor:
    """Summed log-probability of each completion given its prompt [B]."""
    ids, mask = pad_sequences(prompts, completions, pad_id)
    return token_logprobs(model, ids, mask).sum(-1)


@torch.no_grad()
def recurrent_logprobs(model, prompt: Sequence[int], completion: Sequence[int]) -> float:
    """The same sum, one recurrent step at a time (prefill + ``step``): the check of the parallel form."""
    logits, states = model.prefill(torch.tensor([list(prompt)]))
    last = logits[:, -1]
    total = 0.0
    for j, tok in enumerate(completion):
        total += float(torch.log_softmax(last.float(), -1)[0, tok])
        if j + 1 < len(completion):
            last, states = model.step(torch.tensor([tok]), torch.tensor([len(prompt) + j]), states)
    return total


# ------------------------------------------------------------------ the objective
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference), per token: >= 0, exactly 0 when equal."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, clip_eps: float = 0.2, beta: float = 0.04):
    """The GRPO loss and its parts. ``logp``/``old_logp``/``ref_logp``/``mask``: [B, T]; ``advantages``: [B]."""
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    kl = kl_k3(logp, ref_logp)
    per_token = -surrogate + beta * kl
    lengths = mask.sum(-1).clamp(min=1)
    loss = ((per_token * mask).sum(-1) / lengths).mean()
    kl_mean = ((kl * mask).sum(-1) / lengths).mean()
    clipped = (((ratio - 1).abs() > clip_eps).float() * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"kl": float(kl_mean.detach()), "clip_frac": float(clipped.detach())}


def grpo_step(policy, reference, optimizer, prompts, completions, advantages, epochs: int = 1,
              clip_eps: float = 0.2, beta: float = 0.04, pad_id: int = 0, max_grad_norm: float = 1.0,
              engines: tuple | None = None) -> dict:
    """``epochs`` gradient steps on one batch of rollouts (old log-probs frozen at the start).
    ``engines``: (the policy's, the reference's) MAX engines to score the old and reference
    log-probabilities with (``engine_token_logprobs``) instead of the PyTorch models."""
    ids, mask = pad_sequences(prompts, completions, pad_id)
    adv = torch.as_tensor(np.asarray(advantages), dtype=torch.float32)
    if engines is not None:
        old, ref = (engine_token_logprobs(e, prompts, completions, mask.shape) * mask for e in engines)
    else:
        with torch.no_grad():
            old = token_logprobs(policy, ids, mask)
            ref = token_logprobs(reference, ids, mask)
    info = {}
    policy.train()
    for _ in range(epochs):
        logp = token_logprobs(policy, ids, mask)
        loss, info = grpo_loss(logp, old, ref, adv, mask, clip_eps, beta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
        optimizer.step()
        info["loss"] = float(loss.detach())
    policy.eval()
    return info


# ------------------------------------------------------------------ the loop
# The smallest value of each of GRPOConfig's integer settings, and the finite values each real one accepts.
_INT_MINIMA = {"iterations": 1, "prompts_per_iter": 1, "samples_per_prompt": 1, "group_size": 1, "epochs": 1,
               "max_new_tokens": 1, "seed": 0}
_REAL_RANGES = {"lr": (lambda v: v > 0, "a finite number > 0"), "beta": (lambda v: v >= 0, "a finite number >= 0"),
                "clip_eps": (lambda v: v > 0, "a finite number > 0"),
                "temperature": (lambda v: v >= 0, "a finite number >= 0")}


@dataclass
class GRPOConfig:
    iterations: int = 20
    prompts_per_iter: int = 8
    samples_per_prompt: int = 32  # the rollout budget per prompt (the same for both modes)
    group_size: int = 8
    balanced: bool = True
    lr: float = 1e-4
    beta: float = 0.04
    clip_eps: float = 0.2
    epochs: int = 2
    temperature: float = 1.0
    max_new_tokens: int = 8
    max_batch: int | str = 256
    seed: int = 0
    max_seconds: float | None = None  # wall-clock budget: no iteration starts after it is spent
    engine_logprobs: bool = False  # old and reference log-probabilities from the MAX engines' scoring path

    def __post_init__(self) -> None:
        """A ValueError naming the first setting out of range, before any rollout."""
        bad = out_of_range(self, int_minima=_INT_MINIMA)
        if bad is None and self.max_batch != "auto" and (not is_int(self.max_batch) or self.max_batch < 1):
            bad = "max_batch", "an integer >= 1 or 'auto'", self.max_batch
        bad = bad or out_of_range(self, real_ranges=_REAL_RANGES)
        if bad is None and self.max_seconds is not None and (not is_real(self.max_seconds)
                                                             or not self.max_seconds > 0):
            bad = "max_seconds", "None or a number > 0", self.max_seconds
        if bad is not None:
            name, wording, value = bad
            raise ValueError(f"GRPOConfig.{name} must be {wording}, got {value!r}")


@dataclass
class IterationLog:
    iteration: int
    reward_all: float  # mean reward of every rollout
    reward_group: float  # mean reward of the training groups
    useful_groups: int  # groups with nonzero advantages (correct and incorrect both present)
    kl: float
    loss: float
    rollout_seconds: float
    update_seconds: float
    rebuild_seconds: float
    eval: dict = field(default_factory=dict)
    prompts: list[int] = field(default_factory=list)  # indices of the iteration's prompts
    elapsed: float = 0.0  # seconds since training started, at the end of this iteration's update


def weights_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy().copy() for k, v in model.state_dict().items()}


def random_streams(seed: int) -> tuple[random.Random, random.Random]:
    """Independent generators for prompt choice and for group shuffles.

    Balanced resampling draws from its generator and plain GRPO does not; with
    one shared generator the two modes would then train on different prompts.
    """
    prompts, shuffles = np.random.SeedSequence(seed).spawn(2)
    return (random.Random(int(prompts.generate_state(1, np.uint64)[0])),
            random.Random(int(shuffles.generate_state(1, np.uint64)[0])))


def select_group(rewards: Sequence[float], group_size: int, balanced: bool, rng: random.Random) -> list[int]:
    """Indices of the training group: balanced resampling, or plain GRPO's first G samples."""
    if balanced:
        return balanced_group(rewards, group_size, rng)
    return list(range(min(group_size, len(rewards))))


def rollouts(generator, prompt_ids, n, verify: Callable[[int, list[int]], float], *, temperature, max_new_tokens,
             stop_id, seed, max_batch="auto", stats: PoolStats | None = None):
    """``n`` scored samples of every prompt: ``out[p]`` is the list sorted by sample index."""
    out = [[None] * n for _ in prompt_ids]
    for s in sample_many(generator, prompt_ids, n, max_batch=max_batch, max_new_tokens=max_new_tokens,
                         temperature=temperature, seed=seed, stop=[stop_id], stats=stats):
        s.score = float(verify(s.prompt_index, s.ids))
        out[s.prompt_index][s.sample_index] = s
    return out


def completion_tokens(sample, stop_id: int) -> list[int]:
    """What the policy produced: the ids, plus the stop token when it stopped (it was sampled too)."""
    return list(sample.ids) + ([stop_id] if sample.finish_reason == "stop" else [])


def train_grpo(policy, make_generator: Callable[[dict], object], prompts: Sequence[Sequence[int]],
               verify: Callable[[int, list[int]], float], cfg: GRPOConfig, stop_id: int, pad_id: int = 0,
               evaluate: Callable[[object], dict] | None = None, eval_every: int = 0,
               log: Callable[[IterationLog], None] | None = None) -> list[IterationLog]:
    """Train ``policy`` in place with GRPO; ``verify(prompt_index, ids)`` scores against ``prompts``.

    ``make_generator(weights)`` builds a MAX Generator from numpy weights;
    ``evaluate(generator)`` (optional) returns a dict of metrics.
    """
    reference = copy.deepcopy(policy).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    policy.eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    prompt_rng, shuffle_rng = random_streams(cfg.seed)
    ref_engine = make_generator(weights_numpy(reference)).engine if cfg.engine_logprobs else None
    history = []
    start = time.perf_counter()
    for it in range(cfg.iterations):
        t0 = time.perf_counter()
        if cfg.max_seconds is not None and t0 - start >= cfg.max_seconds:
            break
        gen = make_generator(weights_numpy(policy))
        t1 = time.perf_counter()
        chosen = prompt_rng.sample(range(len(prompts)), min(cfg.prompts_per_iter, len(prompts)))
        batch_prompts = [list(prompts[i]) for i in chosen]
        samples = rollouts(gen, batch_prompts, cfg.samples_per_prompt, lambda p, ids: verify(chosen[p], ids),
                           temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, stop_id=stop_id,
                           seed=cfg.seed * 1_000_003 + it, max_batch=cfg.max_batch)
        t2 = time.perf_counter()
        P, C, A, group_rewards, useful, all_rewards = [], [], [], [], 0, []
        for p, group_all in enumerate(samples):
            rewards = [s.score for s in group_all]
            all_rewards += rewards
            idx = select_group(rewards, cfg.group_size, cfg.balanced, shuffle_rng)
            r = [rewards[i] for i in idx]
            group_rewards += r
            adv = group_advantages(r)
            useful += int(np.any(adv != 0))
            for i, a in zip(idx, adv):
                P.append(batch_prompts[p])
                C.append(completion_tokens(group_all[i], stop_id))
                A.append(a)
        engines = (gen.engine, ref_engine) if cfg.engine_logprobs else None
        info = grpo_step(policy, reference, optimizer, P, C, A, cfg.epochs, cfg.clip_eps, cfg.beta, pad_id,
                         engines=engines)
        t3 = time.perf_counter()
        entry = IterationLog(it, float(np.mean(all_rewards)), float(np.mean(group_rewards)), useful, info["kl"],
                             info["loss"], t2 - t1, t3 - t2, t1 - t0, prompts=list(chosen), elapsed=t3 - start)
        if evaluate is not None and eval_every and ((it + 1) % eval_every == 0 or it + 1 == cfg.iterations):
            entry.eval = evaluate(make_generator(weights_numpy(policy)))
        history.append(entry)
        if log:
            log(entry)
    return history


__all__ = ["pad_sequences", "token_logprobs", "engine_token_logprobs", "completion_logprobs", "recurrent_logprobs", "kl_k3", "grpo_loss",
           "grpo_step", "GRPOConfig", "IterationLog", "train_grpo", "rollouts", "select_group", "random_streams",
           "completion_tokens", "weights_numpy", "asdict"]
