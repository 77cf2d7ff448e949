"""Shared, session-scoped fixtures: ONE tiny config for the whole suite.

Every distinct (config, dtype) costs a cold MAX compile of minutes, so all
tests use ``TINY`` and share the compiled engines (cached as .mef files under
``$SRM_MAX_CACHE``, default ~/.cache/srm-max: later runs load in milliseconds).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from srm_max.config import SRMConfig

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


# the graphs of a CPU engine with the Mojo ops (Engine.graph_kinds)
KERNEL_KINDS = ("prefill", "decode", "decode_greedy")


def suite_graph_jobs(test_files: set[str]) -> list:
    """The MAX graphs the selected test files compile (CPU: with the Mojo mixer ops, the
    default, and once with plain MAX ops)."""
    from srm_max.checkpoint import load_checkpoint
    from srm_max.embedded import default_model_path
    from srm_max.precompile import GraphJob

    jobs = []
    if test_files & {"test_engine.py", "test_generator.py", "test_slot_pool.py", "test_verify.py",
                     "test_bench.py", "test_scale_out.py", "test_server.py"}:
        jobs += [GraphJob.of(kind, TINY, kernels=True) for kind in KERNEL_KINDS]
    if "test_engine.py" in test_files:
        jobs += [GraphJob.of("prefill", TINY), GraphJob.of("decode", TINY)]
        jobs += [GraphJob.of(kind, TINY, "bfloat16", kernels=True) for kind in KERNEL_KINDS]
    if "test_embedded.py" in test_files:
        embedded = load_checkpoint(default_model_path()).config
        jobs += [GraphJob.of(kind, embedded, kernels=True) for kind in KERNEL_KINDS]
    if "test_pha_engine.py" in test_files:
        from test_pha_engine import CONFIG as PHA_CONFIG

        jobs += [GraphJob.of("prefill", PHA_CONFIG), GraphJob.of("decode", PHA_CONFIG)]
    return jobs


@pytest.fixture(scope="session", autouse=True)
def suite_graphs(request):
    """Compile every graph the run needs up front, side by side (one process per core):
    a cold compile takes minutes on one core, and CI has two."""
    from srm_max.precompile import precompile
    from srm_max.shipped_graphs import install

    files = {Path(str(item.path)).name for item in request.session.items}
    jobs = suite_graph_jobs(files)
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
