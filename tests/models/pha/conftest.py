"""Fixtures of the PHA engine tests: in this folder the reference is the test PHA
(tests/support/pha.py CONFIG), not the suite's TINY SRM."""

import numpy as np
import pytest

from srm_max.reference.pha import PHA
from tests.support.pha import random_pha
from tests.support.tiny import weights_of


@pytest.fixture(scope="module")
def reference() -> PHA:
    return random_pha()


@pytest.fixture(scope="module")
def weights(reference) -> dict[str, np.ndarray]:
    return weights_of(reference)
