"""Shared, session-scoped fixtures: ONE tiny config for the whole suite.

Every distinct (config, dtype) costs a cold MAX compile of minutes, so all
tests use ``TINY`` and share the compiled engines (cached as .mef files under
``$SRM_MAX_CACHE``, default ~/.cache/srm-max: later runs load in milliseconds).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from srm_max.models.srm.config import SRMConfig

# context 96 = 3 prefill chunks of 32; small so context-limit tests are cheap.
TINY = SRMConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, context_length=96)


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


def assert_close_rel(actual, expected, rel=1e-4):
    """max |actual - expected| <= rel * max |expected|."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = np.abs(expected).max()
    err = np.abs(actual - expected).max()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


def make_reference(config: SRMConfig = TINY, seed: int = 0):
    """A torch reference SRM with meaningful (non-default) decays and biases."""
    from srm_max.reference.srm import random_srm

    return random_srm(config, seed, decay_low=0.85, bias_scale=0.1)


def weights_of(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}


# every graph kind a CPU engine with the Mojo ops can build (the decode loop included)
KERNEL_KINDS = ("prefill", "score", "decode", "sample", "regroup", "decode_steps")
# the graphs such an engine loads by itself (``Engine.graph_kinds``: its decodes take
# decode_steps; the decode graph's loop is compiled only for tests that compare the two)
ENGINE_KINDS = ("prefill", "score", "sample", "regroup", "decode_steps")


def graphs(config, kinds=KERNEL_KINDS, dtype: str = "float32", kernels: bool = True):
    """A marker naming compiled graphs that the marked tests need (CPU). The session
    compiles every graph the selected tests declare up front, side by side."""
    return pytest.mark.graphs(*[(kind, config, dtype, kernels) for kind in kinds])


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run only with an accelerator; ``ray`` ones only with Ray."""
    import importlib.util

    from max.driver import accelerator_count

    skips = {"gpu": None if accelerator_count() > 0 else "needs a GPU (none found)",
             "ray": None if importlib.util.find_spec("ray") else "needs Ray: pip install 'srm-max[ray]'"}
    for item in items:
        for name, reason in skips.items():
            if reason and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=reason))


def declared_graph_jobs(items) -> list:
    """The compile jobs of every graph the ``items`` declare (``graphs`` markers)."""
    from srm_max.models import registry

    specs = dict.fromkeys(spec for item in items for marker in item.iter_markers("graphs") for spec in marker.args)
    return [registry.of(config).graph_job(kind, config, dtype, "cpu", kernels)
            for kind, config, dtype, kernels in specs]


@pytest.fixture(scope="session", autouse=True)
def suite_graphs(request):
    """Compile every graph the run needs up front, side by side (one process per core):
    a cold compile takes minutes on one core, and CI has two."""
    from srm_max.runtime.precompile import precompile
    from srm_max.shipped_graphs import install

    jobs = declared_graph_jobs(request.session.items)
    install(jobs)  # the embedded model's graphs ship with the package (checked, not compiled)
    return precompile(jobs)


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
    from srm_max.models.srm.engine import Engine

    return Engine(TINY, tiny_weights, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def engine_bf16(tiny_weights):
    from srm_max.models.srm.engine import Engine

    return Engine(TINY, tiny_weights, dtype="bfloat16", device="cpu")


@pytest.fixture(scope="session")
def generator(engine):
    from srm_max.serve.generator import Generator

    return Generator.from_engine(engine)
