"""Compile several MAX graphs at once, one process each.

A cold MAX compile runs for minutes on ONE core, so a machine with more cores
compiles an engine's prefill and decode graphs (or a test suite's graphs) side
by side. A ``GraphJob`` names a graph by picklable facts (kind, config, dtype,
device, kernels); a child process builds it exactly as the ``Engine`` does,
compiles it and writes the ``.mef`` file the Engine then loads in milliseconds
(``compile_cache``).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

# Bumped when a compiled model must not be reused although its MLIR text is the same
# (v2: graphs compiled while numpy constants could be freed before compilation).
GRAPH_KEY = b"srm-graphs-v2"


@dataclass(frozen=True)
class GraphJob:
    kind: str  # "prefill" | "decode" | "decode_greedy" (SRM, CPU with kernels)
    config: tuple  # sorted (field, value) pairs of the SRMConfig or PHAConfig
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" | "gpu"
    kernels: bool = False  # the Mojo mixer ops (scan in prefill, step in decode)

    @classmethod
    def of(cls, kind: str, config, dtype: str = "float32", device: str = "cpu",
           kernels: bool = False) -> "GraphJob":
        items = ((k, tuple(v) if isinstance(v, list) else v) for k, v in config.to_dict().items())
        return cls(kind, tuple(sorted(items)), dtype, device, kernels)

    @property
    def is_pha(self) -> bool:
        return dict(self.config).get("architecture") == "pha"

    @property
    def extra_key(self) -> bytes:
        if self.is_pha:
            from .pha_engine import GRAPH_KEY as PHA_GRAPH_KEY

            return PHA_GRAPH_KEY
        return GRAPH_KEY

    def model_config(self):
        if self.is_pha:
            from .pha_config import PHAConfig

            return PHAConfig(**dict(self.config))
        from .config import SRMConfig

        return SRMConfig(**dict(self.config))

    def graph(self):
        from max.dtype import DType
        from max.graph import DeviceRef

        from .graphs.decode import build_decode_graph, build_decode_greedy_graph
        from .graphs.prefill import build_prefill_graph

        wdtype = {"float32": DType.float32, "bfloat16": DType.bfloat16}[self.dtype]
        device = DeviceRef.GPU() if self.device == "gpu" else DeviceRef.CPU()
        if self.is_pha:
            from .graphs import pha

            builder = {"prefill": pha.build_pha_prefill_graph, "decode": pha.build_pha_decode_graph}[self.kind]
            return builder(self.model_config(), wdtype, device)
        if self.kind == "prefill":
            return build_prefill_graph(self.model_config(), wdtype, device, kernels=self.kernels)
        if self.kind == "decode":
            return build_decode_graph(self.model_config(), wdtype, device, kernels=self.kernels)
        if self.kind == "decode_greedy" and self.kernels and self.device == "cpu":
            return build_decode_greedy_graph(self.model_config(), wdtype)
        raise ValueError(f"unknown graph kind {self.kind!r}")

    def mef_path(self):
        """Where the compiled graph is cached (the graph is built once per process and
        cache directory for this)."""
        from .compile_cache import cache_dir

        return _mef_path(self, str(cache_dir()))

    def cached(self) -> bool:
        return self.mef_path().exists()


@functools.lru_cache(maxsize=None)
def _mef_path(job: GraphJob, directory: str):  # directory: part of the memo key only
    from .compile_cache import mef_path

    return mef_path(job.graph(), job.extra_key)


def _compile(job: GraphJob) -> float:
    """Child process: compile ``job`` into the cache; -> seconds."""
    from max.engine import InferenceSession

    from .compile_cache import compile_to_cache
    from .engine import resolve_device

    t = time.perf_counter()
    device, _ = resolve_device(job.device)
    compile_to_cache(InferenceSession(devices=[device]), job.graph(), job.extra_key)
    return time.perf_counter() - t


def precompile(jobs: list[GraphJob], workers: int | None = None) -> dict[GraphJob, float]:
    """Compile the jobs not yet in the cache, ``workers`` at a time (default: one per
    core); -> seconds per compiled job. With one missing job (or one worker) it runs
    here, without a child process."""
    missing = [j for j in dict.fromkeys(jobs) if not j.cached()]
    workers = min(workers or os.cpu_count() or 1, len(missing))
    if workers <= 1:
        return {j: _compile(j) for j in missing}
    # spawn, not fork: the parent may already run MAX's thread pool
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(missing, pool.map(_compile, missing)))


__all__ = ["GRAPH_KEY", "GraphJob", "precompile"]
