"""The whole-step decode op (mojo/decode_step.mojo): one step of every layer and the
logits, and several greedy steps in one call, vs float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.op_names import OP_DECODE_STEP, OP_DECODE_STEPS
from tests.support import mojo_ops as K
from tests.support.graphs import op_graphs
from tests.support.mixer_reference import close, make_params, ref_step

pytestmark = op_graphs(OP_DECODE_STEP, OP_DECODE_STEPS)


def ref_decode_layer(x, state, positions, p, eps):
    """numpy: one SRM block at one position per sample (graphs/srm/decode.py `step`)."""
    def ln(v, g, b):
        mu = v.mean(-1, keepdims=True)
        return (v - mu) / np.sqrt(((v - mu) ** 2).mean(-1, keepdims=True) + eps) * g + b

    B, H, hd = state.shape
    h = ln(x, p["cn_w"], p["cn_b"]) @ p["fc1_w"].T + p["fc1_b"]
    x = x + (h / (1 + np.exp(-h))) @ p["fc2_w"].T + p["fc2_b"]
    u = (ln(x, p["tn_w"], p["tn_b"]) @ p["proj_w"].T + p["proj_b"]).reshape(B, H, hd)
    y, new_state = ref_step(u, positions, p["w"], p["beta"], p["lam"], state)
    return x + y.reshape(B, H * hd) @ p["out_w"].T + p["out_b"], new_state


DECODE_STEP_CASES = [
    # B, L, H, hd, f, V: widths below, at and past the SIMD width and the 64-column
    # panels, none a multiple of 16 (padding) and some heads straddling a SIMD vector;
    # batches of one register tile or less, several, and several units of rows
    (1, 1, 2, 3, 7, 5),
    (2, 2, 4, 5, 37, 19),
    (3, 1, 2, 16, 64, 33),
    (7, 2, 4, 24, 200, 101),
    (13, 1, 2, 40, 96, 130),
    (50, 2, 2, 8, 40, 9),
    (101, 1, 4, 32, 72, 70),
]


def random_decode_model(rng, L, H, hd, f, V, n):
    """One dict of LAYER_PARAMS per layer, an embedding of V + 3 rows and a head [V, d]."""
    d = H * hd
    shapes = {"cn_w": [d], "cn_b": [d], "fc1_w": [f, d], "fc1_b": [f], "fc2_w": [d, f], "fc2_b": [d],
              "tn_w": [d], "tn_b": [d], "proj_w": [d, d], "proj_b": [d], "out_w": [d, d], "out_b": [d]}
    layers = []
    for _ in range(L):
        p = {k: rng.standard_normal(s).astype(np.float32) / np.sqrt(s[-1]) for k, s in shapes.items()}
        p["w"], p["beta"], p["lam"] = make_params(rng, H, n)
        layers.append(p)
    return layers, rng.standard_normal((V + 3, d)).astype(np.float32), rng.standard_normal((V, d)).astype(np.float32)


@pytest.mark.parametrize("B,L,H,hd,f,V", DECODE_STEP_CASES)
def test_whole_decode_step_matches_reference(B, L, H, hd, f, V):
    rng = np.random.default_rng(B * 100 + hd)
    n = 11
    layers, embedding, head_w = random_decode_model(rng, L, H, hd, f, V, n)
    ids = rng.integers(0, V + 3, B)
    states = rng.standard_normal((L, B, H, hd)).astype(np.float32)
    positions = rng.integers(0, n + 5, B)  # some past the context: clamped to n - 1
    logits, new_states = K.decode_step(ids, embedding, states, positions, layers, head_w, 1e-5)
    ref_x, ref_states = embedding[ids].astype(np.float64), []
    for l, p in enumerate(layers):
        ref_x, s = ref_decode_layer(ref_x, states[l], np.minimum(positions, n - 1), p, 1e-5)
        ref_states.append(s)
    close(new_states, np.stack(ref_states))
    close(logits, ref_x @ head_w.T.astype(np.float64))


@pytest.mark.parametrize("B,L,H,hd,f,V,S", [(1, 1, 2, 3, 7, 5, 4), (7, 2, 4, 24, 200, 101, 3),
                                            (50, 2, 2, 8, 40, 9, 6), (3, 1, 2, 16, 64, 33, 0),
                                            (2, 1, 2, 3, 7, 5, 70)])  # 70: two fork-joins
def test_greedy_steps_match_one_step_at_a_time(B, L, H, hd, f, V, S):
    """S greedy steps in one op = S calls of the one-step op, each fed the first argmax
    of its logits: the same tokens and bit for bit the same states (positions cross
    the context's end, where they stay clamped)."""
    rng = np.random.default_rng(S * 1000 + B)
    n = 11
    layers, embedding, head_w = random_decode_model(rng, L, H, hd, f, V, n)
    ids = rng.integers(0, V + 3, B)
    states = rng.standard_normal((L, B, H, hd)).astype(np.float32)
    positions = rng.integers(n - 4, n + 2, B)
    tokens, new_states, last, next_positions = K.decode_steps(
        ids, embedding, states, positions, layers, head_w, 1e-5, S)
    want, s, t = [], states, ids
    for k in range(S):
        logits, s = K.decode_step(t, embedding, s, positions + k, layers, head_w, 1e-5)
        t = logits.argmax(-1)
        want.append(t)
    assert tokens.shape == (B, S)
    np.testing.assert_array_equal(tokens, np.stack(want, 1) if S else np.zeros((B, 0)))
    np.testing.assert_array_equal(new_states, s)
    np.testing.assert_array_equal(last, t)
    np.testing.assert_array_equal(next_positions, positions + S)


def test_whole_decode_step_rejects_negative_positions_and_unknown_tokens():
    rng = np.random.default_rng(0)
    H, hd, f, d, n = 2, 4, 8, 8, 4
    p = {k: np.ones(s, np.float32) for k, s in {"cn_w": [d], "cn_b": [d], "fc1_w": [f, d], "fc1_b": [f],
         "fc2_w": [d, f], "fc2_b": [d], "tn_w": [d], "tn_b": [d], "proj_w": [d, d], "proj_b": [d],
         "out_w": [d, d], "out_b": [d]}.items()}
    p["w"], p["beta"], p["lam"] = make_params(rng, H, n)
    emb, states = np.ones((5, d)), np.ones((1, 2, H, hd))
    with pytest.raises(Exception, match="position -1 is negative"):
        K.decode_step([0, 1], emb, states, [0, -1], [p], np.ones((3, d)), 1e-5)
    with pytest.raises(Exception, match=r"token id 5 outside \[0, 5\)"):
        K.decode_step([5, 1], emb, states, [0, 1], [p], np.ones((3, d)), 1e-5)
    with pytest.raises(Exception, match="srm_decode_steps: position -1 is negative"):
        K.decode_steps([0, 1], emb, states, [0, -1], [p], np.ones((3, d)), 1e-5, 2)
