"""Every Mojo driver in bench/ builds against the working tree's mojo/: the drivers import
the ops' internals (structs, tiles, claims), which change with the ops, and a benchmark
that no longer builds is found here rather than when someone needs its numbers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.decode_op_ab import ROOT, build, link_ops

DRIVERS = sorted((ROOT / "bench").glob("*.mojo"))


def _build(driver: Path, include: Path, out: Path) -> str | None:
    """None if ``driver`` built, else the build's error."""
    try:
        build(include, out / driver.stem, None, driver)
    except SystemExit as e:
        return str(e)
    return None


def test_every_bench_driver_builds(tmp_path):
    assert {d.stem for d in DRIVERS} >= {"decode_op", "fma_peak", "pha_attention_loop", "product_prefetch",
                                         "product_read_rate"}
    include = link_ops(ROOT / "mojo", tmp_path / "include")
    with ThreadPoolExecutor(max_workers=2) as pool:  # each build is a mojo process
        errors = dict(zip(DRIVERS, pool.map(lambda d: _build(d, include, tmp_path), DRIVERS)))
    failed = {d.name: e[-3000:] for d, e in errors.items() if e is not None}
    assert not failed, failed
