"""The PHA prefill's GSS state carried across chunks on the CPU: one sequential pass
over the chunks, linear in the prompt.

    pha_gss_scan(ends [B, M, H, 2N] f32, a_chunk [2N] f32, ct [H, 2N] f32, chunks [B] int64)
        -> carried [B, M, H, 2N] f32, entering_last [B, H, 2N] f32

Every [.., 2N] row holds N complex numbers as real parts, then imaginary parts. The
prompt is cut into M chunks of C tokens (C is the caller's: the op sees only chunks);
ends[b, m, h] is chunk m's own final state (its inputs alone, zero state before it),
a_chunk = A**C per mode (a float64 table rounded once), ct[h] = Ct's row of channel h.
With P_0 = 0 and P_{m+1} = A**C P_m + ends[b, m] (complex, per channel h and mode n),
P_m is the state entering chunk m, and for m < chunks[b]:

    carried[b, m, h]    = Ct[h] P_m        (per mode: the product the graph turns into
                                            chunk m's carried-in share of y)
    entering_last[b, h] = P_{chunks[b] - 1}  (the graph adds the last chunk's own tokens)

carried is zero for the chunks past a prompt (m >= chunks[b]), entering_last zero for an
empty one. This replaces the graph's [M, M] decay matrix per mode (O(M**2 H N) work) by
O(M H N). The state is carried in float64, so the only rounding that compounds over the
chunks is a_chunk's own float32 rounding (relative 2**-24 per chunk crossed).

Work: a unit is (sample, channel h), walking its chunks in order with its N complex
states in a float64 row of its own; the workers (one per core) claim units from an
atomic counter. Rows of ends and carried are read and written whole (contiguous 2N).
The tensors must be contiguous and row-major.
"""
from std.atomic import Atomic
from std.sys import num_physical_cores, simd_width_of
from max.algorithm import sync_parallelize

from extensibility import InputTensor, OutputTensor, register
from max.gpu.host import DeviceContext

comptime F32 = DType.float32
comptime F64 = DType.float64
comptime V = simd_width_of[F64]()  # modes per vector, carried in float64
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime F64P = Pointer[Float64, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
comptime MAX_WORKERS = 8


@fieldwise_init
struct Scan(ImplicitlyCopyable, Movable):
    """Sizes and addresses of one call."""

    var B: Int
    var M: Int
    var H: Int
    var N: Int
    var ends: F32P
    var a_chunk: F32P
    var ct: F32P
    var chunks: I64P
    var carried: F32P
    var last: F32P


@always_inline
def _modes[width: Int](p: F64P, n: Int, N: Int, s: F32P, a: F32P, ct: F32P, out_row: F32P, last: F32P,
                       is_last: Bool):
    """Modes n .. n + width of one chunk: carried = Ct P, (entering_last = P), then
    P = A**C P + s."""
    var p_re = p.unsafe_load[width=width](n)
    var p_im = p.unsafe_load[width=width](N + n)
    var c_re = ct.unsafe_load[width=width](n).cast[F64]()
    var c_im = ct.unsafe_load[width=width](N + n).cast[F64]()
    out_row.unsafe_store(n, (c_re * p_re - c_im * p_im).cast[F32]())
    out_row.unsafe_store(N + n, (c_re * p_im + c_im * p_re).cast[F32]())
    if is_last:
        last.unsafe_store(n, p_re.cast[F32]())
        last.unsafe_store(N + n, p_im.cast[F32]())
    var a_re = a.unsafe_load[width=width](n).cast[F64]()
    var a_im = a.unsafe_load[width=width](N + n).cast[F64]()
    p.unsafe_store(n, a_re * p_re - a_im * p_im + s.unsafe_load[width=width](n).cast[F64]())
    p.unsafe_store(N + n, a_re * p_im + a_im * p_re + s.unsafe_load[width=width](N + n).cast[F64]())


def _unit(s: Scan, u: Int, p: F64P):
    """Sample u // H, channel u % H: every chunk in order."""
    var b = u // s.H
    var h = u % s.H
    var N = s.N
    var row = 2 * N
    var stride = s.H * row  # one chunk to the next
    var chunks = Int(s.chunks[unsafe_offset=b])
    var ct = s.ct.unsafe_offset(h * row)
    var first = (b * s.M * s.H + h) * row  # chunk 0 of (b, h)
    var last = s.last.unsafe_offset((b * s.H + h) * row)
    for i in range(row):
        p[unsafe_offset=i] = 0
        last[unsafe_offset=i] = 0
    var vector_end = N - N % V
    for m in range(chunks):
        var at = first + m * stride
        var ends = s.ends.unsafe_offset(at)
        var out_row = s.carried.unsafe_offset(at)
        var is_last = m == chunks - 1
        var n = 0
        while n < vector_end:
            _modes[V](p, n, N, ends, s.a_chunk, ct, out_row, last, is_last)
            n += V
        while n < N:
            _modes[1](p, n, N, ends, s.a_chunk, ct, out_row, last, is_last)
            n += 1
    for m in range(chunks, s.M):
        var out_row = s.carried.unsafe_offset(first + m * stride)
        for i in range(row):
            out_row[unsafe_offset=i] = 0


def _worker(s: Scan, counter: I64P):
    var state = List[Float64](length=2 * s.N, fill=0)
    var p = F64P(unsafe_from_address=Int(state.unsafe_ptr()))
    var n = s.B * s.H
    while True:
        var u = Int(Atomic[Int64].fetch_add(counter, 1))
        if u >= n:
            break
        _unit(s, u, p)
    _ = state^


def _in(t: InputTensor[dtype=F32, ...]) -> F32P:
    return F32P(unsafe_from_address=Int(t.unsafe_ptr()))


def _out(t: OutputTensor[dtype=F32, ...]) -> F32P:
    return F32P(unsafe_from_address=Int(t.unsafe_ptr()))


@register("pha_gss_scan")
struct PhaGssScan:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        carried: OutputTensor[dtype=DType.float32, rank=4, ...],
        entering_last: OutputTensor[dtype=DType.float32, rank=3, ...],
        ends: InputTensor[dtype=DType.float32, rank=4, ...],
        a_chunk: InputTensor[dtype=DType.float32, rank=1, ...],
        ct: InputTensor[dtype=DType.float32, rank=2, ...],
        chunks: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pha_gss_scan: CPU only")
        var B = ends.dim_size(0)
        var M = ends.dim_size(1)
        var H = ends.dim_size(2)
        var row = ends.dim_size(3)
        if row % 2 != 0:
            raise Error("pha_gss_scan: ends' last axis (", row, ") must be 2N: real parts, then imaginary")
        if a_chunk.dim_size(0) != row:
            raise Error("pha_gss_scan: a_chunk has ", a_chunk.dim_size(0), " entries, ends' rows ", row)
        if ct.dim_size(0) != H or ct.dim_size(1) != row:
            raise Error("pha_gss_scan: ct must be [H, 2N] = [", H, ", ", row, "]")
        if chunks.dim_size(0) != B:
            raise Error("pha_gss_scan: chunks must have one entry per sample")
        for d in range(4):
            if carried.dim_size(d) != ends.dim_size(d):
                raise Error("pha_gss_scan: carried must have ends' shape [B, M, H, 2N]")
        if entering_last.dim_size(0) != B or entering_last.dim_size(1) != H or entering_last.dim_size(2) != row:
            raise Error("pha_gss_scan: entering_last must be [B, H, 2N]")
        for b in range(B):
            var n = Int(chunks[b])
            if n < 0 or n > M:
                raise Error("pha_gss_scan: chunks[", b, "] = ", n, " outside [0, ", M, "]")
        var s = Scan(B, M, H, row // 2, _in(ends), _in(a_chunk), _in(ct),
                     I64P(unsafe_from_address=Int(chunks.unsafe_ptr())), _out(carried), _out(entering_last))
        var units = B * H
        if units == 0:
            return
        var counter = List[Int64](length=8, fill=0)  # a cache line of its own
        var cp = I64P(unsafe_from_address=Int(counter.unsafe_ptr()))
        var workers = min(num_physical_cores(), MAX_WORKERS, units)

        def work(i: Int) {var s, var cp}:
            _worker(s, cp)

        sync_parallelize(work, workers)
        _ = counter^
