"""Stand-ins for an engine, for a collected test, and for a model's graphs."""

from __future__ import annotations

from dataclasses import dataclass

from tests.support.tiny import TINY


class NoWork:
    """Stands in for the engine: any call means work started before validation."""

    config = TINY

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} used before the arguments were checked")


class MarkedItem:
    """Stands in for a collected test (a pytest item) with ``nodeid`` and the given marks."""

    def __init__(self, *marks, nodeid: str = "tests/x.py::test_x"):
        self.nodeid = nodeid
        self.marks = [getattr(m, "mark", m) for m in marks]

    def iter_markers(self, name):
        return [m for m in self.marks if m.name == name]

    def get_closest_marker(self, name):
        return next(iter(self.iter_markers(name)), None)


@dataclass(frozen=True)
class PassThroughConfig:
    """The config of ``pass_through_graph``'s stand-in model."""

    architecture: str = "pass_through"
    shape: tuple[int, ...] = (2,)  # of the one input (and output)


def pass_through_graph(kind: str, config, wdtype, device, kernels):
    """A graph builder (as an architecture's) whose graphs return their input, and compile
    in a second or two: for the compile workers' and the cache's tests. The kinds: "a" and
    "b" (the same code under two names)."""
    from max.dtype import DType
    from max.graph import Graph, TensorType

    if kind not in ("a", "b"):
        raise ValueError(f"unknown pass-through graph kind {kind!r}")
    with Graph(f"pass_through_{kind}", input_types=[TensorType(DType.float32, list(config.shape), device)]) as g:
        g.output(g.inputs[0])
    return g
