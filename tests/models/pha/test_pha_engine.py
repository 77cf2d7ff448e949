"""The MAX PHA engine (graphs/pha/, PHAEngine) and the Generator serving PHA
checkpoints, against the PyTorch reference (reference/pha.py) on the same weights.

ONE tiny config for the whole file: its graphs (prefill, the decode op, the sampler;
float32, CPU) are compiled once and cached as .mef files (see compile_cache), so
later runs load them in milliseconds. Context 160 = 2.5 GSS prefill chunks of
``CHUNK`` = 64, so prompts cross chunks. The ablation configs and bfloat16 weights
are in tests/models/pha/test_pha_long_context.py (graphs of their own, which the AVX2 rerun of
tests/runtime/test_cpu_target.py does not recompile).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srm_max.errors import GenerationError
from srm_max.runtime.call_types import SamplingArrays
from tests.support.sampler_mirror import draw_np, filtered_probs
from tests.support.checks import assert_close_rel, assert_prefill_matches_reference
from tests.support.graphs import graphs
from tests.support.pha import CONFIG, assert_states_close, prompts_of, ref_greedy

# the engine's default on a CPU decodes through the op (decode_steps); the plain decode
# graph is tests/models/pha/test_pha_decode_op.py's reference
pytestmark = graphs(CONFIG, ("prefill", "decode_steps", "sample", "regroup"))


@pytest.fixture(scope="module")
def engine(weights):
    from srm_max.models.pha.engine import PHAEngine

    return PHAEngine(CONFIG, weights, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights):
    from srm_max.checkpoints.format import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("pha") / "ckpt", CONFIG, weights)


@pytest.fixture(scope="module")
def generator(checkpoint):
    from srm_max.serve.generator import Generator

    return Generator.from_pretrained(checkpoint, device="cpu")


# ------------------------------------------------------------------------ engine


def test_prefill_logits_and_states_match_reference(engine, reference):
    # mixed, right-padded in one batch: inside chunk 0, on its last token, in chunk 1, the full context
    lengths = [1, 64, 100, 160]
    prompts = prompts_of(lengths)
    res, logits, cache = assert_prefill_matches_reference(engine, reference, prompts, CONFIG.vocab_size)
    assert engine.host(res.states).shape == (CONFIG.n_layers, len(prompts), engine.layout.width)
    assert_states_close(engine, res.states, cache, lengths)
    # a prompt alone gives what it gives in the padded batch
    alone = engine.host(engine.prefill(prompts[1:2]).logits)
    assert_close_rel(logits[1:2], alone, rel=1e-6)


def test_multi_step_greedy_decode_matches_reference(engine, reference):
    lengths = [1, 63, 148, 13]
    prompts = prompts_of(lengths, seed=1)
    calls = [4, 1, 6]  # 12 new tokens: the longest prompt ends at 148 + 12 = 160 = n
    expected, cache = ref_greedy(reference, prompts, 1 + sum(calls))
    pre = engine.prefill(prompts)
    tokens, states = [pre.next_ids[:, None]], pre.states
    ids, pos = pre.next_ids, np.array(lengths)
    sampling = SamplingArrays.greedy(len(prompts))
    for steps in calls:
        res = engine.decode(ids, pos, states, sampling, steps)
        assert res.tokens.shape == (len(prompts), steps)
        tokens.append(res.tokens)
        states, ids, pos = res.states, res.ids, res.positions
    np.testing.assert_array_equal(np.concatenate(tokens, 1), expected)
    np.testing.assert_array_equal(engine.host(pos), np.array(lengths) + sum(calls))
    # the states after the last call: every token but the newest fed in
    assert_states_close(engine, states, cache, np.array(lengths) + sum(calls))


def test_generate_greedy_equals_reference_generate(generator, reference):
    from srm_max.models.pha.engine import PHAEngine

    assert isinstance(generator.engine, PHAEngine)
    prompts = prompts_of([3, 11], seed=2)
    outs = generator.generate(prompts, max_new_tokens=9, steps_per_call=4)
    for p, out in zip(prompts, outs):
        expected = reference.generate_greedy(torch.tensor(p), 9).tolist()
        assert out.ids == expected and out.finish_reason == "length"
    # a prompt near the context stops there
    (p,) = prompts_of([156], seed=3)
    out = generator.generate(p, max_new_tokens=10)
    assert out.finish_reason == "context"
    assert out.ids == reference.generate_greedy(torch.tensor(p), 4).tolist()


def test_sampled_tokens_follow_the_seed_and_the_reference_distribution(generator, reference):
    prompts = prompts_of([4, 9], seed=4)
    # hot enough that the random model's peaked logits (std about 4) leave several candidates
    options = dict(max_new_tokens=8, temperature=2.5, top_k=12, top_p=0.9, steps_per_call=3)
    first = generator.generate(prompts, seed=5, **options)
    again = generator.generate(prompts, seed=5, **options)
    other = generator.generate(prompts, seed=6, **options)
    assert [o.ids for o in first] == [o.ids for o in again]
    assert [o.ids for o in first] != [o.ids for o in other]
    # each token is the documented draw (sampler_mirror.draw_np) from the reference's logits
    for i, (p, out) in enumerate(zip(prompts, first)):
        seq = torch.tensor(p + out.ids)
        with torch.no_grad():
            logits = reference(seq.view(1, -1))[0].numpy()
        for j, token in enumerate(out.ids):
            t = len(p) + j  # the position of the drawn token is its counter
            probs = filtered_probs(logits[t - 1], 2.5, 12, 0.9)
            assert token == draw_np(probs, 5 + i, t), f"prompt {i}, token {j}"


def test_slot_pool_refills_pha_states(generator):
    """sample_many copies prefilled states into slots: each sample equals generating it alone."""
    prompts = prompts_of([5, 12], seed=7)
    samples = list(generator.sample_many(prompts, n=3, max_batch=2, max_new_tokens=5, temperature=0.8, seed=1))
    assert len(samples) == 6
    for s in samples:
        alone = generator.generate(prompts[s.prompt_index], max_new_tokens=5, temperature=0.8, seed=s.seed)
        assert s.ids == alone.ids


def test_generator_builds_a_pha_engine_from_config_and_weights(weights):
    from srm_max.serve.generator import Generator
    from srm_max.models.pha.engine import PHAEngine

    gen = Generator(CONFIG, weights, device="cpu", warmup=False)
    assert isinstance(gen.engine, PHAEngine) and gen.engine.dtype == "float32"
    assert gen.engine.steps_in_one_op  # the Generator decodes through the op on a CPU
    states = gen.engine.empty_states(3)
    split = gen.engine.split_states(states)
    H, N = CONFIG.gss_hidden_dim, CONFIG.dss_state_size
    assert split["gss_state"].shape == (2, 3, H, N)
    assert split["keys"].shape == (2, 3, CONFIG.n_kv_heads, CONFIG.context_length, CONFIG.head_dim)
    with pytest.raises(GenerationError, match="prompt 0 has 161 tokens"):
        gen.engine.prefill([[1] * 161])
    bad = dict(weights)
    bad.pop("blocks.1.branches.attn.logit_scale")
    with pytest.raises(GenerationError, match="missing key 'blocks.1.branches.attn.logit_scale'"):
        Generator(CONFIG, bad, device="cpu", warmup=False)


def test_slot_pool_plans_pha_batches_by_their_state_size():
    from srm_max.graphs.pha import StateLayout
    from srm_max.serve.sample_many import plan_max_batch

    budget = 64 << 20
    per_sample = CONFIG.n_layers * StateLayout.of(CONFIG).width * 4  # GSS state + KV caches
    assert 1 <= plan_max_batch(CONFIG, memory_budget_bytes=budget) < budget // per_sample


def test_a_sample_past_the_context_does_not_disturb_its_batch_mates(generator, reference):
    """Decode calls of 8 steps: the long prompt hits the context after 2 tokens and runs on
    past n inside the call (positions >= n write nothing); the short one is unaffected."""
    short, long = prompts_of([3, 158], seed=8)
    outs = generator.generate([short, long], max_new_tokens=12, steps_per_call=8)
    assert outs[0].ids == reference.generate_greedy(torch.tensor(short), 12).tolist()
    assert outs[1].ids == reference.generate_greedy(torch.tensor(long), 2).tolist()
    assert [o.finish_reason for o in outs] == ["length", "context"]


def test_stream_yields_the_generated_tokens(generator):
    prompts = prompts_of([6, 2], seed=9)
    options = dict(max_new_tokens=5, temperature=0.7, seed=3)
    streamed = {0: [], 1: []}
    for event in generator.stream(prompts, **options):
        for b, token in event.tokens.items():
            streamed[b].append(token)
    assert [streamed[0], streamed[1]] == [o.ids for o in generator.generate(prompts, **options)]


def test_the_suite_compiles_every_graph_these_tests_load(request, engine):
    """This module's ``graphs`` marker names exactly the graphs its engine loads, or CI compiles twice."""
    from tests.support.graphs import declared_graph_jobs

    assert {engine.graph_job(kind) for kind in engine.graph_kinds()} == set(declared_graph_jobs([request.node]))
