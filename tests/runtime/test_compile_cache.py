"""The compiled-model cache's files: what a file at a graph's cache path must hold, and
an engine loading the graphs of one unit file once. Stand-in graphs that compile in a
second or two (tests/support/stand_ins.py), in this process."""

from __future__ import annotations

import logging
import os
import secrets
import shutil

import numpy as np
import pytest

from srm_max.runtime import compile_cache, compiled
from srm_max.runtime.precompile import GraphJob
from tests.support.stand_ins import PassThroughConfig, pass_through_graph

SALT = b"pass-through-test"


@pytest.fixture
def job(tmp_path, monkeypatch):
    """kind -> the stand-in graph's job, in an empty cache of ours. MAX's own compile cache
    (beside ours, one per machine) answers a graph with an earlier compiled one of the same
    code under that one's names: each test's graphs have a shape no earlier one used (of
    a million)."""
    monkeypatch.setenv("SRM_MAX_CACHE", str(tmp_path))
    rows, columns = (1 + secrets.randbelow(1000) for _ in range(2))

    def job_of(kind: str, other_code: bool = False) -> GraphJob:
        """``other_code``: a shape of its own, so its code is not the other graphs'."""
        config = PassThroughConfig(shape=(rows + 1000 * other_code, columns))
        return GraphJob(kind, config, "float32", "cpu", False, pass_through_graph, SALT)
    return job_of


@pytest.fixture(scope="module")
def session():
    from max.engine import InferenceSession

    return InferenceSession()


def passes_through(model, shape: tuple[int, ...]) -> bool:
    x = np.linspace(-2.0, 1.5, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    (out,) = model.execute(x)
    return np.array_equal(out.to_numpy(), x)


def test_a_graph_loads_under_its_own_name_whatever_max_compiled_before(job, session, caplog):
    """MAX's own compile cache answers a graph with an earlier compiled graph of the same
    code, under that one's name: graphs are found by name in their files, so a graph
    loaded from the cache is compiled again, beside MAX's cache, until its file holds it."""
    a, b = job("a"), job("b")
    compile_cache.compile_to_cache(session, [(a.graph, SALT)])
    compile_cache.compile_to_cache(session, [(b.graph, SALT)])  # the same code as a's
    assert list(session.init_all(compile_cache.engine.read(b.mef_path()))) == ["pass_through_a"]
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        model = compile_cache.load_compiled(session, b.graph, {}, SALT, mef=b.mef_path())
    assert model.name == "pass_through_b" and passes_through(model, a.config.shape)
    assert f"the cached {b.mef_path()} does not hold its graph" in caplog.text
    assert list(session.init_all(compile_cache.engine.read(b.mef_path()))) == ["pass_through_b"]


def test_a_file_that_does_not_hold_its_graph_is_compiled_again(job, session, caplog):
    """A cache path holding other graphs (written under this key by another version) or
    no graph at all (damaged) is rebuilt, with a warning, and then holds it."""
    a, b = job("a"), job("b", other_code=True)
    compile_cache.compile_to_cache(session, [(a.graph, SALT)])
    for content in (a.mef_path().read_bytes(), b"not a compiled model"):
        b.mef_path().write_bytes(content)
        with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
            model = compile_cache.load_compiled(session, b.graph, {}, SALT, mef=b.mef_path())
        assert model.name == "pass_through_b" and passes_through(model, b.config.shape)
        assert f"the cached {b.mef_path()} does not hold its graph" in caplog.text
        caplog.clear()
        compile_cache.load_compiled(session, b.graph, {}, SALT, mef=b.mef_path())
        assert not caplog.text  # now a hit


def test_each_path_of_a_unit_gets_the_units_own_export(job, session, monkeypatch):
    """Another process may put a unit of its own at the first graph's path right after this
    one does: the unit's other paths still get this unit (they link to its export)."""
    a, b = job("a"), job("b")
    compile_cache.compile_to_cache(session, [(a.graph, SALT)])
    alone = a.mef_path().with_name("a_alone.mef")
    shutil.copyfile(a.mef_path(), alone)  # a unit without the graph b
    atomic_file = compile_cache.atomic_file

    def replaced_at_once(path):
        class Writer:
            def __enter__(self):
                self.inner = atomic_file(path)
                return self.inner.__enter__()

            def __exit__(self, *exc):
                done = self.inner.__exit__(*exc)
                if path == a.mef_path():  # the other process's write lands (a file of its own)
                    shutil.copyfile(alone, alone.with_name("other.tmp"))
                    os.replace(alone.with_name("other.tmp"), path)
                return done
        return Writer()

    monkeypatch.setattr(compile_cache, "atomic_file", replaced_at_once)
    compile_cache.compile_to_cache(session, [(a.graph, SALT), (b.graph, SALT)])
    assert list(session.init_all(compile_cache.engine.read(b.mef_path()))) == ["pass_through_a", "pass_through_b"]


class PassThroughEngine(compiled.CompiledGraphs):
    """An engine of the stand-in graphs "a" and "b", with no weights."""

    build_graph = staticmethod(pass_through_graph)
    graph_salt = SALT
    kernels = False

    def __init__(self, config: PassThroughConfig):
        self.config = config
        self._start("float32", "cpu")
        self._open({})

    def graph_kinds(self) -> list[str]:
        return ["a", "b"]


def test_an_engine_initializes_a_unit_file_once(job, session, monkeypatch):
    """Graphs compiled as one unit are one file: an engine's first load initializes all of
    them, and loading another of them takes the one already initialized. A graph whose
    path holds another file (compiled apart since) is initialized from that file."""
    a, b = job("a"), job("b")
    compile_cache.compile_to_cache(session, [(a.graph, SALT), (b.graph, SALT)])
    loads = []

    def counted(session, graph, weights, salt, mef):
        loads.append(compile_cache.graph_name(mef))
        return compile_cache.load_unit(session, graph, weights, salt, mef)

    monkeypatch.setattr(compiled, "load_unit", counted)
    engine = PassThroughEngine(a.config)
    assert engine.model("a").name == "pass_through_a" and engine.model("b").name == "pass_through_b"
    assert loads == ["pass_through_a"] and passes_through(engine.model("b"), a.config.shape)
    compile_cache.compile_to_cache(session, [(b.graph, SALT)])
    engine = PassThroughEngine(a.config).load(["a", "b"])
    assert loads == ["pass_through_a", "pass_through_a", "pass_through_b"]
    assert passes_through(engine.model("b"), a.config.shape)
