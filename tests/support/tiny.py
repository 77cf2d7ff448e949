"""The suite's one tiny SRM config and its torch reference model.

Every distinct (config, dtype) costs a cold MAX compile of minutes, so all SRM tests use
``TINY`` and share the compiled graphs.
"""

from __future__ import annotations

import numpy as np

from srm_max.models.srm.config import SRMConfig

# context 96 = 3 prefill chunks of 32; small so context-limit tests are cheap.
TINY = SRMConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, context_length=96)


def make_reference(config: SRMConfig = TINY, seed: int = 0):
    """A torch reference SRM with meaningful (non-default) decays and biases."""
    from srm_max.reference.srm import random_srm

    return random_srm(config, seed, decay_low=0.85, bias_scale=0.1)


def weights_of(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}
