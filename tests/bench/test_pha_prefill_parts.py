"""bench/pha_prefill_parts.py without a MAX compile: the dense layers it times (those whose
FLOPs ``pha_long_context.prefill_flops`` counts), the ops' inputs at a block's shapes, the
idle call's inputs, and the breakdown of a prefill into its parts."""

from __future__ import annotations

import numpy as np
import pytest

from bench import pha_long_context as plc
from bench import pha_prefill_parts as pp
from srm_max.models.srm.packing import padded

MODELS = ("pha", "pha-attn", "pha-gss", "pha-ffn")


@pytest.mark.parametrize("name", MODELS)
def test_the_parts_flops_are_the_prefills(name):
    """Every matrix of a block once per token, but in the last block those whose output only
    the last token's logits read once (what its state needs on every row: the GSS's DSS
    input, attention's queries, keys and values), the attention's causal rows (the last
    token's query alone in the last block), the output layer once: what the benchmark's
    prefill is weighed by, part by part."""
    c, n = plc.configs(name, 512, False), 512
    dense = plc.dense_layers(c)
    per_block = sum(2.0 * n * d["N"] * d["K"] for d in dense) + plc.attention_flops(c, n)
    last_query = plc.attention_flops(c, n, last_query_only=True)
    assert last_query == (4.0 * c.n_q_heads * c.head_dim * n if "attn" in c.branches else 0.0)
    last_block = sum(2.0 * (n if d["every_row"] else 1) * d["N"] * d["K"] for d in dense) + last_query
    flops = (c.n_layers - 1) * per_block + last_block + 2.0 * c.vocab_size * c.d_model
    assert flops == pytest.approx(plc.prefill_flops(name, c, n), rel=1e-12)
    assert {d["name"] for d in dense if d["every_row"]} == {"gss.to_v", "attn.q_proj", "attn.k_proj", "attn.v_proj"} & {
        d["name"] for d in dense}
    names = [d["name"] for d in plc.dense_layers(c)]
    assert ("gss.to_u" in names) == ("gss" in c.branches) and ("attn.q_proj" in names) == ("attn" in c.branches)
    assert len(names) == len(set(names)) and sum(n.startswith("ffn_") for n in names) == 2 * len(c.ffn_dims)
    # the GELU on the GSS's input projections and the FFNs' first layers, the gate times u
    assert {d["name"] for d in plc.dense_layers(c) if d["act"] == 1} <= {"gss.to_u", "gss.to_v", "ffn_0.fc", "ffn_1.fc"}
    assert [d["name"] for d in plc.dense_layers(c) if d["times_u"]] == (["gss.to_gate"] if "gss" in c.branches else [])


def test_a_blocks_op_inputs_have_the_shapes_the_ops_take():
    c, T = plc.configs("pha", 128, True), 100
    inputs = pp.op_inputs(c, T, np.random.default_rng(0))
    for d in plc.dense_layers(c):
        x, mats, layer, bias, scale = inputs["dense"][d["name"]]
        assert x.shape == (T, d["K"]) and mats.size == padded(d["N"]) * d["K"] and bias.shape == (d["N"],)
        assert layer.tolist() == [0, d["act"]] and scale.shape == ((T, d["N"]) if d["times_u"] else (0, 0))
    q, k, v, lengths, at = inputs["attention"]
    assert q.shape == (1, T, c.n_q_heads, c.head_dim) and k.shape == v.shape == (1, T, c.n_kv_heads, c.head_dim)
    assert lengths.tolist() == [T] and at.tolist() == [list(range(T))]  # every query, as a block but the last
    xs = inputs["gss_scan"][0]
    assert xs.shape == (1, 2, 64, c.gss_hidden_dim)  # 100 tokens in chunks of 64
    assert "gss_scan" not in pp.op_inputs(plc.configs("pha-attn", 128, True), T, np.random.default_rng(0))


def test_an_idle_call_gives_each_op_nothing_to_do():
    from tests.support.op_graph_builders import LINEAR_PACKED, PHA_GSS_SCAN

    x, mats, layer, bias, scale = (b.to_numpy() for b in LINEAR_PACKED.idle_inputs())
    assert x.shape == (0, 0) and mats.shape == (0,) and layer.shape == (2,) and scale.shape == (0, 0)
    assert layer.dtype == np.int64 and x.dtype == np.float32
    scan = PHA_GSS_SCAN.idle_inputs()
    assert tuple(scan[0].shape) == (0, 0, 1, 0) and tuple(scan[-1].shape) == (0,)


def test_a_prefill_is_its_parts_and_the_rest():
    # a block: a dense layer of 2e6 FLOPs in 1 ms, the attention's 1e6 in 1 ms, the scan 2 ms;
    # two blocks in a prefill of 10 ms, at a peak of 4e9 FLOP/s
    parts = [{"name": "ffn_0.fc", "seconds": 1e-3, "flops": 2e6}, {"name": "attention", "seconds": 1e-3, "flops": 1e6},
             {"name": "gss_scan", "seconds": 2e-3, "flops": None}]
    s = pp.summarize(10e-3, [p | {"blocks": 2} for p in parts], 4e9)
    assert s["prefill_ms"] == pytest.approx(10.0) and s["parts_ms"] == pytest.approx(8.0)
    assert s["rest_ms"] == pytest.approx(2.0) and s["rest_percent_of_prefill"] == pytest.approx(20.0)
    assert s["dense_ms"] == pytest.approx(2.0) and s["dense_percent_of_prefill"] == pytest.approx(20.0)
    assert s["dense_percent_of_fma_peak"] == pytest.approx(50.0)
    fc, attention, scan = s["parts"]
    assert fc["gflop_per_s"] == pytest.approx(2.0) and attention["percent_of_fma_peak"] == pytest.approx(25.0)
    assert "gflop_per_s" not in scan and scan["percent_of_prefill"] == pytest.approx(40.0)
    idle = pp.summarize(10e-3, [{"name": "ffn_0.fc", "seconds": 0.0, "flops": 2e6, "blocks": 2}], 4e9)
    assert "gflop_per_s" not in idle["parts"][0] and idle["dense_percent_of_fma_peak"] is None
    # a layer the last block applies to one token: one block fewer of it
    q_proj = {"name": "attn.q_proj", "seconds": 1e-3, "flops": 4e6, "blocks": 2}
    fewer = pp.summarize(10e-3, [parts[0] | {"blocks": 1}, q_proj], 4e9)
    # 1 ms of ffn_0.fc and 2 ms of q_proj; 2e6 + 8e6 FLOPs in those 3 ms, at a peak of 4e9
    assert fewer["dense_ms"] == pytest.approx(3.0)
    assert fewer["dense_percent_of_fma_peak"] == pytest.approx(100 * 10e6 / 3e-3 / 4e9)


def test_rounds_call_each_once_per_round_after_a_warm_up():
    order = []
    seconds = pp.in_rounds({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3)
    assert order == ["a", "b"] * 4  # the warm-up round, then 3
    assert [len(v) for v in seconds.values()] == [3, 3] and all(t >= 0 for v in seconds.values() for t in v)


def test_a_part_of_the_whole_prefill_counts_once_and_is_not_a_dense_layer():
    parts = [{"name": "ffn_0.fc", "seconds": 1e-3, "flops": 2e6, "blocks": 4},
             {"name": "state_placement", "seconds": 1e-3, "flops": None, "blocks": 1}]
    s = pp.summarize(10e-3, parts, 4e9)
    assert s["parts_ms"] == pytest.approx(5.0) and s["dense_ms"] == pytest.approx(4.0)
    assert s["parts"][1]["ms"] == pytest.approx(1.0)


def test_an_activations_cost_is_the_median_of_the_rounds_ratios():
    # rounds of (with, without): 1.2, 1.1 and 0.9 times; the drift moves both calls of a round
    seconds = {"ffn_0.fc": [1.2, 2.2, 0.9], "ffn_0.fc without activation": [1.0, 2.0, 1.0]}
    (cost,) = pp.activation_costs(seconds, {"ffn_0.fc": "ffn_0.fc without activation"})
    assert cost["name"] == "ffn_0.fc" and cost["percent_of_layer"] == pytest.approx(10.0)
    assert cost["rounds_slower"] == 2 and cost["rounds"] == 3
    assert pp.activation_costs(seconds, {}) == []
