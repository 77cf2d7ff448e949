"""The op tests' compiled graphs (tests/support/op_graph_builders.py), named by the op they
test (or the piece of a graph they hold) and treated like the engines' graphs: a test declares the ones it uses
(``op_graphs(OP_SCAN)`` in tests/support/graphs.py), the session compiles every declared
graph up front, side by side (tests/conftest.py ``suite_graphs``), and ``model`` then loads
it from the cache. A cold compile of even one op alone takes tens of seconds: compiled on
first use inside the tests, they would compile one at a time.

``model`` records each graph the running test uses; tests/conftest.py fails a test that
uses one it does not declare (``graphs.undeclared``): run alone, that test would compile it
inside itself."""

from __future__ import annotations

import os
from dataclasses import dataclass

from max.driver import CPU
from max.engine import InferenceSession

from srm_max.graphs.op_names import (OP_DECODE_STEP, OP_DECODE_STEPS, OP_LINEAR, OP_PHA_GSS_SCAN,
                                     OP_PHA_PREFILL_ATTENTION, OP_SAMPLE_ROWS, OP_SCAN, OP_SCORE_HEAD,
                                     OP_SCORE_ROWS, OP_STEP_FUNCTIONAL)
from srm_max.runtime.compile_cache import load_compiled
from srm_max.runtime.device import DTYPES
from srm_max.runtime.precompile import GraphJob
from tests.support import op_graph_builders as build
from tests.support.paths import REPO_ROOT

# each op's graph (the op alone; the row sampler beside graphs/sampler.py's sampler), and
# the PHA prefill's state placement alone
BUILDERS = {
    OP_STEP_FUNCTIONAL: build.step_graph,
    OP_SCAN: build.scan_graph,
    OP_DECODE_STEP: build.decode_step_graph,
    OP_DECODE_STEPS: build.decode_steps_graph,
    OP_SCORE_HEAD: build.score_head_graph,
    OP_SCORE_ROWS: build.score_rows_graph,
    OP_LINEAR: build.linear_graph,
    OP_SAMPLE_ROWS: build.sample_rows_graph,
    OP_PHA_PREFILL_ATTENTION: build.pha_prefill_attention_graph,
    OP_PHA_GSS_SCAN: build.pha_gss_scan_graph,
    build.PHA_PREFILL_STATES: build.pha_prefill_states_graph,
}


@dataclass(frozen=True)
class OpGraphConfig:
    """The ``config`` of an op graph's GraphJob: what a graph needs beyond its op."""

    vocab: int | None = None  # the static row width of a graph that needs one (the row sampler's)
    architecture: str = "mojo_ops"  # what the compile log names the graph's family by


# the op graphs that also come with bfloat16 weights (the others are float32 alone)
WEIGHT_DTYPES = {OP_DECODE_STEP: ("float32", "bfloat16")}


def build_graph(kind: str, config: OpGraphConfig, wdtype, device, kernels: bool):
    """The op graph ``kind`` (an op name; ``GraphJob.build``, so pickled by name for the
    compile workers): float32 (or the weight dtype of ``WEIGHT_DTYPES``), on the CPU, the
    op itself."""
    dtypes = WEIGHT_DTYPES.get(kind, ("float32",))
    if not kernels or wdtype not in [DTYPES[d] for d in dtypes]:
        raise ValueError(f"the {kind} graph has {' or '.join(dtypes)} weights and the Mojo op; asked for "
                         f"{wdtype}, kernels={kernels}")
    shape = {} if config.vocab is None else {"vocab": config.vocab}
    if kind in WEIGHT_DTYPES:
        shape["wdtype"] = wdtype
    return _builder(kind)(device, **shape)


def _builder(kind: str):
    if kind not in BUILDERS:
        raise ValueError(f"no graph of the op {kind!r} alone; there are graphs of {', '.join(BUILDERS)}")
    return BUILDERS[kind]


def job(kind: str, vocab: int | None = None, dtype: str = "float32") -> GraphJob:
    """The compile job of the op graph ``kind`` (CPU; ``dtype``: of its weights)."""
    _builder(kind)
    if dtype not in WEIGHT_DTYPES.get(kind, ("float32",)):
        raise ValueError(f"no graph of the op {kind!r} alone with {dtype} weights")
    return GraphJob(kind, OpGraphConfig(vocab), dtype, "cpu", True, build_graph, b"")


_session = None
_models: dict[GraphJob, object] = {}
_used: set[GraphJob] = set()  # by the running test (forget_uses clears it before each)


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
    _used.add(graph_job)
    if graph_job not in _models:
        _models[graph_job] = load_compiled(session(), graph_job.graph, graph_salt=graph_job.salt,
                                           mef=graph_job.mef_path())
    return _models[graph_job]


def forget_uses() -> None:
    _used.clear()


def used() -> set[GraphJob]:
    """The op graphs used since ``forget_uses``."""
    return set(_used)


def pythonpath_with_repo_root() -> str:
    """``PYTHONPATH`` with the repository root first: a compile worker (``python -m
    srm_max.runtime.precompile``, started in pytest's working directory) unpickles
    ``build_graph`` by its module's name, so it must find ``tests.support`` wherever pytest
    was started."""
    paths = [str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(paths))


