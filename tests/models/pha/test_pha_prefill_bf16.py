"""The PHA's bfloat16 prefill on a CPU with the Mojo ops (the ``PHAEngine`` default for
bfloat16 weights: the tiled attention op, mojo/pha_prefill_attention.mojo, the GSS scan
op, mojo/pha_gss_scan.mojo, and the dense layers through the linear op, mojo/linear.mojo,
which rounds each product as MAX's bfloat16 matmul does) against the float32 PyTorch
reference, and against the bfloat16 decode op (mojo/pha_decode_step.mojo) one token on.

tests/support/pha.py CONFIG and its weights; context 160: the prompts end inside, on and
after the attention op's query tiles (32 rows on AVX2, 64 on AVX-512) and the GSS chunks
(64 tokens). The file compiles the bfloat16 prefill graph with the ops; the bfloat16 decode
op's graph is tests/models/pha/test_pha_decode_op_bf16.py's.

Bounds (measured on the 2-core EPYC over these lengths with four prompt seeds):
- against the float32 reference with the engine's bfloat16 matrices rounded to bfloat16
  (``bf16_rounded``): the log-probabilities at each prompt's end within ``REF_LOGPROB``, the
  GSS states and each sample's KV rows within ``REF_REL`` of their largest value: the
  rounding of the activations entering and leaving every product;
- prefill of a prompt, then one decode step through the op, against a prefill of the prompt
  with that token: the next token's log-probability within ``STEP_LOGPROB`` and the states
  within ``STEP_REL``; the two paths round the same products, in sums of another order.
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_LINEAR, OP_PHA_GSS_SCAN, OP_PHA_PREFILL_ATTENTION, OP_PHA_QK_ROPE
from srm_max.runtime.call_types import SamplingArrays
from tests.support.checks import assert_close_rel
from tests.support.graphs import graphs
from tests.support.pha import CONFIG, assert_states_close, bf16_rounded, cpu_engine, prompts_of, random_pha
from tests.support.prompts import reference_prefill

pytestmark = graphs(CONFIG, ("prefill", "decode_steps"), "bfloat16", kernels=True)

REF_LOGPROB = 0.2  # measured 0.087
REF_REL = 4e-2  # measured 1.7e-2
STEP_LOGPROB = 1e-5  # measured 1.6e-7
STEP_REL = 1e-5  # measured 2.1e-7; tokens equal
# lengths across the attention tiles and the GSS chunks, up to the context
LENGTHS = [1, 31, 33, 64, 65, 100, 129, 159]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def engine(weights):
    return cpu_engine(weights, "bfloat16")


def test_the_bfloat16_prefill_graph_takes_the_ops_and_its_dense_layers_the_linear_op(engine):
    """Built, not compiled: with bfloat16 weights the CPU prefill runs the ops, and every
    dense layer (the GSS's four, the attention's four, each FFN's two, the output layer)
    through the linear op rather than MAX's bfloat16 matmul."""
    graph = str(engine.graph_job("prefill").graph())
    assert OP_PHA_PREFILL_ATTENTION in graph and OP_PHA_QK_ROPE in graph and OP_PHA_GSS_SCAN in graph
    per_block = 4 * ("gss" in CONFIG.branches) + 4 * ("attn" in CONFIG.branches) + 2 * len(CONFIG.ffn_dims)
    assert graph.count(OP_LINEAR) >= CONFIG.n_layers * per_block + 1


def test_prefill_matches_the_reference_with_rounded_matrices(engine):
    prompts = prompts_of(LENGTHS, seed=11)
    res = engine.prefill(prompts)
    ref_logits, cache = reference_prefill(bf16_rounded(random_pha()), prompts)
    assert np.abs(log_softmax(engine.host(res.logits)) - log_softmax(ref_logits)).max() <= REF_LOGPROB
    assert_states_close(engine, res.states, cache, LENGTHS, rel=REF_REL)


def test_a_decode_step_through_the_op_continues_the_prefill(engine):
    """Prefill, then the op decodes the first new token's successor: what a prefill of the
    prompt with that token gives (log-probability, greedy token, states)."""
    prompts = prompts_of(LENGTHS, seed=12)
    pre = engine.prefill(prompts)
    step = engine.decode(pre.next_ids, np.array(LENGTHS), pre.states, SamplingArrays.greedy(len(prompts)), 1,
                         logprobs=0)
    longer = engine.prefill([list(p) + [int(t)] for p, t in zip(prompts, pre.next_ids)])
    after = log_softmax(engine.host(longer.logits))
    token = step.tokens[:, 0]
    assert np.abs(after[np.arange(len(prompts)), token] - step.logprobs[:, 0]).max() <= STEP_LOGPROB
    np.testing.assert_array_equal(longer.next_ids, token)
    one, two = engine.split_states(step.states), engine.split_states(longer.states)
    assert_close_rel(one["gss_state"], two["gss_state"], STEP_REL)
    for name in ("keys", "values"):
        for b, n in enumerate(LENGTHS):  # the rows written: the prompt and its new token
            assert_close_rel(one[name][:, b, :, :n + 1], two[name][:, b, :, :n + 1], STEP_REL)
