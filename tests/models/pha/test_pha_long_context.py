"""The PHA engine's ablation switches and bfloat16 weights against the reference, at a
context that crosses several GSS prefill chunks (``CHUNK`` = 64).

One config holds every switch at once, since each distinct graph is a cold compile of
minutes: sequential mode, the attention branch off (the state is the GSS state alone),
an output head of its own, bfloat16 weights. The engine is a CPU's default for it: the
prefill's GSS scan op (mojo/pha_gss_scan.mojo) and the one-step decode graph (the decode
op runs the parallel block only). The float32 config with every branch on is
tests/models/pha/test_pha_engine.py's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from srm_max.graphs.pha import CHUNK, matrix_names
from srm_max.runtime.call_types import SamplingArrays
from tests.support.checks import assert_close_rel
from tests.support.graphs import graphs
from tests.support.pha import CONFIG, assert_states_close, bf16_rounded, prompts_of, random_pha, ref_greedy
from tests.support.prompts import reference_prefill

# tests/support/pha.py's CONFIG with the switches (its vocabulary too: one sample graph)
ABLATION = dataclasses.replace(CONFIG, branches=("gss", "ffn"), mode="sequential", tie_embeddings=False)
pytestmark = graphs(ABLATION, ("prefill", "decode"), "bfloat16", kernels=True)


@pytest.fixture(scope="module")
def rounded_reference():
    """The float32 reference with its big matrices rounded to bfloat16, so what is left
    between it and the engine is the rounding of the activations entering each matmul."""
    assert "lm_head.weight" in matrix_names(ABLATION)
    return bf16_rounded(random_pha(ABLATION, seed=3))


@pytest.fixture(scope="module")
def engine():
    from srm_max.models.pha.engine import PHAEngine

    weights = {k: v.detach().numpy().astype(np.float32) for k, v in random_pha(ABLATION, seed=3).state_dict().items()}
    return PHAEngine(ABLATION, weights, dtype="bfloat16", device="cpu")


def test_ablation_layout_has_no_kv_cache(engine):
    assert engine.dtype == "bfloat16" and engine.layout.kv == 0
    assert engine.kernels and not engine.steps_in_one_op  # the prefill's ops, the one-step decode graph
    split = engine.split_states(engine.empty_states(2))
    assert split["keys"] is None and split["values"] is None
    assert split["gss_state"].shape == (2, 2, ABLATION.gss_hidden_dim, ABLATION.dss_state_size)


def test_ablation_with_bfloat16_weights_matches_the_reference_across_chunks(engine, rounded_reference):
    """Prompts ending inside chunk 0, on its last token, in chunks 1 and 2; then greedy
    decode steps from there (tokens and GSS states)."""
    lengths = [2, CHUNK, 70, 150]
    prompts = prompts_of(lengths, seed=11, config=ABLATION)
    res = engine.prefill(prompts)
    ref_logits, cache = reference_prefill(rounded_reference, prompts)
    assert_close_rel(engine.host(res.logits), ref_logits, 3e-2)
    assert (res.next_ids == ref_logits.argmax(-1)).all()
    assert_states_close(engine, res.states, cache, lengths, 3e-2)
    steps = 6
    expected, cache = ref_greedy(rounded_reference, prompts, 1 + steps)
    out = engine.decode(res.next_ids, np.array(lengths), res.states, SamplingArrays.greedy(len(prompts)), steps)
    np.testing.assert_array_equal(np.concatenate([res.next_ids[:, None], out.tokens], 1), expected)
    assert_states_close(engine, out.states, cache, np.array(lengths) + steps, 3e-2)


def test_the_suite_compiles_every_graph_these_tests_load(request, engine):
    from tests.support.graphs import declared_graph_jobs

    assert {engine.graph_job(kind) for kind in ("prefill", "decode", "sample")} == set(
        declared_graph_jobs([request.node]))
