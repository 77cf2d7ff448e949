"""Compile several MAX graphs at once, in a few worker processes.

A cold MAX compile runs for minutes on ONE core, so a machine with more cores
compiles an engine's prefill and decode graphs (or a test suite's graphs) side
by side. A ``GraphJob`` names a graph by picklable facts (kind, config, dtype,
device, kernels, and its architecture's graph builder, pickled by name); a child
process (``python -m srm_max.runtime.precompile``, one per core) builds each job
it is handed exactly as the engine does, compiles it and writes the ``.mef`` file
the engine then loads in milliseconds (``compile_cache``), then takes the next.
Children inherit the environment, so ``SRM_MAX_CPU_TARGET`` holds for them too; a
job that names a CPU target of its own goes to a child started with that target
(one session can fill the cache for another process that will compile for it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import re
import select
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
from .compile_cache import cache_dir, compile_to_cache, graph_name, mef_path
from .device import DTYPES, resolve_device

log = logging.getLogger(__name__)

# The names of the weights that only an engine running a Mojo op registers (the copies
# its op reads, packed at load): an engine with the Mojo ops registers every weight an
# engine of the same model without them does, and these besides.
OP_WEIGHTS = "op."

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
        return _built(self, str(cache_dir())).mef_path

    def size(self) -> int:
        """The graph's length in lines of MLIR: what its compile grows with (its ops,
        hence its kernels), to start the longest compiles first."""
        return _built(self, str(cache_dir())).lines

    def weights(self) -> frozenset[str]:
        """The names of the weights the graph binds."""
        return _built(self, str(cache_dir())).weights

    def cached(self) -> bool:
        return self.mef_path().exists()

    def unit_key(self) -> tuple:
        """What the graphs compiled with this one in a unit share (``compile_units``): for a
        graph that binds weights, its engine (config, weight dtype, device, Mojo ops,
        architecture, CPU target), since a unit is loaded with one engine's weights; for one
        that binds none (the sampler's, the regrouping, which engines of other weight dtypes
        or architectures share), only the device and CPU target: any engine can load it."""
        if not self.weights():
            return self.device, self.cpu_target
        return self.engine_key(self.kernels)

    def engine_key(self, kernels: bool) -> tuple:
        """The engine of this graph's model, with or without the Mojo ops."""
        return self.config, self.dtype, self.device, kernels, self.build, self.graph_salt, self.cpu_target


# Graphs compiled together (``compile_cache.compile_to_cache``, ``compile_units``).
Unit = tuple[GraphJob, ...]


@dataclass(frozen=True)
class _Built:
    mef_path: Path
    lines: int  # the graph's length in lines of MLIR
    weights: frozenset[str]  # the names of the weights it binds


@functools.lru_cache(maxsize=None)
def _built(job: GraphJob, directory: str) -> _Built:  # directory: part of the memo key only
    graph = job.graph()
    text = str(graph)
    # a weight is an external constant in MAX's IR (also inside a loop's body, which
    # ``Graph``'s own list of weights leaves out)
    return _Built(mef_path(graph, job.salt, job.cpu_target or None), text.count("\n"),
                  frozenset(re.findall(r'mo\.constant\.external \[name = "([^"]+)"', text)))


def compile_units(jobs: list[GraphJob]) -> list[Unit]:
    """The jobs as compile units (``GraphJob.unit_key``), in the order of each unit's first
    job: the graphs that bind one engine's weights make one unit, and those that bind none
    another (a unit compiles in less time than its graphs apart, ``compile_to_cache``); a
    graph whose name a unit already holds (MAX loads a unit's graphs by name) starts
    another unit of that key."""
    units: dict[tuple, list[list[GraphJob]]] = {}
    for job in jobs:
        name = graph_name(job.mef_path())
        same_key = units.setdefault(job.unit_key(), [])
        unit = next((u for u in same_key if name not in {graph_name(j.mef_path()) for j in u}), None)
        if unit is None:
            same_key.append(unit := [])
        unit.append(job)
    ordered = sorted((unit for same_key in units.values() for unit in same_key), key=lambda u: jobs.index(u[0]))
    return [tuple(unit) for unit in _op_units_joined_to_plain_units(ordered)]


def _op_units_joined_to_plain_units(units: list[list[GraphJob]]) -> list[list[GraphJob]]:
    """Each unit of graphs with the Mojo ops that binds no op weights (``OP_WEIGHTS``)
    joined to the unit of the same model's plain graphs, where both are among the jobs (a
    test suite compiles both engines' graphs): either engine registers every weight the
    other's graphs there bind, so either loads the unit, and one compile of the two costs
    less than two (they share most of their kernels, and a compile's fixed cost is paid
    once). A unit that binds op weights stays apart: the plain engine lacks them."""
    plain = {unit[0].unit_key(): unit for unit in units if unit[0].weights() and not unit[0].kernels}
    kept = []
    for unit in units:
        first = unit[0]
        target = None
        if first.kernels and first.weights() and not any(
                name.startswith(OP_WEIGHTS) for job in unit for name in job.weights()):
            target = plain.get(first.engine_key(False))
        names = {graph_name(job.mef_path()) for job in unit}
        if target is not None and not names & {graph_name(job.mef_path()) for job in target}:
            target.extend(unit)  # the plain unit's list, in ``kept`` already or soon
        else:
            kept.append(unit)
    return kept


def _compile(unit: Unit, sessions: dict[str, InferenceSession]) -> float:
    """Compile ``unit`` into the cache (in this process, in its device's session from
    ``sessions``, made on first use); -> seconds."""
    t = time.perf_counter()
    device_name = unit[0].device
    if device_name not in sessions:
        device, _ = resolve_device(device_name)
        sessions[device_name] = InferenceSession(devices=[device])
    compile_to_cache(sessions[device_name], [(job.graph, job.salt) for job in unit])
    return time.perf_counter() - t


def joins_plain_and_op_graphs(unit: Unit) -> bool:
    """Whether the unit is a model's plain graphs joined by its graphs with the Mojo ops
    (``compile_units``; in a unit binding no weights the Mojo ops are moot)."""
    return len({job.kernels for job in unit}) > 1 and bool(unit[0].weights())


def unit_kinds(unit: Unit) -> str:
    """``prefill + decode``; in a unit of plain graphs joined by graphs with the Mojo ops,
    those marked: ``prefill + decode + prefill with the Mojo ops``."""
    mixed = joins_plain_and_op_graphs(unit)
    return " + ".join(job.kind + (" with the Mojo ops" if mixed and job.kernels else "") for job in unit)


def describe(unit: Unit) -> str:
    """``prefill + decode (pha, float32, cpu)``: the unit's kinds and what they are for."""
    job = unit[0]
    facts = ", ".join(filter(None, (job.architecture, job.dtype, job.device, job.cpu_target)))
    return f"{unit_kinds(unit)} ({facts})"


class _Worker:
    """A child ``python -m srm_max.runtime.precompile`` that compiles the units handed to
    it one after another, all for one CPU target (its environment's): a worker that lives
    for several units starts MAX once.

    Units go down its stdin as a stream of pickles; it answers each with a line of seconds
    on its stdout, and everything else it prints goes to a file that a failure's error quotes."""

    def __init__(self, cpu_target: str):
        self.cpu_target = cpu_target
        self.unit: Unit | None = None
        self.output = tempfile.TemporaryFile()
        env = os.environ | {targets.ENV: cpu_target} if cpu_target else None
        self.proc = subprocess.Popen([sys.executable, "-m", "srm_max.runtime.precompile"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.output, env=env)

    def give(self, unit: Unit) -> None:
        self.unit = unit
        pickle.dump(unit, self.proc.stdin)
        self.proc.stdin.flush()

    def seconds(self) -> float:
        """The finished unit's seconds (its answer is ready on stdout); raises
        ``RuntimeError`` with the worker's output if it died instead."""
        line = self.proc.stdout.readline()
        if line:
            self.unit = None
            return float(line)
        self.proc.wait()
        self.output.seek(0)
        text = self.output.read().decode(errors="replace")
        raise RuntimeError(f"compiling the {' + '.join(j.kind for j in self.unit)} graph failed "
                           f"(exit {self.proc.returncode}):\n{text[-4000:]}")

    def close(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        else:
            self.proc.stdin.close()  # the worker ends at the end of its stream
        self.proc.wait()
        self.proc.stdout.close()
        self.output.close()


def compile_in_workers(units: list[Unit], workers: int) -> dict[Unit, float]:
    """Compile each unit (``compile_units``; a tuple of jobs compiled together) in at most
    ``workers`` children ``python -m srm_max.runtime.precompile`` at once, in the order given,
    each child taking the next unit of its CPU target as its last compile ends; logs the
    elapsed time while they run; -> seconds per unit.

    Fresh interpreters, not multiprocessing: a spawned multiprocessing worker imports the
    caller's ``__main__`` again, so a user's unguarded script would start over in every
    worker. A child that fails raises ``RuntimeError`` with its output."""
    pending = deque(units)
    running: list[_Worker] = []
    seconds: dict[Unit, float] = {}
    t0 = time.perf_counter()
    next_report = t0 + REPORT_EVERY_S

    def hand_out(worker: _Worker) -> bool:
        """Give ``worker`` the next pending unit of its target; False if there is none."""
        unit = next((u for u in pending if u[0].cpu_target == worker.cpu_target), None)
        if unit is None:
            return False
        pending.remove(unit)
        worker.give(unit)
        return True

    try:
        while pending or running:
            while pending and len(running) < max(1, workers):
                worker = _Worker(pending[0][0].cpu_target)
                running.append(worker)
                hand_out(worker)
            ready, _, _ = select.select([w.proc.stdout for w in running], [], [], POLL_S)
            for worker in [w for w in running if w.proc.stdout in ready]:
                unit = worker.unit
                seconds[unit] = worker.seconds()
                log.info("compiled %s in %.0f s", describe(unit), seconds[unit])
                if not hand_out(worker):
                    running.remove(worker)
                    worker.close()
            if time.perf_counter() >= next_report and running:
                log.info("still compiling: %.0f s elapsed, %d of %d units done",
                         time.perf_counter() - t0, len(seconds), len(units))
                next_report += REPORT_EVERY_S
    finally:
        for worker in running:
            worker.close(kill=True)
    return seconds


def precompile(jobs: list[GraphJob], workers: int | None = None) -> dict[Unit, float]:
    """Compile the jobs not yet in the cache, one unit per engine (``compile_units``),
    ``workers`` units at a time (default: one per core), in child processes; -> seconds
    per compiled unit. Says what it compiles and why through ``logging`` (the ``srm-max``
    commands show it on stderr)."""
    missing = [j for path, j in _one_job_per_graph(jobs).items() if not path.exists()]
    if not missing:
        return {}
    units = compile_units(missing)
    # the longest first, so that the compiles left at the end, when cores fall idle, are short
    units.sort(key=lambda unit: sum(job.size() for job in unit), reverse=True)
    workers = min(workers or os.cpu_count() or 1, len(units))
    log.info("compiling %d MAX graph%s for this CPU: %s; once per model shape and machine (cached under %s); "
             "each takes minutes on a small CPU, %d at a time", len(missing), "s" if len(missing) > 1 else "",
             "; ".join(map(describe, units)), _cache_dir(), workers)
    t = time.perf_counter()
    seconds = compile_in_workers(units, workers)
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
    """``python -m srm_max.runtime.precompile``: compile each pickled unit (a tuple of
    GraphJobs) on stdin in turn, answering each with a line of its seconds (``_Worker``)."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what MAX prints is not an answer
    units = sys.stdin.buffer
    sessions: dict[str, InferenceSession] = {}
    while True:
        try:
            unit = pickle.load(units)
        except EOFError:
            break
        if not (isinstance(unit, tuple) and unit and all(isinstance(job, GraphJob) for job in unit)):
            raise SystemExit("srm_max.runtime.precompile: expected a pickled tuple of GraphJobs on stdin")
        for job in unit:
            if job.cpu_target and targets.current() != job.cpu_target:  # its .mef would go under another key
                raise SystemExit(f"srm_max.runtime.precompile: the job is for {job.cpu_target}, this process "
                                 f"compiles for {targets.current()}")
        print(_compile(unit, sessions), file=answers, flush=True)
    # Each .mef file is complete (written atomically) once _compile returns; MAX's worker
    # threads can abort the interpreter's teardown after that ("terminate called without an
    # active exception"), which would report finished compiles as failed: leave at once.
    os._exit(0)


__all__ = ["OP_WEIGHTS", "GraphJob", "Unit", "compile_in_workers", "compile_units", "describe", "precompile",
           "joins_plain_and_op_graphs", "unit_kinds"]


if __name__ == "__main__":
    # run as the imported module, so the pickled GraphJob's class is this one
    from srm_max.runtime.precompile import _worker_main as worker_main

    raise SystemExit(worker_main())
