"""The PHA's whole-step decode op (mojo/pha_decode_step.mojo, the ``PHAEngine`` default on
a CPU) against the PyTorch reference and the plain-op decode graph (``kernels=False``).

tests/models/pha/test_pha_engine.py's CONFIG and weights, so its prefill and decode graphs are
shared; the op's graph is the one graph this file adds. The tests against the reference
start from the reference's prefill (its cache in the engine's state layout) and need the
op's graph alone; those against the plain graph (marked ``plain``) prefill with it. Context 160: the op's online
softmax runs over blocks of 32 cached rows, and a batch of one splits the context into
slices of at least 64 rows, so the prompts and steps here end inside, on and across
those edges. The ablations (the GSS branch alone, attention alone, each with the FFNs)
run through the op on configs of their own.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from srm_max.errors import GenerationError
from srm_max.runtime.call_types import SamplingArrays
from tests.support.checks import assert_close_rel
from tests.support.graphs import graphs
from tests.support.pha import (ATTENTION_ALONE, CONFIG, GSS_ALONE, assert_states_close, cpu_engine, prompts_of,
                               random_pha, ref_greedy, reference_start)
from tests.support.prompts import reference_prefill

# the op's engine runs its decode_steps graph only; the plain engine prefills and decodes
# for the tests that compare the two
pytestmark = graphs(CONFIG, ("decode_steps",), kernels=True)
plain_graphs = graphs(CONFIG, ("prefill", "decode"), kernels=False)
# the ablations, each through the op (its one graph: the graph holds no config)
ABLATIONS = {"gss_alone": GSS_ALONE, "attention_alone": ATTENTION_ALONE}
# Head widths that are a multiple of the vector width, where the op's attention reads each
# cached row once for the query heads of a group together (``_attn_group_blocks``: 8 / G
# key rows a pass of the logits, the sums in registers), groups of 1, 2 and 4 query heads;
# CONFIG's head width of 4 takes the loop of one head at a time. The 4 heads of 32 are the
# attention-alone ablation's. The op's graph holds no config: one graph for them all.
GROUPED_HEADS = {"2_heads_of_64": dataclasses.replace(CONFIG, d_model=128, n_q_heads=2, n_kv_heads=1),
                 "2_heads_of_64_each_its_own_kv": dataclasses.replace(CONFIG, d_model=128, n_q_heads=2, n_kv_heads=2),
                 "4_heads_of_32": ATTENTION_ALONE}


@pytest.fixture(scope="module")
def plain(weights):
    return cpu_engine(weights, plain=True)


@pytest.fixture(scope="module")
def op(weights):
    return cpu_engine(weights).load(["decode_steps"])


def op_engine(config, weights):
    """The op's engine of ``config``, its decode_steps graph loaded alone: the tests here
    decode from the reference's prefill, and under a virtual CPU target (the x86-64-v3
    guard) a PHA engine's first use would otherwise load, and compile, every graph."""
    from srm_max.models.pha.engine import PHAEngine

    engine = PHAEngine(config, weights, dtype="float32", device="cpu").load(["decode_steps"])
    assert engine.steps_in_one_op
    return engine


def decode_op(op, reference, prompts, calls):
    """The op's greedy decode calls from the reference's prefill: (tokens, states, positions)."""
    ids, states = reference_start(reference, prompts, op)
    pos, tokens = np.array([len(p) for p in prompts]), []
    for steps in calls:
        res = op.decode(ids, pos, states, SamplingArrays.greedy(len(prompts)), steps)
        assert res.tokens.shape == (len(prompts), steps)
        np.testing.assert_array_equal(op.host(res.ids), res.tokens[:, -1])
        tokens.append(res.tokens)
        ids, pos, states = res.ids, op.host(res.positions), res.states
    return np.concatenate(tokens, 1), states, pos


def assert_same_states(op, plain, got, expected, filled, rel=1e-4):
    """The op's states against the plain graph's: GSS states, and the KV caches up to
    each sample's ``filled`` rows (later rows are padding or unused)."""
    a, b = op.split_states(got), plain.split_states(expected)
    assert_close_rel(a["gss_state"], b["gss_state"], rel)
    for name in ("keys", "values"):
        for s, f in enumerate(filled):
            assert_close_rel(a[name][:, s, :, :f], b[name][:, s, :, :f], rel)


def decode_both(op, plain, prompts, calls, sampling=None):
    """Prefill (the plain engine's, shared), then the same decode calls on both engines:
    -> (op tokens, plain tokens, op states, plain states, positions after)."""
    pre = plain.prefill(prompts)
    sampling = sampling or SamplingArrays.greedy(len(prompts))
    out = []
    for engine in (op, plain):
        ids, pos, states, tokens = pre.next_ids, np.array([len(p) for p in prompts]), pre.states, []
        for steps in calls:
            res = engine.decode(ids, pos, states, sampling, steps)
            assert res.tokens.shape == (len(prompts), steps)
            tokens.append(res.tokens)
            ids, pos, states = res.ids, res.positions, res.states
        out.append((np.concatenate(tokens, 1), states, engine.host(pos), engine.host(ids)))
    (t_op, s_op, p_op, i_op), (t_plain, s_plain, p_plain, _) = out
    np.testing.assert_array_equal(p_op, p_plain)
    np.testing.assert_array_equal(i_op, t_op[:, -1])
    return t_op, t_plain, s_op, s_plain, p_op


def test_greedy_batch_equals_the_reference(op, reference):
    # prompts ending inside the first block of 32 rows, one short of the second edge,
    # past 4 blocks, and near the context; 12 steps cross the edges at 64 and 160 = n
    lengths = [1, 63, 148, 13]
    prompts = prompts_of(lengths, seed=1)
    calls = [4, 1, 7]
    tokens, states, pos = decode_op(op, reference, prompts, calls)
    np.testing.assert_array_equal(pos, np.array(lengths) + sum(calls))
    expected, cache = ref_greedy(reference, prompts, 1 + sum(calls))
    np.testing.assert_array_equal(tokens, expected[:, 1:])
    assert_states_close(op, states, cache, pos)


@pytest.mark.parametrize("length", [1, 31, 64, 97])
def test_greedy_batch_of_one_across_blocks_and_slices(op, reference, length):
    """Alone, a sample's context is cut into slices (two at this context): each length
    puts the slices' and blocks' edges elsewhere, and the steps move them on."""
    (prompt,) = prompts_of([length], seed=2 + length)
    calls = [17, 23]
    tokens, states, pos = decode_op(op, reference, [prompt], calls)
    expected, cache = ref_greedy(reference, [prompt], 1 + sum(calls))
    np.testing.assert_array_equal(tokens, expected[:, 1:])
    assert_states_close(op, states, cache, pos)


def test_a_sample_past_the_context_leaves_its_batch_mates_alone(op, reference):
    """One call of 8 steps: the long prompt reaches n after 2 tokens and runs on past it
    inside the call (writing its last cache row, reading no other sample's); the short
    one's tokens and states are the reference's."""
    short, long = prompts_of([3, 158], seed=8)
    tokens, states, _ = decode_op(op, reference, [short, long], [8])
    expected, cache = ref_greedy(reference, [short], 9)
    np.testing.assert_array_equal(tokens[0], expected[0, 1:])
    assert_states_close(op, op.host(states)[:, :1], cache, [11])
    np.testing.assert_array_equal(tokens[1, :2], ref_greedy(reference, [long], 3)[0][0, 1:])


@plain_graphs
def test_greedy_tokens_and_states_equal_the_plain_graphs(op, plain):
    lengths = [1, 63, 148, 13]
    t_op, t_plain, s_op, s_plain, pos = decode_both(op, plain, prompts_of(lengths, seed=1), [4, 1, 7])
    np.testing.assert_array_equal(t_op, t_plain)
    assert_same_states(op, plain, s_op, s_plain, pos)


@plain_graphs
def test_sampled_tokens_equal_the_plain_graphs_draws(op, plain):
    """Temperature, top-k and top-p per sample (greedy for one): the op draws with
    row_sampler.mojo what the plain graph's sampler draws, at the same counters."""
    prompts = prompts_of([5, 40, 77], seed=3)
    sampling = SamplingArrays(np.array([0.8, 0.0, 1.1], np.float32), np.array([0, 0, 7], np.int64),
                              np.array([0.9, 1.0, 1.0], np.float32), np.array([11, 12, 13], np.uint64))
    t_op, t_plain, s_op, s_plain, pos = decode_both(op, plain, prompts, [6, 9], sampling)
    np.testing.assert_array_equal(t_op, t_plain)
    assert_same_states(op, plain, s_op, s_plain, pos)
    plain_only = SamplingArrays(sampling.temperature, np.zeros(3, np.int64), np.ones(3, np.float32), sampling.seed)
    t_op, t_plain, *_ = decode_both(op, plain, prompts, [5], plain_only)
    np.testing.assert_array_equal(t_op, t_plain)


def test_no_steps_returns_the_inputs_and_leaves_the_caller_states(op, reference):
    prompts = prompts_of([9, 20], seed=4)
    ids, states = reference_start(reference, prompts, op)
    before = op.host(states).copy()
    res = op.decode(ids, np.array([9, 20]), states, SamplingArrays.greedy(2), 0)
    assert res.tokens.shape == (2, 0)
    np.testing.assert_array_equal(op.host(res.ids), ids)
    np.testing.assert_array_equal(op.host(res.positions), [9, 20])
    op.decode(ids, np.array([9, 20]), states, SamplingArrays.greedy(2), 3)
    np.testing.assert_array_equal(op.host(states), before)  # decode works on a copy


@pytest.mark.parametrize("engine", ["op", pytest.param("plain", marks=plain_graphs)])
def test_donated_states_are_written_in_place_and_decode_the_same(request, engine, reference):
    """``donate_states`` (the slot pool's own states) skips the copy of every cache: the
    same tokens and states as a decode on a copy, written into the caller's buffer."""
    engine = request.getfixturevalue(engine)
    prompts = prompts_of([9, 70], seed=8)
    ids, states = reference_start(reference, prompts, engine)
    pos, greedy = np.array([9, 70]), SamplingArrays.greedy(2)
    before = engine.host(states).copy()
    on_copy = engine.decode(ids, pos, states, greedy, 5)
    np.testing.assert_array_equal(engine.host(states), before)
    donated = engine.decode(ids, pos, states, greedy, 5, donate_states=True)
    np.testing.assert_array_equal(donated.tokens, on_copy.tokens)
    np.testing.assert_array_equal(engine.host(donated.states), engine.host(on_copy.states))
    np.testing.assert_array_equal(engine.host(states), engine.host(on_copy.states))


@pytest.mark.parametrize("name", [pytest.param(name, marks=graphs(config, ("decode_steps",), kernels=True))
                                  for name, config in ABLATIONS.items()])
def test_the_ablations_through_the_op_equal_the_reference(name):
    """The GSS branch alone (no KV cache in the state) and attention alone (no GSS state),
    greedy from prompts crossing the blocks and slices, in calls of several steps."""
    config = ABLATIONS[name]
    reference = random_pha(config, seed=5)
    engine = op_engine(config, {k: v.detach().numpy().astype(np.float32) for k, v in reference.state_dict().items()})
    lengths = [1, 33, 97, 140]
    prompts = prompts_of(lengths, seed=6)
    calls = [5, 1, 6]
    tokens, states, pos = decode_op(engine, reference, prompts, calls)
    expected, cache = ref_greedy(reference, prompts, 1 + sum(calls))
    np.testing.assert_array_equal(tokens, expected[:, 1:])
    assert_states_close(engine, states, cache, pos)


@pytest.mark.parametrize("name", [pytest.param(name, marks=graphs(config, ("decode_steps",), kernels=True))
                                  for name, config in GROUPED_HEADS.items()])
@pytest.mark.parametrize("lengths", [[1, 33, 97, 140], [97]])
def test_query_heads_read_in_groups_equal_the_reference(name, lengths):
    """The grouped attention loop, greedy from prompts ending on and across its blocks of
    32 rows and the context's slices (a batch of one cuts it in two)."""
    config = GROUPED_HEADS[name]
    reference = random_pha(config, seed=7)
    engine = op_engine(config, {k: v.detach().numpy().astype(np.float32) for k, v in reference.state_dict().items()})
    prompts = prompts_of(lengths, seed=9)
    calls = [5, 1, 6]
    tokens, states, pos = decode_op(engine, reference, prompts, calls)
    expected, cache = ref_greedy(reference, prompts, 1 + sum(calls))
    np.testing.assert_array_equal(tokens, expected[:, 1:])
    assert_states_close(engine, states, cache, pos)


def test_the_op_is_the_cpu_default_and_refused_where_it_cannot_run(weights):
    """On by default on a CPU, for float32 and bfloat16 weights alike
    (tests/models/pha/test_pha_decode_op_bf16.py); ``kernels=False`` gives the plain
    graph; the sequential block decodes on the plain graph by default (its prefill takes
    the prefill's Mojo ops) and is refused by ``kernels=True``, naming why (no graph is
    compiled here)."""
    from srm_max.models.pha.engine import PHAEngine

    assert PHAEngine(CONFIG, weights).steps_in_one_op
    assert not PHAEngine(CONFIG, weights, kernels=False).steps_in_one_op
    assert PHAEngine(CONFIG, weights, dtype="bfloat16").steps_in_one_op
    sequential = dataclasses.replace(CONFIG, mode="sequential")
    weights = {k: v.detach().numpy() for k, v in random_pha(sequential).state_dict().items()}
    default = PHAEngine(sequential, weights)
    assert default.kernels and not default.steps_in_one_op
    assert default.graph_job("prefill").kernels and "decode" in default.graph_kinds()
    with pytest.raises(GenerationError, match="parallel block only"):
        PHAEngine(sequential, weights, kernels=True)


def test_load_refuses_a_graph_the_engine_does_not_run(op):
    with pytest.raises(ValueError, match="no decode graph; it runs prefill, sample"):
        op.load(["decode"])  # the op's engine decodes in decode_steps (nothing compiled here)


def test_the_suite_compiles_every_graph_these_tests_load(request, op, plain):
    """The op's engine loads its decode_steps graph alone here; the plain one, its prefill
    and decode for the tests marked ``plain_graphs``."""
    from tests.support.graphs import declared_graph_jobs

    assert "decode_steps" in op.graph_kinds() and "decode" not in op.graph_kinds()
    assert set(declared_graph_jobs([request.node])) == {op.graph_job("decode_steps")}
    assert set(op.compile_seconds) - {"parallel_compile"} == {"decode_steps"}  # loaded, the others not
    uses_plain = [item for item in request.session.items if item.module is request.module and
                  item.name.startswith(("test_greedy_tokens_and_states_equal", "test_sampled_tokens_equal"))]
    if uses_plain:
        assert set(declared_graph_jobs(uses_plain)) == {op.graph_job("decode_steps"), plain.graph_job("prefill"),
                                                         plain.graph_job("decode"), plain.graph_job("sample")}


def test_one_compiled_graph_of_the_op_serves_every_config():
    """The op's graph holds no model, so the configs here (every branch, each ablation,
    both grouped head widths) share one graph and its one cache file per weight dtype,
    and it binds no weight: it compiles with the graphs any engine loads (the sampler's),
    not with one engine's (no graph is compiled here)."""
    from srm_max.models import registry

    configs = [CONFIG, *ABLATIONS.values(), *GROUPED_HEADS.values()]
    for dtype in ("float32", "bfloat16"):
        jobs = [registry.of(c).graph_job("decode_steps", c, dtype, "cpu", True) for c in configs]
        assert len({job.mef_path() for job in jobs}) == 1
        assert jobs[0].unit_key() == (jobs[0].device, jobs[0].cpu_target)  # the key of a graph binding no weight
