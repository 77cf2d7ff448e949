"""Shared, session-scoped fixtures: ONE tiny config for the whole suite.

Every distinct (config, dtype) costs a cold MAX compile of minutes, so all
tests use ``TINY`` and share the compiled engines (cached as .mef files under
``$SRM_MAX_CACHE``, default ~/.cache/srm-max: later runs load in milliseconds).
"""

from __future__ import annotations

import numpy as np
import pytest

from srm_max.config import SRMConfig

# context 96 = 3 prefill chunks of 32; small so context-limit tests are cheap.
TINY = SRMConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, context_length=96)


def make_reference(config: SRMConfig = TINY, seed: int = 0):
    """A torch reference SRM with meaningful (non-default) decays and biases."""
    from srm_max.reference.srm import random_srm

    return random_srm(config, seed, decay_low=0.85, bias_scale=0.1)


def weights_of(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}


@pytest.fixture(scope="session")
def tiny_config() -> SRMConfig:
    return TINY


@pytest.fixture(scope="session")
def reference():
    return make_reference()


@pytest.fixture(scope="session")
def tiny_weights(reference) -> dict[str, np.ndarray]:
    return weights_of(reference)


@pytest.fixture(scope="session")
def engine(tiny_weights):
    from srm_max.engine import Engine

    return Engine(TINY, tiny_weights, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def engine_bf16(tiny_weights):
    from srm_max.engine import Engine

    return Engine(TINY, tiny_weights, dtype="bfloat16", device="cpu")


@pytest.fixture(scope="session")
def generator(engine):
    from srm_max.generator import Generator

    return Generator.from_engine(engine)
