"""``PrefillStates``, the prefill's placement of each layer's GSS state, keys and values in
the state tensor, against numpy, where the engine tests do not reach: pieces of a cache
row narrower than the row (a GSS state that is not a whole number of cache rows), a
prompt shorter than the context (zero rows after it) and one longer (the chunk padding
runs past the context), two samples, and a model without the GSS branch.

One small graph holds both configs (tests/support/op_graph_builders.py), compiled up front
with the suite's other graphs."""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.graphs.pha.model import StateLayout
from tests.support.graphs import op_graphs
from tests.support.op_graph_builders import NARROW, PHA_PREFILL_STATES, PREFILL_STATES_CONFIGS as CONFIGS

pytestmark = op_graphs(PHA_PREFILL_STATES)  # one small graph holds both configs


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
    from tests.support import op_graphs as compiled

    return compiled.model(PHA_PREFILL_STATES)


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
