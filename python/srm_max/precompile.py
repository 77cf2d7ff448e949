"""Compile several MAX graphs at once, one process each.

A cold MAX compile runs for minutes on ONE core, so a machine with more cores
compiles an engine's prefill and decode graphs (or a test suite's graphs) side
by side. A ``GraphJob`` names a graph by picklable facts (kind, config, dtype,
device, kernels); a child process (``python -m srm_max.precompile``) builds it
exactly as the ``Engine`` does, compiles it and writes the ``.mef`` file the
Engine then loads in milliseconds (``compile_cache``). Children inherit the
environment, so ``SRM_MAX_CPU_TARGET`` holds for them too.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

# how often the elapsed time of a running compile is logged
REPORT_EVERY_S = 15.0

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
    """Compile ``job`` into the cache (in this process); -> seconds."""
    from max.engine import InferenceSession

    from .compile_cache import compile_to_cache
    from .engine import resolve_device

    t = time.perf_counter()
    device, _ = resolve_device(job.device)
    compile_to_cache(InferenceSession(devices=[device]), job.graph(), job.extra_key)
    return time.perf_counter() - t


def _describe(jobs: list[GraphJob]) -> str:
    kinds = ", ".join(f"{j.kind} ({'pha' if j.is_pha else 'srm'}, {j.dtype}, {j.device})" for j in jobs)
    return f"{len(jobs)} MAX graph{'s' if len(jobs) > 1 else ''}: {kinds}"


def compile_in_workers(jobs: list[GraphJob], workers: int) -> dict[GraphJob, float]:
    """Compile each job in a child ``python -m srm_max.precompile`` (at most ``workers`` at
    once), logging the elapsed time while they run; -> seconds per job.

    Fresh interpreters, not multiprocessing: a spawned multiprocessing worker imports the
    caller's ``__main__`` again, so a user's unguarded script would start over in every
    worker. A child that fails raises ``RuntimeError`` with its output."""
    pending = deque(jobs)
    running: dict[GraphJob, tuple[subprocess.Popen, object]] = {}
    seconds: dict[GraphJob, float] = {}
    t0 = time.perf_counter()
    next_report = t0 + REPORT_EVERY_S
    try:
        while pending or running:
            while pending and len(running) < max(1, workers):
                job = pending.popleft()
                out = tempfile.TemporaryFile()
                proc = subprocess.Popen([sys.executable, "-m", "srm_max.precompile"], stdin=subprocess.PIPE,
                                        stdout=out, stderr=subprocess.STDOUT)
                proc.stdin.write(pickle.dumps(job))
                proc.stdin.close()
                running[job] = (proc, out)
            job, (proc, out) = next(iter(running.items()))
            try:
                proc.wait(timeout=max(0.1, next_report - time.perf_counter()))
            except subprocess.TimeoutExpired:
                pass
            for job, (proc, out) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[job]
                out.seek(0)
                text = out.read().decode(errors="replace")
                out.close()
                if proc.returncode != 0:
                    raise RuntimeError(f"compiling the {job.kind} graph failed (exit {proc.returncode}):\n"
                                       f"{text[-4000:]}")
                seconds[job] = float(text.strip().splitlines()[-1])
                log.info("compiled the %s graph in %.0f s", job.kind, seconds[job])
            if time.perf_counter() >= next_report and running:
                log.info("still compiling: %.0f s elapsed, %d of %d graphs done",
                         time.perf_counter() - t0, len(seconds), len(jobs))
                next_report += REPORT_EVERY_S
    finally:
        for proc, out in running.values():
            proc.kill()
            proc.wait()
            out.close()
    return seconds


def precompile(jobs: list[GraphJob], workers: int | None = None) -> dict[GraphJob, float]:
    """Compile the jobs not yet in the cache, ``workers`` at a time (default: one per
    core), each in its own process; -> seconds per compiled job. Says what it compiles
    and why through ``logging`` (the ``srm-max`` commands show it on stderr)."""
    missing = [j for j in dict.fromkeys(jobs) if not j.cached()]
    if not missing:
        return {}
    workers = min(workers or os.cpu_count() or 1, len(missing))
    log.info("compiling %s for this CPU: once per model shape and machine (cached under %s); "
             "each takes minutes on a small CPU, %d at a time", _describe(missing), _cache_dir(), workers)
    t = time.perf_counter()
    seconds = compile_in_workers(missing, workers)
    log.info("compiled %d graph%s in %.0f s", len(missing), "s" if len(missing) > 1 else "", time.perf_counter() - t)
    return seconds


def _cache_dir():
    from .compile_cache import cache_dir

    return cache_dir() / "mef"


def _worker_main() -> int:
    """``python -m srm_max.precompile``: compile the pickled GraphJob on stdin, print seconds."""
    job = pickle.loads(sys.stdin.buffer.read())
    if not isinstance(job, GraphJob):
        raise SystemExit("srm_max.precompile: expected a pickled GraphJob on stdin")
    print(_compile(job))
    return 0


__all__ = ["GRAPH_KEY", "GraphJob", "compile_in_workers", "precompile"]


if __name__ == "__main__":
    # run as the imported module, so the pickled GraphJob's class is this one
    from srm_max.precompile import _worker_main as worker_main

    raise SystemExit(worker_main())
