"""How fast the decode ops' one-row product reads its matrices: the op's register tile
(mojo/decode_step.mojo ``_tile_here``, as a batch-1 unit runs it: one row, a whole panel)
against a plain read of the same bytes, and the ways the PHA op's workers share a phase.

    product_read_rate MODE DTYPE PHASE_KIB TOTAL_KIB WORKERS PHASES
    -> mode MODE dtype DTYPE phase_kib P total_kib T workers W bytes B best_s S gbps G

Like a batch-1 decode step, a run is PHASES phases one after the other, each multiplying
one row by PHASE_KIB of packed panels (K = 256 rows of 64 columns each, float32 or
bfloat16) and ending when every worker is done with it; phase i reads the i-th slice of
TOTAL_KIB of distinct panels, cyclically (a total the last-level cache holds, or not). The
best of 3 runs is reported. MODE:

- ``stream``: the phase's bytes summed, each worker a contiguous share, nothing else;
- ``tile``: the op's tile over each panel, each worker a contiguous share;
- ``per_unit``: the op's tile, the workers claiming one panel at a time from a counter
  (``_claim`` without a share, as the op claims larger units);
- ``claimed``: the op's tile, the workers claiming runs of panels as the PHA op does
  (mojo/decode_step.mojo ``_claim``);
- ``widen_each`` (bfloat16): a one-row tile that widens each vector of weights alone
  (a cross-lane shuffle and a shift per vector), each worker a contiguous share: the
  widening the ops used before ``load_weights`` widened two vectors from one load.

Built by bench/product_read_rate.py against ``mojo/`` (imported as the package ``ops``).
"""
from std.atomic import Atomic
from std.memory import stack_allocation
from std.sys import argv, size_of
from std.time import perf_counter_ns
from max.algorithm import sync_parallelize

from ops.decode_step import NV1, PANEL, _tile_here
from ops.decode_step import CLAIM_SHARE, F32P, I64P, W, _claim

comptime K = 256  # rows of a panel: the bench models' width
comptime BF16 = DType.bfloat16
comptime STRIDE = 16  # int64 slots between a phase's counters (cache lines apart)


def _read[WD: DType](p: Pointer[Scalar[WD], MutUntrackedOrigin], panels: Int, sink: F32P):
    """The panels' bytes summed as float32 words (a plain read)."""
    var words = panels * K * PANEL * size_of[WD]() // 4
    var f = F32P(unsafe_from_address=Int(p))
    var a0 = SIMD[DType.float32, W](0)
    var a1 = SIMD[DType.float32, W](0)
    var a2 = SIMD[DType.float32, W](0)
    var a3 = SIMD[DType.float32, W](0)
    var i = 0
    while i + 4 * W <= words:
        a0 += f.unsafe_load[width=W](i)
        a1 += f.unsafe_load[width=W](i + W)
        a2 += f.unsafe_load[width=W](i + 2 * W)
        a3 += f.unsafe_load[width=W](i + 3 * W)
        i += 4 * W
    sink.unsafe_store(0, sink.unsafe_load[width=W](0) + a0 + a1 + a2 + a3)


def _widen_each(t: F32P, x: F32P, p: Pointer[Scalar[BF16], MutUntrackedOrigin]):
    """One row times a bfloat16 panel, each vector of weights widened alone."""
    var acc = stack_allocation[NV1 * W, Float32]()
    comptime for v in range(NV1):
        acc.unsafe_store(v * W, SIMD[DType.float32, W](0))
    for k in range(K):
        var xb = SIMD[DType.float32, W](x[unsafe_offset=k])
        var wp = p.unsafe_offset(k * PANEL)
        comptime for v in range(NV1):
            acc.unsafe_store(v * W, xb.fma(wp.unsafe_load[width=W](v * W).cast[DType.float32](),
                                           acc.unsafe_load[width=W](v * W)))
    comptime for v in range(NV1):
        t.unsafe_store(v * W, acc.unsafe_load[width=W](v * W))


def _panel[WD: DType](mode: String, t: F32P, x: F32P, p: Pointer[Scalar[WD], MutUntrackedOrigin]):
    comptime if WD == BF16:
        if mode == "widen_each":
            _widen_each(t, x, rebind[Pointer[Scalar[BF16], MutUntrackedOrigin]](p))
            return
    _tile_here[1, NV1, WD, False](t, x, K, p, PANEL, K, p, 0)


def _phase[WD: DType](mode: String, base: Pointer[Scalar[WD], MutUntrackedOrigin], panels: Int, worker: Int,
                      workers: Int, counter: I64P, t: F32P, x: F32P):
    """This worker's share of one phase, then the wait for the others."""
    var done = counter.unsafe_offset(8)
    var step = K * PANEL
    if mode == "per_unit" or mode == "claimed":
        var share = workers * CLAIM_SHARE if mode == "claimed" else 0  # 0: a panel per claim
        while True:
            var first, end = _claim(counter, panels, share)
            if first >= panels:
                break
            for q in range(first, end):
                _panel[WD](mode, t, x, base.unsafe_offset(q * step))
            _ = Atomic[Int64].fetch_add(done, Int64(end - first))
    else:
        var lo = panels * worker // workers
        var hi = panels * (worker + 1) // workers
        if mode == "stream":
            _read[WD](base.unsafe_offset(lo * step), hi - lo, t)
        else:
            for q in range(lo, hi):
                _panel[WD](mode, t, x, base.unsafe_offset(q * step))
        _ = Atomic[Int64].fetch_add(done, Int64(hi - lo))
    while Int(Atomic[Int64].load(done)) < panels:
        pass


def _run[WD: DType](mode: String, phase_kib: Int, total_kib: Int, workers: Int, phases: Int) raises -> Float64:
    var panel_bytes = K * PANEL * size_of[WD]()
    var per_phase = max(1, phase_kib * 1024 // panel_bytes)
    var slices = max(1, total_kib // phase_kib)
    var m = List[Scalar[WD]](length=slices * per_phase * K * PANEL, fill=Scalar[WD](0.01))
    var base = Pointer[Scalar[WD], MutUntrackedOrigin](unsafe_from_address=Int(m.unsafe_ptr()))
    var xs = List[Float32](length=K, fill=0.5)
    var x = F32P(unsafe_from_address=Int(xs.unsafe_ptr()))
    var out = List[Float32](length=workers * PANEL, fill=0)
    var tp = F32P(unsafe_from_address=Int(out.unsafe_ptr()))
    var counts = List[Int64](length=phases * STRIDE, fill=0)
    var cp = I64P(unsafe_from_address=Int(counts.unsafe_ptr()))
    var best: Float64 = 1.0e30
    for _ in range(3):
        for i in range(len(counts)):
            counts[i] = 0
        var t0 = perf_counter_ns()

        def work(w: Int) {
            var mode, var base, var per_phase, var slices, var workers, var phases, var cp, var tp, var x
        }:
            for ph in range(phases):
                var slice = base.unsafe_offset((ph % slices) * per_phase * K * PANEL)
                _phase[WD](mode, slice, per_phase, w, workers, cp.unsafe_offset(ph * STRIDE),
                           tp.unsafe_offset(w * PANEL), x)

        sync_parallelize(work, workers)
        best = min(best, Float64(perf_counter_ns() - t0) / 1.0e9)
    _ = m^
    _ = xs^
    _ = out^
    _ = counts^
    return best


def main() raises:
    var args = argv()
    if len(args) != 7:
        raise Error("usage: product_read_rate MODE DTYPE PHASE_KIB TOTAL_KIB WORKERS PHASES")
    var mode = String(args[1])
    var dtype = String(args[2])
    var phase_kib = Int(args[3])
    var total_kib = Int(args[4])
    var workers = Int(args[5])
    var phases = Int(args[6])
    if mode != "stream" and mode != "tile" and mode != "per_unit" and mode != "claimed" and mode != "widen_each":
        raise Error("unknown mode: " + mode)
    if mode == "widen_each" and dtype != "bfloat16":
        raise Error("widen_each reads bfloat16 panels")
    var seconds: Float64
    var size: Int
    if dtype == "float32":
        seconds = _run[DType.float32](mode, phase_kib, total_kib, workers, phases)
        size = 4
    elif dtype == "bfloat16":
        seconds = _run[BF16](mode, phase_kib, total_kib, workers, phases)
        size = 2
    else:
        raise Error("unknown dtype: " + dtype)
    var per_phase = max(1, phase_kib * 1024 // (K * PANEL * size))
    var total = Float64(phases * per_phase * K * PANEL * size)
    print("mode", mode, "dtype", dtype, "phase_kib", phase_kib, "total_kib", total_kib, "workers", workers,
          "bytes", Int(total), "best_s", seconds, "gbps", total / seconds / 1.0e9)
