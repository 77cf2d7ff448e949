"""Stand-ins for an engine."""

from __future__ import annotations

from tests.support.tiny import TINY


class NoWork:
    """Stands in for the engine: any call means work started before validation."""

    config = TINY

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} used before the arguments were checked")

