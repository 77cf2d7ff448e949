"""Stand-ins for an engine and for a collected test."""

from __future__ import annotations

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
