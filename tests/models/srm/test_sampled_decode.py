"""Sampled decode inside the whole-step op (mojo/decode_step.mojo with
mojo/row_sampler.mojo): on the CPU with the Mojo kernels every decode, greedy or
sampled, runs all its steps in one op; single steps of the whole-step op, each followed by
MAX's sampler ops (graphs/sampler.py; tests/support/single_steps.py), must give the same
tokens and states."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import Buffer

from srm_max.graphs import sampler
from srm_max.graphs.op_names import OP_SAMPLE_ROWS
from srm_max.runtime.call_types import SamplingArrays
from tests.support.sampler_mirror import filtered_probs
from tests.support.graphs import graphs, op_graphs
from tests.support.op_graphs import model as op_graph_model
from tests.support.prompts import random_prompts
from tests.support.single_steps import decode_in_single_steps, single_step_graphs
from tests.support.tiny import TINY

pytestmark = [graphs(TINY), graphs(TINY, dtype="bfloat16")]

# the graphs test_engine.py declares too: the session compiles them once

# (temperature, top_k, top_p) per row: greedy, plain temperatures, top-k in a sorted buffer
# (k <= V / 8) and by bins, top-p alone and after top-k
ROWS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 0, 1.0), (1.0, 5, 1.0), (0.8, 1, 1.0),
        (1.0, 20, 1.0), (1.0, 0, 0.9), (1.2, 0, 0.5), (1.0, 5, 0.9), (0.9, 40, 0.8), (0.0, 3, 0.5)]


def sampling_of(rows, seeds) -> SamplingArrays:
    t, k, p = (np.array(c) for c in zip(*rows))
    return SamplingArrays(t.astype(np.float32), k.astype(np.int64), p.astype(np.float32),
                          np.asarray(seeds, np.uint64))


@pytest.mark.parametrize("dtype", [pytest.param(dtype, marks=single_step_graphs(dtype))
                                   for dtype in ("float32", "bfloat16")])
@pytest.mark.parametrize("filtered", [True, False])
def test_sampled_decode_in_one_op_equals_single_steps(engine, engine_bf16, dtype, filtered):
    """A mixed batch (greedy rows, plain temperatures, top-k, top-p, several seeds;
    with ``filtered`` False no row filters: the plain mode) draws in the one op the
    tokens that single steps draw, and ends in bit for bit the same states, ids and
    positions, also where positions run past the context (clamped)."""
    engine = engine if dtype == "float32" else engine_bf16
    assert engine.steps_in_one_op
    rows = ROWS if filtered else [(t, 0, 1.0) for t, _, _ in ROWS]
    rows = rows + rows  # every kind of row with two seeds
    n = TINY.context_length
    lengths = [1 + (13 * i) % (n - 8) for i in range(len(rows) - 2)] + [n - 3, n]
    prompts = random_prompts(lengths, TINY.vocab_size, seed=5)
    s = sampling_of(rows, 1000 + 7 * np.arange(len(rows)))
    assert s.mode() == (sampler.MODE_FILTERED if filtered else sampler.MODE_PLAIN)
    pre = engine.prefill(prompts, s)
    states = engine.host(pre.states)
    steps = 9
    one_op = engine.decode(pre.next_ids, lengths, engine.to_device(states), s, steps)
    toks, stepped_states, last, pos = decode_in_single_steps(engine, pre.next_ids, lengths, engine.to_device(states),
                                                             s, steps)
    np.testing.assert_array_equal(one_op.tokens, toks)
    np.testing.assert_array_equal(engine.host(one_op.states), stepped_states)
    np.testing.assert_array_equal(engine.host(one_op.ids), last)
    np.testing.assert_array_equal(engine.host(one_op.positions), pos)
    drawn = np.array([t > 0 for t, _, _ in rows])
    assert len({tuple(r) for r in one_op.tokens[drawn]}) > 1  # the draws are not all alike


def test_a_sampled_sample_draws_the_same_in_one_call_or_several(engine):
    """The draw's random counter is the new token's position: 8 steps in one call and
    in calls of 3, 1 and 4 steps give the same tokens."""
    rows = ROWS[1:5] + ROWS[7:10]
    prompts = random_prompts([4, 30, 9, 50, 2, 17, 41], TINY.vocab_size, seed=8)
    lengths = [len(p) for p in prompts]
    s = sampling_of(rows, np.arange(len(rows)) + 77)
    pre = engine.prefill(prompts, s)
    whole = engine.decode(pre.next_ids, lengths, pre.states, s, 8).tokens
    ids, pos, states, parts = pre.next_ids, np.array(lengths), pre.states, []
    for steps in (3, 1, 4):
        out = engine.decode(ids, pos, states, s, steps)
        parts.append(out.tokens)
        ids, pos, states = out.ids, out.positions, out.states
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


# rows the decode op's draw must get right beyond a model's logits (V = 4096, the
# benchmark's vocabulary): the nucleus is found among a few candidates (small top-k, top-p
# over peaked rows) or by bins and a sort of one bin (flat rows, large top-k)
CRAFTED_V = 4096


def crafted_rows(V: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(21)
    peaked = rng.normal(0, 1, V)
    peaked[17] = 14.0
    zipf = -1.1 * np.log1p(rng.permutation(V))  # a language model's long tail
    far = rng.normal(0, 1, V)
    far[::3] = -1e4  # weights that underflow to zero: the last bin
    return {
        "normal": rng.normal(0, 1, V),
        "wide": rng.normal(0, 6, V),
        "ties": rng.integers(0, 6, V).astype(np.float64),  # six values, hundreds of each
        "flat": np.zeros(V),  # one value: every token in the first bin
        "peaked": peaked,
        "zipf": zipf,
        "far": far,
        # a random model's spread (bench/common.py's SRM: std about 9): weights from 1 down
        # to e^-60, so the whole-row sums are not exact and their error bound decides
        "model-like": rng.normal(0, 9, V),
    }


# (temperature, top_k, top_p): top-p alone from keeping one token to nearly all, top-k on
# candidates in the sorted buffer (<= 64) or sorted (65 .. 256) and by bins (> 256, up to
# V), with and without top-p
CRAFTED_PARAMS = [(1.0, 0, 0.9), (1.0, 0, 1e-6), (0.7, 0, 0.5), (1.0, 0, 0.9999999), (1.3, 0, 0.98),
                  (1.0, 5, 0.9), (1.0, 64, 0.8), (1.0, 65, 0.8), (1.0, 100, 1.0), (1.0, 256, 0.9),
                  (1.0, 257, 0.9), (1.0, 1000, 0.95), (1.0, 3000, 0.999), (1.0, CRAFTED_V, 0.95),
                  (1.0, CRAFTED_V, 1.0), (1.0, 0, 1.0)]


@op_graphs(OP_SAMPLE_ROWS, vocab=CRAFTED_V)
def test_the_op_draws_the_graphs_nucleus_on_crafted_rows():
    """Ties, flat, peaked, long-tailed and underflowing rows, with top-p alone (keeping
    one token up to nearly all), small and large top-k, alone and with top-p: the op
    draws bit for bit the graph's tokens, each inside the numpy reference's nucleus."""
    rows = crafted_rows(CRAFTED_V)
    cases = [(name, t, k, p, seed) for name in rows for t, k, p in CRAFTED_PARAMS for seed in range(4)]
    logits = np.stack([rows[name] for name, *_ in cases]).astype(np.float32)
    t, k, p, seed = (np.array([c[i] for c in cases]) for i in range(1, 5))
    inputs = [logits, t.astype(np.float32), k.astype(np.int64), p.astype(np.float32),
              (seed * 7919 + 3).astype(np.uint64), np.full(len(cases), 40, np.int64),
              np.array(sampler.MODE_FILTERED, np.int64)]
    model = op_graph_model(OP_SAMPLE_ROWS, vocab=CRAFTED_V)  # sampler.sample's tokens and the op's
    graph_tokens, op_tokens = (r.to_numpy() for r in model.execute(*(Buffer.from_numpy(x) for x in inputs)))
    np.testing.assert_array_equal(op_tokens, graph_tokens)
    for (name, t_, k_, p_, _), token, row in zip(cases, op_tokens, logits):
        assert filtered_probs(row, t_, k_, p_)[token] > 0, (name, t_, k_, p_)
    tiny = [i for i, c in enumerate(cases) if c[3] == 1e-6]  # top-p that keeps the largest only
    assert all(logits[i, op_tokens[i]] == logits[i].max() for i in tiny)
