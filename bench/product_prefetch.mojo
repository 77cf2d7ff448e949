"""How the decode ops' products at batch 16 keep their panels coming: one unit (16 batch rows
times a panel of 64 columns, K rows, float32) as the decode ops run it, its panels cycling
through TOTAL_KIB of memory, with each way of prefetching the panels.

    product_prefetch MODE TOTAL_KIB K WORKERS
    -> mode MODE total_kib T k K workers W flops F best_s S gflops G

A unit is 4 sub-panels of 2 vectors, each multiplied by 4 register tiles of 4 rows
(mojo/decode_step.mojo ``_tile_here``); the workers claim the units in runs as the decode ops
claim their product phases (``_claim`` with a share), passes over the panels (a wait for
every worker after each) for at least 2048 units, the best of 3 runs reported. MODE:

- ``none``: no software prefetch (the hardware's prefetchers alone);
- ``own``: the first sub-panel's later tiles prefetch the unit's other sub-panels, a line per
  step of k;
- ``crowded``: the first sub-panel's later tiles prefetch the next unit's panel, a line per
  step of k;
- ``spread``: every tile prefetches its share of the next unit's panel, a line per KU steps
  of k (mojo/decode_step.mojo ``_product_unit``, as both decode ops do with AVX2; with AVX-512
  they do not prefetch the next panel, ``PREFETCH_NEXT_PANEL``).

The next unit is the next of the worker's run, after the run's last the one the claims'
counter has reached. Built by bench/product_prefetch.py against ``mojo/`` (imported as the
package ``ops``).
"""
from std.atomic import Atomic
from std.sys import argv
from std.time import perf_counter_ns
from max.algorithm import sync_parallelize

from ops.decode_step import CLAIM_SHARE, F32P, I64P, KU, PANEL, W, _claim, _fetch_line, _tile_here

comptime F32 = DType.float32
comptime ROWS = 16  # batch rows of a unit
comptime TILE_ROWS = 4
comptime NVT = 2  # vectors of columns per tile
comptime LINE = 64 // 4  # floats per cache line
comptime STRIDE = 16  # int64 slots between a pass's counters (cache lines apart)
comptime UNITS = 2048  # units per run at least: small totals get more passes
comptime NONE = 0
comptime OWN = 1
comptime CROWDED = 2
comptime SPREAD = 3


def _unit[mode: Int](p: F32P, next: F32P, x: F32P, t: F32P, K: Int):
    """16 rows of x times the panel at p; prefetching as ``mode`` says (next: the next
    unit's panel, or p itself when there is none)."""
    comptime SUBS = PANEL // (NVT * W)
    comptime TILES = ROWS // TILE_ROWS
    comptime for s in range(SUBS):
        comptime for i in range(TILES):
            var xr = x.unsafe_offset(i * TILE_ROWS * K)
            var pc = p.unsafe_offset(s * NVT * W)
            comptime if mode == OWN and s == 0 and i >= 1 and i < SUBS:
                _tile_here[TILE_ROWS, NVT, F32, True](t, xr, K, pc, PANEL, K, p.unsafe_offset(i * NVT * W), PANEL)
            elif mode == CROWDED and s == 0 and i >= 1:
                _tile_here[TILE_ROWS, NVT, F32, True](t, xr, K, pc, PANEL, K, next.unsafe_offset((i - 1) * K * LINE),
                                                      LINE)
            elif mode == SPREAD:
                var line = _fetch_line(s * TILES + i, K)
                _tile_here[TILE_ROWS, NVT, F32, True, KU](t, xr, K, pc, PANEL, K, next.unsafe_offset(line * LINE),
                                                          LINE)
            else:
                _tile_here[TILE_ROWS, NVT, F32, False](t, xr, K, pc, PANEL, K, p, 0)


def _pass[mode: Int](p: F32P, x: F32P, t: F32P, K: Int, panels: Int, counter: I64P, share: Int):
    """One worker's share of a pass over the panels, claimed in runs, then a wait for the others."""
    var done = counter.unsafe_offset(8)
    var size = K * PANEL
    while True:
        var first, end = _claim(counter, panels, share)
        if first >= panels:
            break
        for q in range(first, end):
            var after = q + 1 if q + 1 < end else Int(Atomic[Int64].load(counter))
            var next = p.unsafe_offset((after if after < panels else q) * size)
            _unit[mode](p.unsafe_offset(q * size), next, x, t, K)
        _ = Atomic[Int64].fetch_add(done, Int64(end - first))
    while Int(Atomic[Int64].load(done)) < panels:
        pass


def _run(mode: Int, p: F32P, x: F32P, t: F32P, K: Int, panels: Int, passes: Int, workers: Int) -> Float64:
    """Seconds for ``passes`` passes over the panels on ``workers`` workers."""
    var counters = List[Int64](length=passes * STRIDE, fill=0)
    var cp = I64P(unsafe_from_address=Int(counters.unsafe_ptr()))
    var share = workers * CLAIM_SHARE

    def work(w: Int) {var p, var x, var t, var K, var panels, var passes, var cp, var share, var mode}:
        var tw = t.unsafe_offset(w * TILE_ROWS * PANEL)
        for i in range(passes):
            var c = cp.unsafe_offset(i * STRIDE)
            if mode == NONE:
                _pass[NONE](p, x, tw, K, panels, c, share)
            elif mode == OWN:
                _pass[OWN](p, x, tw, K, panels, c, share)
            elif mode == CROWDED:
                _pass[CROWDED](p, x, tw, K, panels, c, share)
            else:
                _pass[SPREAD](p, x, tw, K, panels, c, share)

    var t0 = perf_counter_ns()
    sync_parallelize(work, workers)
    var seconds = Float64(perf_counter_ns() - t0) * 1e-9
    _ = counters^
    return seconds


def main() raises:
    var args = argv()
    if len(args) != 5:
        raise Error("usage: product_prefetch MODE TOTAL_KIB K WORKERS (MODE: none, own, crowded, spread)")
    var name = String(args[1])
    if name != "none" and name != "own" and name != "crowded" and name != "spread":
        raise Error("unknown mode " + name)
    var mode = NONE if name == "none" else (OWN if name == "own" else (CROWDED if name == "crowded" else SPREAD))
    var total_kib = atol(args[2])
    var K = atol(args[3])
    var workers = atol(args[4])
    if K % KU != 0 or K < 16 or workers < 1:
        raise Error("K must be a multiple of 4 and at least 16, WORKERS positive")
    var panels = max(2, total_kib * 1024 // (K * PANEL * 4))
    var weights = List[Float32](length=panels * K * PANEL, fill=0.5)
    var xs = List[Float32](length=ROWS * K, fill=0.25)
    var sums = List[Float32](length=workers * TILE_ROWS * PANEL, fill=0)
    var p = F32P(unsafe_from_address=Int(weights.unsafe_ptr()))
    var x = F32P(unsafe_from_address=Int(xs.unsafe_ptr()))
    var t = F32P(unsafe_from_address=Int(sums.unsafe_ptr()))
    var passes = (UNITS + panels - 1) // panels
    var best = Float64(1e30)
    for _ in range(3):
        best = min(best, _run(mode, p, x, t, K, panels, passes, workers))
    var flops = 2.0 * Float64(ROWS * PANEL * K) * Float64(panels * passes)
    print("mode", name, "total_kib", panels * K * PANEL * 4 // 1024, "k", K, "workers", workers, "flops", flops,
          "best_s", best, "gflops", flops / best * 1e-9)
    _ = weights^
    _ = xs^
    _ = sums^
