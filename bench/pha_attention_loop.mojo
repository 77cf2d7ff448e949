"""The PHA decode op's attention over the cache (mojo/pha_decode_step.mojo ``_attn_unit``),
its block loop alone, against a plain read of the same bytes: how fast that loop reads
the keys and values from memory and from the cache, and a read that does nothing else.

    pha_attention_loop MODE ROWS UNITS DISTINCT WORKERS REPEATS
    -> mode MODE rows ROWS units UNITS workers WORKERS bytes B best_s S gbps G

MODE ``loop``: each unit is a (sample, KV head) slice of ROWS cached rows of 64 channels
(the bench models' head width), keys then values, read by the op's own block functions
(``_dots4``, ``_max_of``, ``_exp_shifted``, ``_scale``, ``_weighted_rows``) for the 2 query
heads of a group, in blocks of the op's ``BLOCK`` rows with the online softmax, as
``_attn_unit`` runs them. MODE ``stream``: the same bytes summed, nothing else. The units
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

from ops.pha_decode_step import BLOCK, F32P, NEG, W, _dots4, _exp_shifted, _max_of, _scale, _weighted_rows

comptime DH = 64
comptime G = 2  # query heads per KV head (the bench models' 4 query / 2 KV heads)


def _attend(keys: F32P, values: F32P, qs: F32P, sc: F32P, part: F32P, n: Int):
    """One unit: each query head's running max, sum and weighted values over n rows."""
    for g in range(G):
        var o = part.unsafe_offset(g * (DH + 2))
        o[unsafe_offset=0] = NEG
        o[unsafe_offset=1] = 0
        for i in range(DH):
            o[unsafe_offset=2 + i] = 0
    var j = 0
    while j < n:
        var nb = min(BLOCK, n - j)  # n is a multiple of 4 here: no single-row tail
        for g in range(G):
            var o = part.unsafe_offset(g * (DH + 2))
            var s = sc.unsafe_offset(g * BLOCK)
            for i in range(0, nb, 4):
                _dots4(qs.unsafe_offset(g * DH), keys.unsafe_offset((j + i) * DH), DH, s.unsafe_offset(i))
            var m_new = max(o[unsafe_offset=0], _max_of(s, nb))
            var corr = exp(o[unsafe_offset=0] - m_new)
            var total = _exp_shifted(s, nb, m_new)
            o[unsafe_offset=0] = m_new
            o[unsafe_offset=1] = o[unsafe_offset=1] * corr + total
            if corr != 1:
                _scale(corr, o.unsafe_offset(2), DH)
            _weighted_rows(o.unsafe_offset(2), values.unsafe_offset(j * DH), s, nb, DH)
        j += nb


def _stream(keys: F32P, values: F32P, part: F32P, n: Int):
    """The same bytes read and summed, nothing else."""
    var a = SIMD[DType.float32, W](0)
    var b = SIMD[DType.float32, W](0)
    for i in range(0, n * DH, W):
        a += keys.unsafe_load[width=W](i)
        b += values.unsafe_load[width=W](i)
    part[unsafe_offset=0] = (a + b).reduce_add()


def _pass(stream: Bool, data: F32P, units: Int, distinct: Int, n: Int, workers: Int, scratch: F32P) -> Float64:
    """Every unit once, claimed by ``workers`` threads; -> seconds."""
    var claimed = List[Int64](length=8, fill=0)
    var counter = Pointer[Int64, MutUntrackedOrigin](unsafe_from_address=Int(claimed.unsafe_ptr()))
    var t0 = perf_counter_ns()

    def work(w: Int) {var data, var counter, var scratch, var units, var distinct, var n, var stream}:
        var ws = scratch.unsafe_offset(w * 1024)  # queries, a block's weights, the sums
        while True:
            var u = Int(Atomic[Int64].fetch_add(counter, 1))
            if u >= units:
                break
            var keys = data.unsafe_offset((u % distinct) * 2 * n * DH)
            if stream:
                _stream(keys, keys.unsafe_offset(n * DH), ws.unsafe_offset(512), n)
            else:
                _attend(keys, keys.unsafe_offset(n * DH), ws, ws.unsafe_offset(G * DH), ws.unsafe_offset(512), n)

    sync_parallelize(work, workers)
    var seconds = Float64(perf_counter_ns() - t0) / 1e9
    _ = claimed^
    return seconds


def main() raises:
    var args = argv()
    if len(args) < 7:
        raise Error("usage: pha_attention_loop loop|stream ROWS UNITS DISTINCT WORKERS REPEATS")
    var stream = String(args[1]) == "stream"
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
    var best = Float64(1e30)
    for _ in range(repeats):
        best = min(best, _pass(stream, dp, units, distinct, n, workers, sp))
    var bytes = units * 2 * n * DH * 4
    print("mode", "stream" if stream else "loop", "rows", n, "units", units, "workers", workers, "bytes", bytes,
          "best_s", best, "gbps", Float64(bytes) / best / 1e9)
    _ = data^
    _ = scratch^
