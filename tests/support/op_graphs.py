"""The op tests' compiled graphs (tests/support/op_graph_builders.py), named by the op they
test (or the piece of a graph they hold) and treated like the engines' graphs: a test declares the ones it uses
(``op_graphs(OP_SCAN)`` in tests/support/graphs.py), the session compiles every declared
graph up front, side by side (tests/conftest.py ``suite_graphs``), and ``model`` then loads
it from the cache. A cold compile of even one op alone takes tens of seconds, most of it the
fixed cost of any compile: compiled on first use inside the tests, they would compile one
at a time, and most ops share one graph (``TOGETHER``), so that they pay that cost once.

``model`` records each graph the running test uses; tests/conftest.py fails a test that
uses one it does not declare (``graphs.undeclared``): run alone, that test would compile it
inside itself."""

from __future__ import annotations

import os
from dataclasses import dataclass

from max.driver import CPU
from max.engine import InferenceSession

from srm_max.graphs.op_names import (OP_DECODE_STEP, OP_DECODE_STEPS, OP_LINEAR, OP_LINEAR_PACKED, OP_PHA_GSS_SCAN,
                                     OP_PHA_PREFILL_ATTENTION, OP_PHA_QK_ROPE, OP_SAMPLE_ROWS, OP_SCAN, OP_SCORE_HEAD,
                                     OP_SCORE_ROWS, OP_STEP_FUNCTIONAL)
from srm_max.runtime.compile_cache import load_compiled
from srm_max.runtime.device import DTYPES
from srm_max.runtime.precompile import GraphJob
from tests.support import op_graph_builders as build
from tests.support.paths import REPO_ROOT

# The ops alone that share one graph, ``TOGETHER`` (``op_graph_builders.together``): a
# graph's compile is mostly a fixed cost whatever it holds, so the one graph compiles in
# about the time of one of them alone. Each call runs every op in it, the others on inputs
# that give them nothing to do (``OpPiece.idle``).
TOGETHER = "mojo_ops_together"
PIECES = {
    OP_STEP_FUNCTIONAL: build.STEP,
    OP_SCAN: build.SCAN,
    OP_DECODE_STEP: build.DECODE_STEP,
    OP_DECODE_STEPS: build.DECODE_STEPS,
    OP_SCORE_HEAD: build.SCORE_HEAD,
    build.SCORE_HEAD_BF16: build.SCORE_HEAD_BF16_HEAD,
    OP_SCORE_ROWS: build.SCORE_ROWS,
    OP_LINEAR: build.LINEAR,
    build.LINEAR_BF16: build.LINEAR_BF16_WEIGHTS,
    OP_LINEAR_PACKED: build.LINEAR_PACKED,
    build.LINEAR_PACKED_BF16: build.LINEAR_PACKED_BF16_MATRICES,
    OP_PHA_PREFILL_ATTENTION: build.PHA_ATTENTION,
    OP_PHA_GSS_SCAN: build.PHA_GSS_SCAN,
    OP_PHA_QK_ROPE: build.PHA_QK_ROPE,
}
# graphs of their own: the row sampler beside graphs/sampler.py's sampler (a static row
# width), and the PHA prefill's state placement (plain ops beside the op)
ALONE = {
    OP_SAMPLE_ROWS: build.sample_rows_graph,
    build.PHA_PREFILL_STATES: build.pha_prefill_states_graph,
}
# the op graphs that also come with bfloat16 weights, each a graph of its own in that dtype
WEIGHT_DTYPES = {OP_DECODE_STEP: ("float32", "bfloat16")}


@dataclass(frozen=True)
class OpGraphConfig:
    """The ``config`` of an op graph's GraphJob: what a graph needs beyond its op."""

    vocab: int | None = None  # the static row width of a graph that needs one (the row sampler's)
    architecture: str = "mojo_ops"  # what the compile log names the graph's family by


def build_graph(kind: str, config: OpGraphConfig, wdtype, device, kernels: bool):
    """The op graph ``kind`` (``TOGETHER``, an op name of ``ALONE``, or an op of
    ``WEIGHT_DTYPES`` in its other dtype; ``GraphJob.build``, so pickled by name for the
    compile workers), on the CPU, with the Mojo ops."""
    if not kernels:
        raise ValueError(f"the {kind} graph is a graph of Mojo ops; asked for kernels={kernels}")
    if kind == TOGETHER and wdtype == DTYPES["float32"]:
        return build.together(TOGETHER, list(PIECES.values()), device)
    if kind == OP_DECODE_STEP and wdtype == DTYPES["bfloat16"]:
        return build.decode_step_graph(device, wdtype)
    if kind in ALONE and wdtype == DTYPES["float32"]:
        return ALONE[kind](device, **({} if config.vocab is None else {"vocab": config.vocab}))
    raise ValueError(f"no {wdtype} graph {kind!r} of Mojo ops")


def job(kind: str, vocab: int | None = None, dtype: str = "float32") -> GraphJob:
    """The compile job of the graph that holds the op ``kind`` (CPU; ``dtype``: of its
    weights): ``TOGETHER`` for the ops of ``PIECES`` in float32."""
    if kind not in PIECES and kind not in ALONE:
        raise ValueError(f"no graph of the op {kind!r} alone; there are graphs of {', '.join([*PIECES, *ALONE])}")
    if dtype not in WEIGHT_DTYPES.get(kind, ("float32",)):
        raise ValueError(f"no graph of the op {kind!r} alone with {dtype} weights")
    graph = TOGETHER if kind in PIECES and dtype == "float32" else kind
    return GraphJob(graph, OpGraphConfig(vocab), dtype, "cpu", True, build_graph, b"")


@dataclass(frozen=True)
class OpUse:
    """An op graph a test loaded through ``model``."""

    kind: str
    vocab: int | None = None
    dtype: str = "float32"

    def job(self) -> GraphJob:
        return job(self.kind, self.vocab, self.dtype)

    def marker_args(self) -> str:
        """What ``op_graphs`` takes to declare it."""
        return ", ".join([self.kind] + ([f"vocab={self.vocab}"] if self.vocab is not None else [])
                         + ([f"dtype={self.dtype!r}"] if self.dtype != "float32" else []))


class OneOpOfTogether:
    """One op of the ``TOGETHER`` graph: ``execute`` takes and returns that op's inputs and
    outputs alone and hands the other ops their idle inputs."""

    def __init__(self, model, kind: str):
        kinds, pieces = list(PIECES), list(PIECES.values())
        i = kinds.index(kind)
        self._model = model
        self._before = [a for p in pieces[:i] for a in p.idle_inputs()]
        self._after = [a for p in pieces[i + 1:] for a in p.idle_inputs()]
        self._first = sum(p.outputs for p in pieces[:i])
        self._count = pieces[i].outputs

    def execute(self, *inputs):
        return self._model.execute(*self._before, *inputs, *self._after)[self._first:self._first + self._count]


_session = None
_models: dict[GraphJob, object] = {}
_ops_together: dict[str, OneOpOfTogether] = {}  # by op
_used: set[OpUse] = set()  # by the running test (forget_uses clears it before each)


def session():
    """The process-wide CPU InferenceSession the op graphs load into.

    (``InferenceSession(num_threads=...)`` aborts in MAX 26.7: never pass it.)
    """
    global _session
    if _session is None:
        _session = InferenceSession(devices=[CPU()])
    return _session


def model(kind: str, vocab: int | None = None, dtype: str = "float32"):
    """The compiled op graph ``kind``, loaded once per process: from the cache the
    session's up-front compile filled when the running test declares it."""
    graph_job = job(kind, vocab, dtype)
    _used.add(OpUse(kind, vocab, dtype))
    if graph_job not in _models:
        _models[graph_job] = load_compiled(session(), graph_job.graph, graph_salt=graph_job.salt,
                                           mef=graph_job.mef_path())
    if graph_job.kind == TOGETHER:
        if kind not in _ops_together:
            _ops_together[kind] = OneOpOfTogether(_models[graph_job], kind)
        return _ops_together[kind]
    return _models[graph_job]


def forget_uses() -> None:
    _used.clear()


def used() -> set[OpUse]:
    """The op graphs used since ``forget_uses``."""
    return set(_used)


def pythonpath_with_repo_root() -> str:
    """``PYTHONPATH`` with the repository root first: a compile worker (``python -m
    srm_max.runtime.precompile``, started in pytest's working directory) unpickles
    ``build_graph`` by its module's name, so it must find ``tests.support`` wherever pytest
    was started."""
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(paths))


