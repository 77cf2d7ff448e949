"""``PrefillStates``, the prefill's placement of each layer's GSS state, keys and values in
the state tensor, by plain ops and by the op (mojo/pha_prefill_state.mojo), against numpy,
where the engine tests do not reach: pieces of a cache row narrower than the row (a GSS state that is not a whole number of cache rows), a
prompt shorter than the context (zero rows after it) and one longer (the chunk padding
runs past the context), two samples, two layers at once, and models without the GSS branch
and without the attention.

One small graph holds the configs (tests/support/op_graph_builders.py), compiled up front
with the suite's other graphs."""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.pha.model import StateLayout
from tests.support.graphs import op_graphs
from tests.support.op_graph_builders import NARROW, PHA_PREFILL_STATES, PREFILL_STATES_CONFIGS as CONFIGS
from tests.support.op_graph_builders import PREFILL_STATES_LAYERS as LAYERS

pytestmark = op_graphs(PHA_PREFILL_STATES)  # one small graph holds the configs


def expected_state(config, gss, keys, values):
    """The state row of each sample: the GSS state, then each cache [Hkv, n, dh] holding
    position i at row i for i < T and zeros after."""
    c = config
    if keys is None:
        return gss
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
    from tests.support import op_graphs as compiled

    return compiled.model(PHA_PREFILL_STATES)


@pytest.mark.parametrize("T", [5, 12, 16])  # shorter than the context, as long, past it (chunk padding)
def test_the_states_hold_the_gss_state_then_each_cache_with_zeros_after_the_prompt(model, T):
    assert StateLayout.of(NARROW).gss == 18 and NARROW.head_dim == 4  # pieces of 2 floats
    rng = np.random.default_rng(T)
    B = 2
    args, want = [np.arange(T, dtype=np.int64)], []
    for c in CONFIGS:
        lay, kv = StateLayout.of(c), c.n_kv_heads * c.head_dim
        layers = []
        for _ in range(LAYERS):
            gss = rng.standard_normal((B, lay.gss)).astype(np.float32) if lay.gss else None
            keys, values = (rng.standard_normal((B, T, kv)).astype(np.float32) if lay.kv else None for _ in range(2))
            args += [a for a in (gss, keys, values) if a is not None]
            layers.append(expected_state(c, gss, keys, values))
        want.append(np.stack(layers))
    got = [out.to_numpy() for out in model.execute(*args)]
    for i, (c, w_) in enumerate(zip(CONFIGS, want)):
        for g_ in got[2 * i: 2 * i + 2]:  # by plain ops, then by the op
            assert g_.shape == (LAYERS, B, StateLayout.of(c).width)
            np.testing.assert_array_equal(g_, w_)
