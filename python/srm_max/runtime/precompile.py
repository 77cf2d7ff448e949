"""Compile several MAX graphs at once, one process each.

A cold MAX compile runs for minutes on ONE core, so a machine with more cores
compiles an engine's prefill and decode graphs (or a test suite's graphs) side
by side. A ``GraphJob`` names a graph by picklable facts (kind, config, dtype,
device, kernels, and its architecture's graph builder, pickled by name); a child
process (``python -m srm_max.runtime.precompile``) builds it exactly as the engine
does, compiles it and writes the ``.mef`` file the engine then loads in
milliseconds (``compile_cache``). Children inherit the
environment, so ``SRM_MAX_CPU_TARGET`` holds for them too; a job that names a CPU
target of its own sets it for its child alone (one session can fill the cache for
another process that will compile for that target).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from max.engine import InferenceSession
from max.graph import DeviceRef, Graph

from ..graphs.sampler import SAMPLE_GRAPH_SALT
from . import cpu_target as targets
from .compile_cache import cache_dir, compile_to_cache, mef_path
from .device import DTYPES, resolve_device

log = logging.getLogger(__name__)

# how often the elapsed time of a running compile is logged
REPORT_EVERY_S = 15.0
# how often the running children are checked: a finished one's core takes the next job
POLL_S = 0.2


@dataclass(frozen=True)
class GraphJob:
    kind: str  # "prefill" | "decode" | "decode_steps" (CPU with kernels) | "sample" | "regroup"
    config: object  # the model's config (a frozen dataclass; its architecture field names it)
    dtype: str  # weight dtype: "float32" | "bfloat16"
    device: str  # "cpu" | "gpu"
    kernels: bool  # the Mojo ops
    build: Callable  # the architecture's (kind, config, weight DType, DeviceRef, kernels) -> Graph
    graph_salt: bytes  # the architecture's salt of its graphs' cache keys (``salt``)
    cpu_target: str = ""  # the virtual CPU target to compile for ("": what this process compiles for)

    @property
    def architecture(self) -> str:
        return self.config.architecture

    @property
    def salt(self) -> bytes:
        """The salt of the graph's cache key (``compile_cache.graph_key``): the
        architecture's, but the sampler's for the sample graph, which reads no weights and
        so is one compiled graph for every architecture with that vocabulary."""
        return SAMPLE_GRAPH_SALT if self.kind == "sample" else self.graph_salt

    def graph(self) -> Graph:
        wdtype = DTYPES[self.dtype]
        device = DeviceRef.GPU() if self.device == "gpu" else DeviceRef.CPU()
        return self.build(self.kind, self.config, wdtype, device, self.kernels)

    def mef_path(self) -> Path:
        """Where the compiled graph is cached (the graph is built once per process and
        cache directory for this)."""
        return _built(self, str(cache_dir()))[0]

    def size(self) -> int:
        """The graph's length in lines of MLIR: what its compile grows with (its ops,
        hence its kernels), to start the longest compiles first."""
        return _built(self, str(cache_dir()))[1]

    def cached(self) -> bool:
        return self.mef_path().exists()


@functools.lru_cache(maxsize=None)
def _built(job: GraphJob, directory: str) -> tuple[Path, int]:  # directory: part of the memo key only
    graph = job.graph()
    return mef_path(graph, job.salt, job.cpu_target or None), str(graph).count("\n")


def _compile(job: GraphJob) -> float:
    """Compile ``job`` into the cache (in this process); -> seconds."""
    t = time.perf_counter()
    device, _ = resolve_device(job.device)
    compile_to_cache(InferenceSession(devices=[device]), job.graph(), job.salt)
    return time.perf_counter() - t


def _describe(jobs: list[GraphJob]) -> str:
    kinds = ", ".join(f"{j.kind} ({', '.join(filter(None, (j.architecture, j.dtype, j.device, j.cpu_target)))})"
                      for j in jobs)
    return f"{len(jobs)} MAX graph{'s' if len(jobs) > 1 else ''}: {kinds}"


def compile_in_workers(jobs: list[GraphJob], workers: int) -> dict[GraphJob, float]:
    """Compile each job in a child ``python -m srm_max.runtime.precompile`` (at most ``workers`` at
    once, in the order given), logging the elapsed time while they run; -> seconds per job.

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
                env = os.environ | {targets.ENV: job.cpu_target} if job.cpu_target else None
                proc = subprocess.Popen([sys.executable, "-m", "srm_max.runtime.precompile"], stdin=subprocess.PIPE,
                                        stdout=out, stderr=subprocess.STDOUT, env=env)
                proc.stdin.write(pickle.dumps(job))
                proc.stdin.close()
                running[job] = (proc, out)
            time.sleep(POLL_S)
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
    missing = [j for path, j in _one_job_per_graph(jobs).items() if not path.exists()]
    # the longest first, so that the compiles left at the end, when cores fall idle, are short
    missing.sort(key=GraphJob.size, reverse=True)
    if not missing:
        return {}
    workers = min(workers or os.cpu_count() or 1, len(missing))
    log.info("compiling %s for this CPU: once per model shape and machine (cached under %s); "
             "each takes minutes on a small CPU, %d at a time", _describe(missing), _cache_dir(), workers)
    t = time.perf_counter()
    seconds = compile_in_workers(missing, workers)
    log.info("compiled %d graph%s in %.0f s", len(missing), "s" if len(missing) > 1 else "", time.perf_counter() - t)
    return seconds


def _one_job_per_graph(jobs: list[GraphJob]) -> dict[Path, GraphJob]:
    """The first job of each distinct graph, by its cache path: jobs that differ only in
    what their graph ignores (the sampler's and the regrouping's weight dtype and Mojo ops)
    build the same graph, which must not compile once per job."""
    by_graph: dict[Path, GraphJob] = {}
    for job in jobs:
        by_graph.setdefault(job.mef_path(), job)
    return by_graph


def _cache_dir() -> Path:
    return cache_dir() / "mef"


def _worker_main() -> int:
    """``python -m srm_max.runtime.precompile``: compile the pickled GraphJob on stdin, print seconds."""
    job = pickle.loads(sys.stdin.buffer.read())
    if not isinstance(job, GraphJob):
        raise SystemExit("srm_max.runtime.precompile: expected a pickled GraphJob on stdin")
    if job.cpu_target and targets.current() != job.cpu_target:  # its .mef would go under another key
        raise SystemExit(f"srm_max.runtime.precompile: the job is for {job.cpu_target}, this process compiles "
                         f"for {targets.current()}")
    print(_compile(job), flush=True)
    # The .mef file is complete (written atomically) once _compile returns; MAX's worker
    # threads can abort the interpreter's teardown after that ("terminate called without an
    # active exception"), which would report a finished compile as failed: leave at once.
    os._exit(0)


__all__ = ["GraphJob", "compile_in_workers", "precompile"]


if __name__ == "__main__":
    # run as the imported module, so the pickled GraphJob's class is this one
    from srm_max.runtime.precompile import _worker_main as worker_main

    raise SystemExit(worker_main())
