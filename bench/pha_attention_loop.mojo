"""The PHA decode op's attention over the cache (mojo/pha_decode_step.mojo ``_attn_unit``),
its block loop alone, against a plain read of the same bytes: how fast that loop reads
the keys and values from memory and from the cache, and a read that does nothing else.

    pha_attention_loop MODE ROWS UNITS DISTINCT WORKERS REPEATS
    -> mode MODE rows ROWS units UNITS workers WORKERS bytes B best_s S gbps G

Each unit is a (sample, KV head) slice of ROWS cached rows of 64 channels (the bench
models' head width), keys then values, for the 2 query heads of a group, in blocks of the
op's ``BLOCK`` rows with the online softmax. MODE ``loop``: the op's own loop
(``_attn_group_blocks``: both heads per row read). MODE ``per_head``: the op's loop for
head widths it does not take in groups (``_attn_head_blocks``), one head after the other
over each block.
MODE ``stream``: the same bytes summed, nothing else. The units
are claimed by WORKERS threads; the best of REPEATS passes is reported. UNITS units read
DISTINCT blocks of data (unit u reads block u mod DISTINCT): as many blocks as units, large
(far beyond the last-level cache), time the reads from memory; a few small blocks read by
many units time them from the cache, each pass long enough that starting the threads does
not count. Built by bench/pha_attention_loop.py
against ``mojo/`` (imported as the package ``ops``).
"""
from std.atomic import Atomic
from std.math import exp
from std.sys import argv
from std.time import perf_counter_ns
from max.algorithm import sync_parallelize

from ops.pha_decode_step import F32P, W, _attn_group_blocks, _attn_head_blocks, _start_sums

comptime DH = 64
comptime G = 2  # query heads per KV head (the bench models' 4 query / 2 KV heads)
comptime STREAM = 0
comptime LOOP = 1
comptime PER_HEAD = 2


def _per_head(keys: F32P, values: F32P, qs: F32P, sc: F32P, part: F32P, n: Int):
    """One unit, as the op runs head widths it does not take in groups: a head at a time."""
    _start_sums(part, DH + 2, G, DH)
    _attn_head_blocks(keys, values, qs, sc, part, DH + 2, 0, n, DH, G)


def _grouped(keys: F32P, values: F32P, qs: F32P, sc: F32P, part: F32P, n: Int):
    """One unit, as the op runs it: the group's heads together."""
    _start_sums(part, DH + 2, G, DH)
    _attn_group_blocks[G](keys, values, qs, sc, part, DH + 2, 0, n, DH)


def _stream(keys: F32P, values: F32P, part: F32P, n: Int):
    """The same bytes read and summed, nothing else."""
    var a = SIMD[DType.float32, W](0)
    var b = SIMD[DType.float32, W](0)
    for i in range(0, n * DH, W):
        a += keys.unsafe_load[width=W](i)
        b += values.unsafe_load[width=W](i)
    part[unsafe_offset=0] = (a + b).reduce_add()


def _pass(mode: Int, data: F32P, units: Int, distinct: Int, n: Int, workers: Int, scratch: F32P) -> Float64:
    """Every unit once, claimed by ``workers`` threads; -> seconds."""
    var claimed = List[Int64](length=8, fill=0)
    var counter = Pointer[Int64, MutUntrackedOrigin](unsafe_from_address=Int(claimed.unsafe_ptr()))
    var t0 = perf_counter_ns()

    def work(w: Int) {var data, var counter, var scratch, var units, var distinct, var n, var mode}:
        var ws = scratch.unsafe_offset(w * 1024)  # queries, a block's weights, the sums
        while True:
            var u = Int(Atomic[Int64].fetch_add(counter, 1))
            if u >= units:
                break
            var keys = data.unsafe_offset((u % distinct) * 2 * n * DH)
            if mode == STREAM:
                _stream(keys, keys.unsafe_offset(n * DH), ws.unsafe_offset(512), n)
            elif mode == LOOP:
                _grouped(keys, keys.unsafe_offset(n * DH), ws, ws.unsafe_offset(G * DH), ws.unsafe_offset(512), n)
            else:
                _per_head(keys, keys.unsafe_offset(n * DH), ws, ws.unsafe_offset(G * DH), ws.unsafe_offset(512), n)

    sync_parallelize(work, workers)
    var seconds = Float64(perf_counter_ns() - t0) / 1e9
    _ = claimed^
    return seconds


def _difference(data: F32P, n: Int) -> Float32:
    """The largest difference between the op's loop and the per-head loop over one unit
    (queries of varied values; the two add the same terms in the same order: 0)."""
    var ws = List[Float32](length=2048, fill=0)
    var a = F32P(unsafe_from_address=Int(ws.unsafe_ptr()))
    var b = a.unsafe_offset(1024)
    for i in range(G * DH):
        a[unsafe_offset=i] = Float32((i * 37) % 101) * 0.05 - 2.5
        b[unsafe_offset=i] = a[unsafe_offset=i]
    _grouped(data, data.unsafe_offset(n * DH), a, a.unsafe_offset(G * DH), a.unsafe_offset(512), n)
    _per_head(data, data.unsafe_offset(n * DH), b, b.unsafe_offset(G * DH), b.unsafe_offset(512), n)
    var worst = Float32(0)
    for i in range(G * (DH + 2)):
        worst = max(worst, abs(a[unsafe_offset=512 + i] - b[unsafe_offset=512 + i]))
    _ = ws^
    return worst


def main() raises:
    var args = argv()
    if len(args) < 7:
        raise Error("usage: pha_attention_loop stream|loop|per_head|check ROWS UNITS DISTINCT WORKERS REPEATS")
    var name = String(args[1])
    if name != "stream" and name != "loop" and name != "per_head" and name != "check":
        raise Error("MODE must be stream, loop, per_head or check")
    var mode = STREAM if name == "stream" else (LOOP if name == "loop" else PER_HEAD)
    var n = Int(args[2])
    var units = Int(args[3])
    var distinct = Int(args[4])
    var workers = Int(args[5])
    var repeats = Int(args[6])
    if n % 4 != 0 or distinct < 1 or distinct > units:
        raise Error("ROWS must be a multiple of 4, and DISTINCT from 1 to UNITS")
    var total = distinct * 2 * n * DH
    var data = List[Float32](length=total, fill=0)
    for i in range(total):
        data[i] = Float32((i * 7919) % 1000) * 0.001 - 0.5
    var scratch = List[Float32](length=workers * 1024, fill=0.01)
    var dp = F32P(unsafe_from_address=Int(data.unsafe_ptr()))
    var sp = F32P(unsafe_from_address=Int(scratch.unsafe_ptr()))
    if name == "check":
        print("check rows", n, "max_difference", _difference(dp, n))
        _ = data^
        _ = scratch^
        return
    var best = Float64(1e30)
    for _ in range(repeats):
        best = min(best, _pass(mode, dp, units, distinct, n, workers, sp))
    var bytes = units * 2 * n * DH * 4
    print("mode", name, "rows", n, "units", units, "workers", workers, "bytes", bytes,
          "best_s", best, "gbps", Float64(bytes) / best / 1e9)
    _ = data^
    _ = scratch^
