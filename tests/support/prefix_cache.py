"""Generators with and without a prefix cache, on one engine, for the cache's tests."""

from __future__ import annotations

from srm_max.serve.generator import Generator
from srm_max.serve.prefix_cache import PrefixCache


def generators(engine, **cache):
    """The same engine with a prefix cache whose points suit TINY's context of 96 (``cache``
    overrides its options), and without one."""
    on, off = Generator.from_engine(engine), Generator.from_engine(engine, prefix_cache_mb=0)
    on.prefix_cache = PrefixCache(1 << 20, **({"interval": 32, "min_shared": 4} | cache))
    return on, off
