"""``sample_many`` over several devices or machines with Ray.

    import ray
    from srm_max.serve.scale_out import RaySampler

    ray.init()                                    # or ray.init(address="auto") on a cluster
    with RaySampler("ckpt/", workers=4, device="gpu") as sampler:
        for sample in sampler.sample_many(prompts, 64, verifier=score, temperature=1.0, seed=7):
            ...                                   # serve.sample_many.Sample objects, as they finish

Each worker is a Ray actor that owns a ``Generator`` loaded from ``path`` (a
directory every worker can read). The (prompt, sample) pairs are cut into
chunks; each worker starts with ``queue_depth`` chunks and gets the next one
whenever one of its chunks finishes, so a slow worker takes fewer chunks, and
the samples of a chunk are yielded as soon as it is done: in order of
completion, chunk by chunk. A worker runs its chunk through the local slot
pool with the pairs' global indices, so every sample has the seed
``sample_seed(seed, prompt, sample)`` and is exactly the sample the local
``Generator.sample_many`` gives with the same arguments (same ids, text,
finish reason and score).

Ray is an optional extra (``pip install 'srm-max[ray]'``), imported only here
and only when a RaySampler is made.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import GenerationError
from .sampling import resolve_seed
from .sample_many import Sample, SamplingPlan, plan, run_pairs
from .scheduler import PoolStats


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("srm_max.serve.scale_out needs Ray: pip install 'srm-max[ray]'") from None
    return ray


@dataclass
class ScaleOutStats:
    """What each worker did in one ``RaySampler.sample_many`` call."""

    chunk_size: int = 0
    chunks: int = 0
    samples_per_worker: list[int] = field(default_factory=list)
    chunks_per_worker: list[int] = field(default_factory=list)
    pools: list[PoolStats] = field(default_factory=list)  # one per chunk, in order of completion


@dataclass
class _Worker:
    """A Ray actor: one Generator and the slot pool over the (prompt, sample) pairs it is sent."""

    def __init__(self, path: str, device: str, dtype: str | None, tokenizer):
        from .generator import Generator

        self.generator = Generator.from_pretrained(path, device=device, dtype=dtype, tokenizer=tokenizer)

    def pid(self) -> int:
        return os.getpid()

    def plan(self, prompts, n, max_batch, options: dict) -> SamplingPlan:
        """Check the call exactly as the local ``sample_many`` does (its errors, its defaults)."""
        return plan(self.generator, prompts, n, max_batch, **options)

    def run(self, job: SamplingPlan, verifier, pairs: list[tuple[int, int]]) -> tuple[list[Sample], PoolStats]:
        stats = PoolStats()
        samples = list(run_pairs(self.generator, job, pairs, verifier, stats))
        return samples, stats


class RaySampler:
    """``sample_many`` fanned out over Ray workers, each owning a Generator (see module docs)."""

    def __init__(self, path, workers: int = 2, device: str = "cpu", dtype: str | None = None, tokenizer=None,
                 cpus_per_worker: float = 1, queue_depth: int = 2):
        """``path``: a checkpoint directory every worker can read. ``device``/``dtype``/``tokenizer``:
        as ``Generator.from_pretrained``, on each worker; ``device="gpu"`` reserves one GPU per
        worker. Connects to Ray as ``ray.init()`` does unless Ray is already initialised.
        Waits until every worker has loaded the model; a worker that cannot load it raises here."""
        from ..runtime.device import check_device_name, resolve_dtype

        ray = _ray()
        if not isinstance(workers, int) or workers < 1:
            raise GenerationError(f"workers must be an integer >= 1, got {workers!r}")
        if not isinstance(queue_depth, int) or queue_depth < 1:
            raise GenerationError(f"queue_depth must be an integer >= 1, got {queue_depth!r}")
        check_device_name(device)
        if dtype is not None:
            resolve_dtype(dtype)
        if not ray.is_initialized():
            ray.init()
        actor = ray.remote(_Worker).options(num_cpus=cpus_per_worker,
                                            num_gpus=1 if device.lower() == "gpu" else 0)
        tok = str(tokenizer) if tokenizer is not None else None
        self.queue_depth = queue_depth
        self._workers = [actor.remote(str(path), device, dtype, tok) for _ in range(workers)]
        try:
            self.pids = [self._get(w.pid.remote(), i, f"could not load {str(path)!r}")
                         for i, w in enumerate(self._workers)]
        except BaseException:
            self.shutdown()
            raise

    def sample_many(self, prompts, n: int, verifier: Callable | None = None, max_batch="auto",
                    chunk_size: int | None = None, stats: ScaleOutStats | None = None,
                    **options) -> Iterator[Sample]:
        """``Generator.sample_many`` with the same arguments and samples, yielded chunk by chunk
        in order of completion. ``max_batch`` is each worker's pool size. ``chunk_size``:
        (prompt, sample) pairs per chunk; by default each worker gets about four chunks.
        ``verifier`` runs on the workers, so it must be picklable (Ray's cloudpickle: a lambda
        or closure is fine, an open file or a lock is not). Arguments are checked (by a
        worker, as locally) before any work; an error in a worker is raised here as the
        worker raised it, with its traceback."""
        ray = _ray()
        # one seed for every worker: a fresh one drawn here, not one per worker
        options["seed"] = resolve_seed(options.get("seed"))
        request = self._get(self._workers[0].plan.remote(prompts, n, max_batch, options), 0, "", cause=True)
        pairs = [(p, s) for p in range(len(request.prompts)) for s in range(n)]
        if chunk_size is None:
            chunk_size = math.ceil(len(pairs) / (4 * len(self._workers)))
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise GenerationError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        try:
            verifier_ref = ray.put(verifier)
        except Exception as e:  # noqa: BLE001
            raise GenerationError(f"verifier cannot be sent to the Ray workers (it must be picklable): {e}") from None
        chunks = deque(pairs[i: i + chunk_size] for i in range(0, len(pairs), chunk_size))
        stats = stats if stats is not None else ScaleOutStats()
        stats.chunk_size, stats.chunks = chunk_size, len(chunks)
        stats.samples_per_worker = [0] * len(self._workers)
        stats.chunks_per_worker = [0] * len(self._workers)
        return self._stream(ray.put(request), verifier_ref, chunks, stats)

    def _stream(self, request_ref, verifier_ref, chunks: deque, stats: ScaleOutStats) -> Iterator[Sample]:
        ray = _ray()
        running: dict = {}  # ObjectRef -> worker index

        def submit(w: int) -> None:
            if chunks:
                running[self._workers[w].run.remote(request_ref, verifier_ref, chunks.popleft())] = w

        for _ in range(self.queue_depth):
            for w in range(len(self._workers)):
                submit(w)
        try:
            while running:
                [done], _ = ray.wait(list(running), num_returns=1)
                w = running.pop(done)
                samples, pool = self._get(done, w, "failed")
                submit(w)  # before yielding: the worker goes on while the caller reads
                stats.chunks_per_worker[w] += 1
                stats.samples_per_worker[w] += len(samples)
                stats.pools.append(pool)
                yield from samples
        finally:
            # An error, or the caller stopped reading: queued chunks are dropped, running ones
            # end on their own (Ray cannot stop a running call), their results unread.
            for ref in running:
                ray.cancel(ref)

    def _get(self, ref, worker: int, what: str, cause: bool = False):
        ray = _ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            # A failed load ends with the worker's exception line; keep Ray's full text as the cause.
            why = str(e).strip().splitlines()[-1] if e.actor_init_failed else str(e)
            raise GenerationError(f"scale-out worker {worker} {what or 'died'}: {why}") from e
        except ray.exceptions.RayTaskError as e:
            if cause and e.cause is not None:
                raise e.cause from None  # a bad argument: the local error, without Ray's wrapping
            raise

    def shutdown(self) -> None:
        """Stop the workers (Ray itself keeps running)."""
        ray = _ray()
        for w in self._workers:
            ray.kill(w)
        self._workers = []

    def __enter__(self) -> "RaySampler":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


__all__ = ["RaySampler", "ScaleOutStats"]
