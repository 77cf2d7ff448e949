"""``PrefillStates``, the prefill's placement of each layer's GSS state, keys and values in
the state tensor, against numpy, where the engine tests do not reach: pieces of a cache
row narrower than the row (a GSS state that is not a whole number of cache rows), a
prompt shorter than the context (zero rows after it) and one longer (the chunk padding
runs past the context), two samples, and a model without the GSS branch.

One small graph holds both configs (a compile is the dear part)."""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.pha.model import PrefillStates, StateLayout
from srm_max.models.pha.config import PHAConfig

# head width 4, GSS state 2 * 3 * 3 = 18 floats: rows of gcd(18, 4) = 2 floats
NARROW = PHAConfig(vocab_size=40, d_model=16, n_layers=1, context_length=12, n_q_heads=4, n_kv_heads=2,
                   gss_hidden_dim=3, dss_state_size=3)
NO_GSS = PHAConfig(vocab_size=40, d_model=16, n_layers=1, context_length=12, n_q_heads=4, n_kv_heads=2,
                   branches=("attn", "ffn"))
CONFIGS = (NARROW, NO_GSS)


def expected_state(config, gss, keys, values):
    """The state row of each sample: the GSS state, then each cache [Hkv, n, dh] holding
    position i at row i for i < T and zeros after."""
    c = config
    B, T = keys.shape[:2]
    n, Hkv, dh = c.context_length, c.n_kv_heads, c.head_dim
    caches = []
    for t in (keys, values):
        cache = np.zeros((B, Hkv, n, dh), np.float32)
        rows = min(T, n)
        cache[:, :, :rows] = t[:, :rows].reshape(B, rows, Hkv, dh).transpose(0, 2, 1, 3)
        caches.append(cache.reshape(B, -1))
    return np.concatenate(([gss] if gss is not None else []) + caches, axis=1)


@pytest.fixture(scope="module")
def model():
    from max.driver import CPU
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType

    from srm_max.graphs.ops import F32, I64
    from srm_max.runtime.compile_cache import load_compiled

    cpu = DeviceRef.CPU()
    kv = NARROW.n_kv_heads * NARROW.head_dim
    inputs = [TensorType(I64, ["t"], cpu)]
    for c in CONFIGS:
        gss = StateLayout.of(c).gss
        inputs += ([TensorType(F32, ["b", gss], cpu)] if gss else []) + [TensorType(F32, ["b", "t", kv], cpu)] * 2
    with Graph("prefill_states_check", input_types=inputs) as g:
        pos, *rest = (v.tensor for v in g.inputs)
        outs = []
        for c in CONFIGS:
            found = {}
            if StateLayout.of(c).gss:
                found["gss"], rest = rest[0], rest[1:]
            found["attn"], rest = (rest[0], rest[1]), rest[2:]
            outs.append(PrefillStates(c, pos, found["attn"][0].shape[0], cpu).layer(found))
        g.output(*outs)
    return load_compiled(InferenceSession(devices=[CPU()]), g)  # cached: a later run loads it in milliseconds


@pytest.mark.parametrize("T", [5, 12, 16])  # shorter than the context, as long, past it (chunk padding)
def test_the_states_hold_the_gss_state_then_each_cache_with_zeros_after_the_prompt(model, T):
    assert StateLayout.of(NARROW).gss == 18 and NARROW.head_dim == 4  # pieces of 2 floats
    rng = np.random.default_rng(T)
    B, kv = 2, NARROW.n_kv_heads * NARROW.head_dim
    args, want = [np.arange(T, dtype=np.int64)], []
    for c in CONFIGS:
        gss_width = StateLayout.of(c).gss
        gss = rng.standard_normal((B, gss_width)).astype(np.float32) if gss_width else None
        keys, values = (rng.standard_normal((B, T, kv)).astype(np.float32) for _ in range(2))
        args += ([gss] if gss is not None else []) + [keys, values]
        want.append(expected_state(c, gss, keys, values))
    got = [out.to_numpy() for out in model.execute(*args)]
    for c, g_, w_ in zip(CONFIGS, got, want):
        assert g_.shape == (B, StateLayout.of(c).width)
        np.testing.assert_array_equal(g_, w_)
