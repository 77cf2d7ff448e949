"""Fixtures of the checkpoint tests: a small SRM with non-trivial biases and decays, and
token ids to run it on."""

import pytest
import torch

from srm_max.reference.srm import SRM
from tests.support.srm_sources import CONFIG


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = SRM(CONFIG)
    with torch.no_grad():
        for block in m.mixer_blocks:
            for head in block.token_mixing_layer.mixer_heads:
                head.bias.normal_()
                head.decay_value.uniform_(0.85, 1.0)
    return m.eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, CONFIG.vocab_size, (2, 25), generator=torch.Generator().manual_seed(1))
