"""GRPO on the reference SRM: log-probs, the KL term, one step in the direction of the advantage."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from srm_max.models.srm.config import SRMConfig  # noqa: E402
from srm_max.reference.srm import SRM  # noqa: E402
from srm_max.rl import arithmetic, grpo  # noqa: E402
from srm_max.rl.grpo import (  # noqa: E402
    GRPOConfig, completion_logprobs, grpo_loss, grpo_step, kl_k3, pad_sequences, recurrent_logprobs,
    select_group, token_logprobs, train_grpo,
)

# torch only: no MAX graph is compiled here, so the config need not be the suite's TINY.
CFG = SRMConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, context_length=24)


def model(seed=0):
    torch.manual_seed(seed)
    m = SRM(CFG).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("decay_value"):
                p.copy_(0.9 + 0.1 * torch.rand(p.shape))
        # Kaiming-initialised logits are huge and the gradients of any two completions of one
        # prompt then point the same way; small logits make them distinct, as after training.
        m.output_layer.weight.mul_(0.05)
    return m


PROMPTS = [[3, 4, 12, 5, 13], [7, 12, 8, 9, 2, 13], [2, 13]]
COMPLETIONS = [[5, 6, 1], [10, 11, 2, 3, 1], [4, 4, 4, 4, 4, 4, 1]]


def test_pad_sequences_mask():
    ids, mask = pad_sequences([[1, 2], [3]], [[4, 5, 6], [7]])
    assert ids.tolist() == [[1, 2, 4, 5, 6], [3, 7, 0, 0, 0]]
    assert mask.tolist() == [[False, True, True, True], [True, False, False, False]]


def test_parallel_logprobs_equal_recurrent_sum():
    m = model()
    par = completion_logprobs(m, PROMPTS, COMPLETIONS)
    for b, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        alone = completion_logprobs(m, [p], [c])[0]  # no padding
        rec = recurrent_logprobs(m, p, c)
        assert float(par[b].detach()) == pytest.approx(rec, abs=1e-4)
        assert float(alone.detach()) == pytest.approx(float(par[b].detach()), abs=1e-5)  # right padding changes nothing


def test_kl_is_zero_when_policy_is_reference():
    m = model()
    ref = copy.deepcopy(m)
    ids, mask = pad_sequences(PROMPTS, COMPLETIONS)
    lp, rp = token_logprobs(m, ids, mask), token_logprobs(ref, ids, mask)
    assert torch.equal(kl_k3(lp, rp), torch.zeros_like(lp))
    _, info = grpo_loss(lp, lp.detach(), rp, torch.zeros(len(PROMPTS)), mask)
    assert info["kl"] == 0.0
    # and positive once they differ
    other = model(seed=5)
    assert float((kl_k3(token_logprobs(other, ids, mask), rp) * mask).sum()) > 0


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_one_step_moves_logprobs_along_the_advantage(beta):
    policy = model()
    reference = copy.deepcopy(policy)
    prompt = [3, 4, 12, 5, 13]
    good, bad = [5, 6, 1], [9, 2, 1]
    rewards = [1.0, 0.0]
    from srm_max.rl.groups import group_advantages

    adv = group_advantages(rewards)
    assert adv[0] > 0 > adv[1]
    before = completion_logprobs(policy, [prompt, prompt], [good, bad]).detach()
    opt = torch.optim.SGD(policy.parameters(), lr=1e-3)
    info = grpo_step(policy, reference, opt, [prompt, prompt], [good, bad], adv, epochs=1, beta=beta)
    after = completion_logprobs(policy, [prompt, prompt], [good, bad]).detach()
    assert after[0] > before[0] and after[1] < before[1]
    assert info["kl"] == 0.0  # first epoch: policy == reference
    assert any(not torch.equal(a, b) for a, b in zip(policy.parameters(), reference.parameters()))


def test_zero_advantages_and_beta_zero_leave_weights():
    policy = model()
    reference = copy.deepcopy(policy)
    opt = torch.optim.SGD(policy.parameters(), lr=1e-1)
    grpo_step(policy, reference, opt, PROMPTS, COMPLETIONS, np.zeros(3), epochs=1, beta=0.04)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), reference.parameters()))


def test_clipping_stops_the_ratio():
    lp = torch.tensor([[0.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0]])  # ratio e > 1 + eps
    lp.requires_grad_(True)
    loss, info = grpo_loss(lp, old, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                           clip_eps=0.2, beta=0.0)
    loss.backward()
    assert info["clip_frac"] == 1.0 and torch.all(lp.grad == 0)  # a positive advantage past 1+eps: no push


def test_group_selection():
    rewards = [1, 1, 1, 1, 1, 1, 0, 0, 1, 1]
    assert select_group(rewards, 4, balanced=False, rng=random.Random(0)) == [0, 1, 2, 3]
    g = select_group(rewards, 4, balanced=True, rng=random.Random(0))
    assert sorted(rewards[i] for i in g) == [0, 0, 1, 1]


def test_balanced_and_plain_runs_train_on_the_same_prompts(monkeypatch):
    """Balanced resampling draws random shuffles and plain GRPO does not; the prompts
    of each iteration must not depend on that."""
    seen = []

    def fake_rollouts(generator, batch_prompts, n, verify, *, seed, **kw):
        seen[-1].append([p[-1] for p in batch_prompts])
        rng = np.random.default_rng(seed)
        return [[SimpleNamespace(score=float(rng.integers(0, 2)), ids=[5, 6], finish_reason="length")
                 for _ in range(n)] for _ in batch_prompts]

    monkeypatch.setattr(grpo, "rollouts", fake_rollouts)  # no MAX generator: the prompts are what matters
    prompts = [[3, 4, i] for i in range(CFG.vocab_size)]
    logs = {}
    for balanced in (True, False):
        seen.append([])
        cfg = GRPOConfig(iterations=4, prompts_per_iter=3, samples_per_prompt=6, group_size=4, balanced=balanced,
                         epochs=1, seed=3)
        logs[balanced] = train_grpo(model(), lambda weights: None, prompts, lambda i, ids: 0.0, cfg, stop_id=1)
    assert seen[0] == seen[1]
    assert len({tuple(chosen) for chosen in seen[0]}) > 1  # a new choice every iteration
    assert [e.prompts for e in logs[True]] == [e.prompts for e in logs[False]] == seen[0]


def test_arithmetic_task():
    tok = arithmetic.make_tokenizer()
    p = arithmetic.Problem(12, 345)
    assert p.prompt == "12+345=" and p.answer == "357"
    assert tok.encode(p.prompt).ids == p.prompt_ids() == arithmetic.encode("12+345=")
    assert tok.get_vocab_size() == arithmetic.VOCAB_SIZE
    assert p.verify(arithmetic.encode("357") + [arithmetic.END_ID, 5]) == 1.0
    assert p.verify("357<e>99") == 1.0 and p.verify("357") == 1.0
    assert p.verify("3570") == 0.0 and p.verify("") == 0.0 and p.verify("35+7") == 0.0
    assert p.verify(arithmetic.encode("358") + [arithmetic.END_ID]) == 0.0
    # a model's vocabulary may be larger than the task's: such ids are wrong, not a crash
    assert p.verify(arithmetic.encode("35") + [arithmetic.VOCAB_SIZE + 1]) == 0.0
    assert tok.decode(p.target_ids()) == "357"
    probs = arithmetic.problems(50, 1, 3, seed=1)
    held = arithmetic.problems(20, 1, 3, seed=2, exclude=set(probs))
    assert not set(probs) & set(held)
    assert all(0 <= x.a < 1000 and 0 <= x.b < 1000 for x in probs)
    assert len(p.prompt_ids()) + len(p.target_ids()) <= arithmetic.max_length(3)


def test_a_time_budget_stops_before_the_next_iteration(monkeypatch):
    """With ``max_seconds`` no iteration starts once the budget is spent; each log says when
    its update ended."""
    clock = iter(range(0, 10_000, 10))  # every perf_counter call: 10 s later
    monkeypatch.setattr(grpo.time, "perf_counter", lambda: float(next(clock)))

    def fake_rollouts(generator, batch_prompts, n, verify, **kw):
        return [[SimpleNamespace(score=float(i % 2), ids=[5, 6], finish_reason="length") for i in range(n)]
                for _ in batch_prompts]

    monkeypatch.setattr(grpo, "rollouts", fake_rollouts)
    prompts = [[3, 4, i] for i in range(CFG.vocab_size)]
    cfg = GRPOConfig(iterations=50, prompts_per_iter=2, samples_per_prompt=4, group_size=4, epochs=1, seed=3,
                     max_seconds=100)
    log = train_grpo(model(), lambda weights: None, prompts, lambda i, ids: 0.0, cfg, stop_id=1)
    assert 1 < len(log) < 50
    assert all(e.elapsed > 0 for e in log) and [e.elapsed for e in log] == sorted(e.elapsed for e in log)
    assert log[-2].elapsed < 100 <= log[-1].elapsed + 10  # the last started within budget, the next would not


@pytest.mark.parametrize("field, value", [("iterations", 0), ("group_size", 2.0), ("samples_per_prompt", True),
                                          ("seed", -1), ("max_batch", 0), ("max_batch", "all"),
                                          ("lr", 0.0), ("beta", float("nan")), ("clip_eps", -0.1),
                                          ("temperature", float("inf")), ("max_seconds", 0), ("epochs", "2")])
def test_a_setting_out_of_range_is_named_before_any_rollout(field, value):
    with pytest.raises(ValueError, match=f"GRPOConfig.{field} must be"):
        GRPOConfig(**{field: value})
    assert GRPOConfig(max_batch="auto", max_seconds=1.5, beta=0, temperature=0).max_batch == "auto"


def test_arithmetic_problems_never_hold_an_excluded_one_even_when_they_must_repeat():
    held = set(arithmetic.problems(20, 1, 1, seed=3))
    many = arithmetic.problems(150, 1, 1, seed=4, exclude=held)  # 100 one-digit problems exist: 80 not held
    assert len(many) == 150 and not set(many) & held and len(set(many)) == 80
    every = {arithmetic.Problem(a, b) for a in range(10) for b in range(10)}
    with pytest.raises(ValueError, match="every one of the 100 problems of 1-1 digit operands is excluded"):
        arithmetic.problems(1, 1, 1, exclude=every)
    with pytest.raises(ValueError, match="count must be >= 0"):
        arithmetic.problems(-1)
