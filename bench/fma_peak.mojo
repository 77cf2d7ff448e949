"""The CPU's float32 FMA peak, measured: every core runs independent chains of vector FMAs
on registers only (no memory traffic), so the figure is what the cores' FMA units give
at the clock they run at now.

    fma_peak [SECONDS_PER_ROUND] [ROUNDS]
    -> workers W simd_width S best_flops F total_flop N

Built and run by bench/fma_peak.py, which divides total_flop by the CPU time the run took
(on a shared machine the wall-clock figure, best_flops, counts the other jobs' time too). Each worker runs CHAINS independent accumulators (at
least the FMA latency times the FMA units: 4 cycles x 2 units on Zen and Skylake-X),
each a SIMD vector of the host's width; a round is timed as a whole (fork to join), the
best of the rounds is printed: 2 FLOPs per lane per FMA.
"""
from std.memory import stack_allocation
from std.sys import argv, num_physical_cores, simd_width_of
from std.time import perf_counter_ns

from max.algorithm import sync_parallelize

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime CHAINS = 12
comptime INNER = 1000  # FMAs per chain between checks of the clock


@no_inline
def _spin(iterations: Int, seed: Float32) -> Float32:
    """CHAINS x iterations x INNER vector FMAs; returns a value that depends on all of them,
    so the compiler cannot drop any."""
    # a fixed-size stack array indexed by constants after unrolling: kept in registers
    var acc = stack_allocation[CHAINS * W, Float32]()
    comptime for c in range(CHAINS):
        acc.unsafe_store(c * W, SIMD[F32, W](seed + Float32(c)))
    var a = SIMD[F32, W](0.999999)
    var b = SIMD[F32, W](1e-7)
    for _ in range(iterations):
        for _ in range(INNER):
            comptime for c in range(CHAINS):
                acc.unsafe_store(c * W, acc.unsafe_load[width=W](c * W).fma(a, b))
    var s = SIMD[F32, W](0)
    comptime for c in range(CHAINS):
        s += acc.unsafe_load[width=W](c * W)
    return s.reduce_add()


def main() raises:
    var args = argv()
    var seconds = Float64(0.3)
    var rounds = 5
    if len(args) > 1:
        seconds = Float64(atof(args[1]))
    if len(args) > 2:
        rounds = atol(args[2])
    var workers = num_physical_cores()
    # calibrate on one core: iterations for about ``seconds``
    var t = perf_counter_ns()
    var sink = _spin(10, 1.0)
    var per_iteration = Float64(perf_counter_ns() - t) / 10.0
    var iterations = max(1, Int(seconds * 1e9 / per_iteration))
    var best = Float64(0)
    var total = Float64(0)
    for _ in range(rounds):
        var sums = List[Float32](length=workers, fill=0)
        var out = Pointer[Float32, MutUntrackedOrigin](unsafe_from_address=Int(sums.unsafe_ptr()))

        def work(i: Int) {var out, var iterations}:
            out[unsafe_offset=i] = _spin(iterations, Float32(i + 1))

        t = perf_counter_ns()
        sync_parallelize(work, workers)
        var elapsed = Float64(perf_counter_ns() - t) * 1e-9
        for i in range(workers):
            sink += sums[i]
        var flop = 2.0 * Float64(W) * Float64(CHAINS) * Float64(INNER) * Float64(iterations) * Float64(workers)
        total += flop
        best = max(best, flop / elapsed)
    total += 2.0 * Float64(W) * Float64(CHAINS) * Float64(INNER) * 10.0  # the calibration
    print("workers", workers, "simd_width", W, "best_flops", best, "total_flop", total, "sink", sink)
