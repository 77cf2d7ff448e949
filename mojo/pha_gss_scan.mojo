"""The PHA prefill's GSS state carried across chunks on the CPU: one sequential pass
over the chunks, linear in the prompt, and each sample's state after its last token.

    pha_gss_scan(ends [B, M, H, 2N] f32, xs [B, M, C, H] f32, a_chunk [2N] f32,
                 a_step [2N] f32, ct [H, 2N] f32, lengths [B] int64)
        -> carried [B, M, H, 2N] f32, state [B, 2, H, N] f32

Every [.., 2N] row holds N complex numbers as real parts, then imaginary parts. The
prompt is cut into M chunks of C tokens; xs[b, m, i, h] is the DSS input of token
m C + i, ends[b, m, h] chunk m's own final state (its inputs alone, zero state before it),
a_chunk = A**C and a_step = A per mode (float64 tables rounded once), ct[h] = Ct's row of
channel h. With P_0 = 0 and P_{m+1} = A**C P_m + ends[b, m] (complex, per channel h and
mode n), P_m is the state entering chunk m; sample b's prompt fills its first
k = ceil(lengths[b] / C) chunks and ends at offset j = lengths[b] - 1 - (k - 1) C of its
last one. Then for m < k:

    carried[b, m, h] = Ct[h] P_m        (per mode: the product the graph turns into
                                        chunk m's carried-in share of y)
    state[b, :, h]   = s_j, from s = P_{k-1} by s = A s + xs[b, k - 1, i, h], i = 0 .. j:
                       the state after the prompt's last token (real parts, then
                       imaginary parts, so that [B, 2 H N] is the engine's layout)

carried is zero for the chunks past a prompt (m >= k), state zero for an empty one. This
replaces the graph's [M, M] decay matrix per mode (O(M**2 H N) work) by O(M H N), and the
last chunk's powers of A by a recurrence of at most C steps. The state is carried in
float64, so the only rounding that compounds is that of a_chunk and a_step to float32
(relative 2**-24 per chunk or token crossed).

Work: a unit is (sample, channel h), walking its chunks in order with its N complex
states in a float64 row of its own; the workers (one per core) claim units from an
atomic counter. Rows of ends and carried are read and written whole (contiguous 2N).
The last chunk's recurrence is a chain of dependent multiply-adds per mode, so it steps
LANES modes at once: independent chains that keep the FMA units busy while each waits
for its previous result. The tensors must be contiguous and row-major.
"""
from std.atomic import Atomic
from std.sys import num_physical_cores, simd_width_of
from max.algorithm import sync_parallelize

from extensibility import InputTensor, OutputTensor, register
from max.gpu.host import DeviceContext

comptime F32 = DType.float32
comptime F64 = DType.float64
comptime V = simd_width_of[F64]()  # modes per vector, carried in float64
# modes stepped together through the last chunk: 4 vectors where there are 32 vector
# registers (AVX-512), 2 where there are 16 (AVX2), so the chains' state stays in registers
comptime LANES = 4 * V if V >= 8 else 2 * V
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime F64P = Pointer[Float64, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
comptime MAX_WORKERS = 8


@fieldwise_init
struct Scan(ImplicitlyCopyable, Movable):
    """Sizes and addresses of one call."""

    var B: Int
    var M: Int
    var C: Int
    var H: Int
    var N: Int
    var ends: F32P
    var xs: F32P
    var a_chunk: F32P
    var a_step: F32P
    var ct: F32P
    var lengths: I64P
    var carried: F32P
    var state: F32P


@always_inline
def _modes[width: Int](p: F64P, n: Int, N: Int, s: F32P, a: F32P, ct: F32P, out_row: F32P, keep: F64P,
                       is_last: Bool):
    """Modes n .. n + width of one chunk: carried = Ct P, (keep = P in the last chunk),
    then P = A**C P + s."""
    var p_re = p.unsafe_load[width=width](n)
    var p_im = p.unsafe_load[width=width](N + n)
    var c_re = ct.unsafe_load[width=width](n).cast[F64]()
    var c_im = ct.unsafe_load[width=width](N + n).cast[F64]()
    out_row.unsafe_store(n, (c_re * p_re - c_im * p_im).cast[F32]())
    out_row.unsafe_store(N + n, (c_re * p_im + c_im * p_re).cast[F32]())
    if is_last:
        keep.unsafe_store(n, p_re)
        keep.unsafe_store(N + n, p_im)
    var a_re = a.unsafe_load[width=width](n).cast[F64]()
    var a_im = a.unsafe_load[width=width](N + n).cast[F64]()
    p.unsafe_store(n, a_re * p_re - a_im * p_im + s.unsafe_load[width=width](n).cast[F64]())
    p.unsafe_store(N + n, a_re * p_im + a_im * p_re + s.unsafe_load[width=width](N + n).cast[F64]())


@always_inline
def _last_tokens[width: Int](q: F64P, n: Int, N: Int, a: F32P, x: F32P, H: Int, tokens: Int, re_out: F32P,
                             im_out: F32P):
    """Modes n .. n + width of the state after the prompt's last token: s = A s + x_i
    over the last chunk's ``tokens`` inputs x_i = x[i H] (real), from s = q, in registers."""
    var s_re = q.unsafe_load[width=width](n)
    var s_im = q.unsafe_load[width=width](N + n)
    var a_re = a.unsafe_load[width=width](n).cast[F64]()
    var a_im = a.unsafe_load[width=width](N + n).cast[F64]()
    for i in range(tokens):
        var xi = SIMD[F64, width](x[unsafe_offset=i * H].cast[F64]())
        var re = a_re * s_re - a_im * s_im + xi
        s_im = a_re * s_im + a_im * s_re
        s_re = re
    re_out.unsafe_store(n, s_re.cast[F32]())
    im_out.unsafe_store(n, s_im.cast[F32]())


def _unit(s: Scan, u: Int, p: F64P, keep: F64P):
    """Sample u // H, channel u % H: every chunk in order, then its last tokens."""
    var b = u // s.H
    var h = u % s.H
    var N = s.N
    var row = 2 * N
    var stride = s.H * row  # one chunk to the next
    var length = Int(s.lengths[unsafe_offset=b])
    var chunks = (length + s.C - 1) // s.C
    var ct = s.ct.unsafe_offset(h * row)
    var first = (b * s.M * s.H + h) * row  # chunk 0 of (b, h)
    for i in range(row):
        p[unsafe_offset=i] = 0
        keep[unsafe_offset=i] = 0
    var vector_end = N - N % V
    for m in range(chunks):
        var at = first + m * stride
        var ends = s.ends.unsafe_offset(at)
        var out_row = s.carried.unsafe_offset(at)
        var is_last = m == chunks - 1
        var n = 0
        while n < vector_end:
            _modes[V](p, n, N, ends, s.a_chunk, ct, out_row, keep, is_last)
            n += V
        while n < N:
            _modes[1](p, n, N, ends, s.a_chunk, ct, out_row, keep, is_last)
            n += 1
    for m in range(chunks, s.M):
        var out_row = s.carried.unsafe_offset(first + m * stride)
        for i in range(row):
            out_row[unsafe_offset=i] = 0
    # the state after the last token: keep (P entering the last chunk) through its tokens
    var tokens = length - (chunks - 1) * s.C if chunks > 0 else 0
    var x = s.xs.unsafe_offset(((b * s.M + max(chunks - 1, 0)) * s.C) * s.H + h)
    var re_out = s.state.unsafe_offset((b * 2 * s.H + h) * N)
    var im_out = re_out.unsafe_offset(s.H * N)
    var n = 0
    while n + LANES <= N:
        _last_tokens[LANES](keep, n, N, s.a_step, x, s.H, tokens, re_out, im_out)
        n += LANES
    while n < vector_end:
        _last_tokens[V](keep, n, N, s.a_step, x, s.H, tokens, re_out, im_out)
        n += V
    while n < N:
        _last_tokens[1](keep, n, N, s.a_step, x, s.H, tokens, re_out, im_out)
        n += 1


def _worker(s: Scan, counter: I64P):
    var rows = List[Float64](length=4 * s.N, fill=0)  # P, then P entering the last chunk
    var p = F64P(unsafe_from_address=Int(rows.unsafe_ptr()))
    var n = s.B * s.H
    while True:
        var u = Int(Atomic[Int64].fetch_add(counter, 1))
        if u >= n:
            break
        _unit(s, u, p, p.unsafe_offset(2 * s.N))
    _ = rows^


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
        state: OutputTensor[dtype=DType.float32, rank=4, ...],
        ends: InputTensor[dtype=DType.float32, rank=4, ...],
        xs: InputTensor[dtype=DType.float32, rank=4, ...],
        a_chunk: InputTensor[dtype=DType.float32, rank=1, ...],
        a_step: InputTensor[dtype=DType.float32, rank=1, ...],
        ct: InputTensor[dtype=DType.float32, rank=2, ...],
        lengths: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pha_gss_scan: CPU only")
        var B = ends.dim_size(0)
        var M = ends.dim_size(1)
        var H = ends.dim_size(2)
        var row = ends.dim_size(3)
        var C = xs.dim_size(2)
        if row % 2 != 0:
            raise Error("pha_gss_scan: ends' last axis (", row, ") must be 2N: real parts, then imaginary")
        if xs.dim_size(0) != B or xs.dim_size(1) != M or xs.dim_size(3) != H or C == 0:
            raise Error("pha_gss_scan: xs must be [B, M, C, H] = [", B, ", ", M, ", C, ", H, "] with C > 0")
        if a_chunk.dim_size(0) != row or a_step.dim_size(0) != row:
            raise Error("pha_gss_scan: a_chunk and a_step have ", a_chunk.dim_size(0), " and ", a_step.dim_size(0),
                        " entries, ends' rows ", row)
        if ct.dim_size(0) != H or ct.dim_size(1) != row:
            raise Error("pha_gss_scan: ct must be [H, 2N] = [", H, ", ", row, "]")
        if lengths.dim_size(0) != B:
            raise Error("pha_gss_scan: lengths must have one entry per sample")
        for d in range(4):
            if carried.dim_size(d) != ends.dim_size(d):
                raise Error("pha_gss_scan: carried must have ends' shape [B, M, H, 2N]")
        if state.dim_size(0) != B or state.dim_size(1) != 2 or state.dim_size(2) != H or 2 * state.dim_size(3) != row:
            raise Error("pha_gss_scan: state must be [B, 2, H, N]")
        for b in range(B):
            var n = Int(lengths[b])
            if n < 0 or n > M * C:
                raise Error("pha_gss_scan: lengths[", b, "] = ", n, " outside [0, ", M * C, "]")
        var s = Scan(B, M, C, H, row // 2, _in(ends), _in(xs), _in(a_chunk), _in(a_step), _in(ct),
                     I64P(unsafe_from_address=Int(lengths.unsafe_ptr())), _out(carried), _out(state))
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
