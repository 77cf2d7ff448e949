"""Scale-out: sample_many on a local Ray cluster of two CPU workers gives the local samples,
streamed chunk by chunk as they finish."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from srm_max import GenerationError
from srm_max.runtime.compile_cache import cache_dir
from tests.support.graphs import graphs
from tests.support.tiny import TINY
from tests.support.tokenizers import word_tokenizer

pytestmark = graphs(TINY)


def text_prompt(n, seed):
    return " ".join(f"w{i}" for i in np.random.default_rng(seed).integers(0, TINY.vocab_size - 1, n))


def key(sample):
    return sample.prompt_index, sample.sample_index


def mef_files() -> set[str]:
    """The compiled SRM graphs in the cache (``srm_prefill_f32-<key>.mef``, ...)."""
    return {p.name for p in (cache_dir() / "mef").glob("srm_*.mef")}


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray", reason="the scale-out tests need Ray: pip install 'srm-max[ray]'")
    ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_weights):
    from srm_max.checkpoints.format import save_checkpoint

    root = tmp_path_factory.mktemp("scale_out")
    word_tokenizer(TINY.vocab_size).save(str(root / "tokenizer.json"))
    return save_checkpoint(root / "ckpt", TINY, tiny_weights, tokenizer=root / "tokenizer.json")


@pytest.fixture(scope="module")
def mef_before():
    return mef_files()


@pytest.fixture(scope="module")
def sampler(ray, checkpoint, mef_before):
    from srm_max.serve.scale_out import RaySampler

    with RaySampler(checkpoint, workers=2, device="cpu") as sampler:
        yield sampler


@pytest.fixture(scope="module")
def local(engine, checkpoint):
    """The local Generator the workers must agree with: the same engine, and the checkpoint's tokenizer."""
    from srm_max import Generator

    return Generator.from_engine(engine, tokenizer=checkpoint / "tokenizer.json")


def gated(held: set, gate: str):
    """A verifier that scores a sample by its text, but holds the texts ``held`` until the
    file ``gate`` exists (a closure, so Ray pickles it by value for the workers)."""
    def verifier(text):
        import time
        from pathlib import Path

        deadline = time.monotonic() + 60
        while text in held and not Path(gate).exists():
            if time.monotonic() > deadline:
                raise TimeoutError("no sample reached the caller while this chunk was held: not streamed")
            time.sleep(0.01)
        return float(sum(map(ord, text)) % 7)
    return verifier


@pytest.mark.ray
def test_same_samples_as_local_streamed_as_chunks_finish(sampler, local, tmp_path):
    from srm_max.serve.scale_out import ScaleOutStats

    prompts = [text_prompt(3, 1), text_prompt(17, 2), text_prompt(40, 3), text_prompt(8, 4)]
    n = 3
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=99, stop=[7, "w11"], max_batch=2)
    expected = sorted(local.sample_many(prompts, n, verifier=gated(set(), ""), **kw), key=key)
    # Chunk k is prompt k; workers 0 and 1 start with chunks 0, 2 and 1, 3. Chunk 1 cannot finish
    # until the caller has received a sample, so the run only completes if results stream.
    held = {s.text for s in expected if s.prompt_index == 1} - {s.text for s in expected if s.prompt_index != 1}
    assert held, "no sample of prompt 1 differs from every other sample"
    gate = tmp_path / "gate"
    stats = ScaleOutStats()
    got = []
    for sample in sampler.sample_many(prompts, n, verifier=gated(held, str(gate)), chunk_size=n,
                                      stats=stats, **kw):
        gate.touch()
        got.append(sample)
    assert got[0].prompt_index != 1
    assert sorted(got, key=key) == expected  # ids, text, finish reason, seed, score: sample for sample
    assert {s.finish_reason for s in got} == {"stop", "length"} and len({s.score for s in got}) > 1
    assert (stats.chunks, stats.chunk_size, stats.chunks_per_worker) == (4, n, [2, 2])
    assert stats.samples_per_worker == [2 * n, 2 * n] and len(set(sampler.pids)) == 2
    # a chunk's samples come out together, in the order that chunk's pool finished them
    chunks = [got[i: i + n] for i in range(0, len(got), n)]
    assert all(len({s.prompt_index for s in c}) == 1 for c in chunks)


@pytest.mark.ray
def test_workers_load_the_precompiled_graphs(sampler, mef_before):
    assert mef_files() == mef_before  # the workers compiled nothing: same config, dtype and kernels


@pytest.mark.ray
def test_default_chunks_and_pool_plan_give_the_local_samples(sampler, local):
    prompts = [[1, 2, 3], [4, 5], [6] * 9]
    kw = dict(max_new_tokens=6, temperature=0.8, top_k=5, seed=3)
    expected = sorted(local.sample_many(prompts, 5, **kw), key=key)
    assert sorted(sampler.sample_many(prompts, 5, **kw), key=key) == expected


@pytest.mark.ray
def test_worker_errors_surface_and_the_sampler_keeps_working(sampler, local):
    def fails_on_long(text):
        if len(text.split()) > 4:
            raise ValueError(f"cannot score {text!r}")
        return 1.0

    kw = dict(max_new_tokens=8, temperature=1.0, seed=5, chunk_size=1)
    with pytest.raises(ValueError, match="cannot score") as err:
        list(sampler.sample_many(["w1 w2", "w3"], 2, verifier=fails_on_long, **kw))
    assert "fails_on_long" in str(err.value)  # the worker's traceback comes along
    with pytest.raises(GenerationError, match="n must be an integer") as err:
        sampler.sample_many(["w1"], 0)  # bad arguments: the local error, before any work
    assert type(err.value) is GenerationError  # not wrapped by Ray
    with pytest.raises(GenerationError, match="token id 64"):
        sampler.sample_many([[1, 64]], 2)
    with pytest.raises(GenerationError, match="chunk_size"):
        sampler.sample_many(["w1"], 2, chunk_size=0)
    import threading

    lock = threading.Lock()
    with pytest.raises(GenerationError, match="picklable"):
        sampler.sample_many(["w1"], 2, verifier=lambda text: lock.locked())
    expected = sorted(local.sample_many(["w1 w2", "w3"], 2, max_new_tokens=8, temperature=1.0, seed=5), key=key)
    assert sorted(sampler.sample_many(["w1 w2", "w3"], 2, **kw), key=key) == expected


@pytest.mark.ray
def test_a_worker_that_cannot_load_the_model_raises(ray, tmp_path):
    from srm_max.serve.scale_out import RaySampler

    with pytest.raises(GenerationError, match="worker 0 could not load.*not a checkpoint directory"):
        RaySampler(tmp_path / "missing", workers=1, cpus_per_worker=0)  # the sampler holds both CPUs


def test_ray_is_optional(monkeypatch, checkpoint):
    """srm_max.serve.scale_out imports without Ray; using it without Ray names the extra to install."""
    out = subprocess.run([sys.executable, "-c", "import sys, srm_max.serve.scale_out; print('ray' in sys.modules)"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).parent)
    assert out.stdout.strip() == "False"
    from srm_max.serve.scale_out import RaySampler

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'srm-max\[ray\]'"):
        RaySampler(checkpoint)
