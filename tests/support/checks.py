"""Numeric comparisons of MAX results with the references."""

from __future__ import annotations

import numpy as np

from tests.support.prompts import reference_prefill


def assert_close_rel(actual, expected, rel=1e-4):
    """max |actual - expected| <= rel * max |expected|."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = np.abs(expected).max()
    err = np.abs(actual - expected).max()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


def assert_prefill_matches_reference(engine, reference, prompts, vocab_size: int):
    """Prefill ``prompts`` in the engine and in the torch reference: the last-token logits
    agree (``assert_close_rel``) and the engine's next ids are their argmax. Returns the
    engine's result, its logits [B, V] and the reference's states (or cache)."""
    res = engine.prefill(prompts)
    ref_logits, ref_states = reference_prefill(reference, prompts)
    logits = engine.host(res.logits)
    assert logits.shape == (len(prompts), vocab_size)
    assert_close_rel(logits, ref_logits)
    assert (res.next_ids == ref_logits.argmax(-1)).all()
    return res, logits, ref_states
