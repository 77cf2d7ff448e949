"""Random prompts and the right-padded batches the torch references take."""

from __future__ import annotations

import numpy as np

from tests.support.tiny import TINY


def random_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def padded_batch(prompts):
    """Right-padded torch ids [B, T] and lengths [B], as the references' prefill takes them."""
    import torch

    ids = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    return ids, torch.tensor([len(p) for p in prompts])


def random_prompt(n: int, seed: int = 0, vocab_size: int = TINY.vocab_size) -> list[int]:
    """One random prompt of ``n`` tokens of the TINY vocabulary."""
    return random_prompts([n], vocab_size, seed)[0]


def reference_prefill(reference, prompts):
    """A torch reference's prefill of right-padded ``prompts``: (the last token's logits
    [B, V] as numpy, the reference's states or cache)."""
    import torch

    ids, lengths = padded_batch(prompts)
    with torch.no_grad():
        logits, states = reference.prefill(ids, lengths)
    return logits[torch.arange(len(prompts)), lengths - 1].numpy(), states
