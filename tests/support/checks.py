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


def assert_within_bfloat16_step(actual, expected, rel=1e-5):
    """Each |actual - expected| <= one bfloat16 rounding step at |expected| (at most
    2**-7 |expected|) + rel * max |expected|: values rounded to bfloat16 that may land on
    either side of a rounding edge, and nothing more."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    bound = 2.0**-7 * np.abs(expected) + rel * np.abs(expected).max()
    worst = np.argmax(np.abs(actual - expected) - bound)
    err = np.abs(actual - expected).flat[worst]
    where = tuple(int(i) for i in np.unravel_index(worst, expected.shape))
    assert err <= bound.flat[worst], (f"error {err:.3g} at {where} "
                                      f"(expected {expected.flat[worst]:.6g}) > one bfloat16 step + {rel} of the largest")


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
