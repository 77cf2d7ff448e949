"""The PHA prefill's GSS scan on the CPU: the DSS output of every token of right-padded
prompts in chunks, and each sample's state after its last token, in one op.

    pha_gss_scan(xs [B, M, C, H] f32, taps [H, C] f32, long_taps [LT, H] f32, d [H] f32,
                 p_end [C, 2N] f32, p_out_t [2N, C] f32, p_step [S, 2N] f32, ct [H, 2N] f32,
                 lengths [B] int64)
        -> y [B, M, C, H] f32, state [B, 2, H, N] f32

The tables are the graph's load-time GSS tables (graphs/pha/gss.py ``gss_tables``, float64
rounded once): taps[h, k] = K[k, h], the in-chunk kernel Re(sum_n Ct A**k), and long_taps[k]
= K[k] for every lag k < LT; p_end[i] =
A**(C-1-i) and p_out_t[:, j] = (Re, -Im) of A**(j+1) per mode (real parts, then imaginary
parts); p_step[k] = A**k (S > C); ct[h] = Ct's row of channel h. xs[b, m, i, h] is the
DSS input x of token m C + i. Per sample, channel h and mode n, with P_0 = 0:

    S_m      = sum_i A**(C-1-i) x[mC + i]         chunk m's own final state (p_end)
    P_{m+1}  = A**C P_m + S_m                     the state entering each chunk (float64)
    y[mC + j] = sum_{i <= j} K[j - i] x[mC + i]   inside the chunk
              + Re(sum_n Ct A**(j+1) P_m)         the state carried in (p_out)
              + D x[mC + j]

for the chunks holding the prompt (k = ceil(lengths[b] / C) of them); past them y is zero
(padding: no caller reads those rows). Where the padded prompts fit the long taps (M C <=
LT) and are no longer than WHOLE_ROWS_PER_MODE N tokens (or one chunk), the first two lines
are one sum over the whole prompt instead, y[t] = sum_{k <= t} K[k] x[t - k] + D x[t], T / 2
multiply-adds per token and channel on average against the carried share's 2N, and the
chunks are walked for the state alone. state[b, :, h] is the state
after the prompt's last token, at offset j of chunk k - 1:

    A**(j+1) P_{k-1} + sum_{i <= j} A**(j-i) x[(k-1)C + i]   (p_step's row j + 1; p_end's
                                                             last j + 1 rows)

(real parts, then imaginary parts: [B, 2 H N] is the engine's layout), zero for an empty
prompt. O(T C H + T H N) work and O(M H N) for the scan, where the plain graph spends
O(M**2 H N) on an [M, M] decay matrix per mode (graphs/pha/gss.py ``carried_by_matmuls``,
the op's reference). The state is carried in float64, so the only rounding that compounds
is that of A**C to float32.

Work: a unit is (sample, MR channels), walking its chunks in order, or, for the whole-prompt
sum, LONG_UNIT rows of one sample's outputs with every channel (register tiles of LR rows by
a vector of channels); the workers (one per core) claim units from an atomic counter, the
chunk walks first. Per chunk a unit copies its channels' inputs
into rows of its own ([MR, C]), multiplies them by p_end (the register-tiled product of
mojo/tiled_product.mojo), carries its channels' float64 states, multiplies Ct P by p_out_t
(skipped in chunk 0, where P is zero) and adds the Toeplitz sum along each row, a vector
of tokens at a time; in the prompt's last chunk the same product by p_end's last rows
gives the state after its last token. p_end is copied into panels of NB columns once per
call; p_out_t's panels are read where they lie (C floats a row), only a last one narrower
than NB copied, zero padded. The tensors must be contiguous and row-major.
"""
from std.atomic import Atomic
from std.memory import stack_allocation
from std.sys import num_physical_cores, simd_width_of

from extensibility import InputTensor, OutputTensor, register
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from .tiled_product import MR, NB, W, tile_product

comptime F32 = DType.float32
comptime F64 = DType.float64
comptime V = simd_width_of[F64]()  # modes per vector, carried in float64
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime F64P = Pointer[Float64, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
comptime MAX_WORKERS = 8
# The whole-prompt sum: rows of outputs per register tile (accumulators, the R + 1 input rows
# two lags share and two tap vectors stay in registers: 19 of AVX-512's 32, 11 of AVX2's 16)
# and rows per work unit.
comptime LR = 8 if W == 16 else 4
comptime LONG_UNIT = 32
# The longest padded prompt summed whole, in tokens per mode N (at least one chunk): the
# whole sum's work grows as T**2 and the chunk walk's as T, and where they meet depends on
# the tiles: at 4N with AVX-512's 8-row tiles, below it with AVX2's 4-row ones, where a
# prompt of 4N walks faster (docs/pha_engine.md).
comptime WHOLE_ROWS_PER_MODE = 4 if W == 16 else 2


@fieldwise_init
struct Scan(ImplicitlyCopyable, Movable):
    """Sizes and addresses of one call; ``end_panels``: p_end in panels of NB columns,
    zero padded; ``out_tail``: the last panel of p_out_t zero padded to NB columns,
    where it is narrower."""

    var B: Int
    var M: Int
    var C: Int
    var H: Int
    var N: Int
    var xs: F32P
    var d: F32P
    var a_chunk: F32P
    var steps: F32P  # p_step: A**k in row k
    var lengths: I64P
    var end_panels: F32P  # [PE, C, NB]
    var p_out_t: F32P
    var out_tail: F32P  # [2N, NB]
    var ct: F32P
    var taps: F32P
    var long_taps: F32P  # [LT, H]: K[k, h] for every lag of a whole prompt
    var whole: Bool  # the outputs by one Toeplitz sum over each whole prompt (see the module docs)
    var y: F32P
    var state: F32P

    def ends_width(self) -> Int:
        return (2 * self.N + NB - 1) // NB * NB

    def out_width(self) -> Int:
        return (self.C + NB - 1) // NB * NB


@always_inline
def _modes[width: Int](p: F64P, n: Int, N: Int, s: F32P, a: F32P, ct: F32P, q: F32P, keep: F64P,
                       is_last: Bool):
    """Modes n .. n + width of one channel in one chunk: q = Ct P, (keep = P in the last
    chunk), then P = A**C P + s."""
    var p_re = p.unsafe_load[width=width](n)
    var p_im = p.unsafe_load[width=width](N + n)
    var c_re = ct.unsafe_load[width=width](n).cast[F64]()
    var c_im = ct.unsafe_load[width=width](N + n).cast[F64]()
    q.unsafe_store(n, (c_re * p_re - c_im * p_im).cast[F32]())
    q.unsafe_store(N + n, (c_re * p_im + c_im * p_re).cast[F32]())
    if is_last:
        keep.unsafe_store(n, p_re)
        keep.unsafe_store(N + n, p_im)
    var a_re = a.unsafe_load[width=width](n).cast[F64]()
    var a_im = a.unsafe_load[width=width](N + n).cast[F64]()
    p.unsafe_store(n, a_re * p_re - a_im * p_im + s.unsafe_load[width=width](n).cast[F64]())
    p.unsafe_store(N + n, a_re * p_im + a_im * p_re + s.unsafe_load[width=width](N + n).cast[F64]())


@always_inline
def _modes_after[width: Int](keep: F64P, n: Int, N: Int, a: F32P, local: F32P, re_out: F32P, im_out: F32P):
    """Modes n .. n + width of the state after the prompt's last token, offset j of its
    chunk: A**(j+1) P + local (a = A**(j+1), local = sum_{i <= j} A**(j-i) x_i)."""
    var k_re = keep.unsafe_load[width=width](n)
    var k_im = keep.unsafe_load[width=width](N + n)
    var a_re = a.unsafe_load[width=width](n).cast[F64]()
    var a_im = a.unsafe_load[width=width](N + n).cast[F64]()
    re_out.unsafe_store(n, (a_re * k_re - a_im * k_im + local.unsafe_load[width=width](n).cast[F64]()).cast[F32]())
    im_out.unsafe_store(n, (a_re * k_im + a_im * k_re + local.unsafe_load[width=width](N + n).cast[F64]()).cast[F32]())


def _carry(s: Scan, p: F64P, ends: F32P, ct: F32P, q: F32P, keep: F64P, is_last: Bool):
    """One channel's N modes through one chunk (``_modes``), in vectors, then single modes."""
    var N = s.N
    var vector_end = N - N % V
    var n = 0
    while n < vector_end:
        _modes[V](p, n, N, ends, s.a_chunk, ct, q, keep, is_last)
        n += V
    while n < N:
        _modes[1](p, n, N, ends, s.a_chunk, ct, q, keep, is_last)
        n += 1


def _state_after(s: Scan, keep: F64P, a: F32P, local: F32P, re_out: F32P, im_out: F32P):
    """One channel's state after its prompt's last token (``_modes_after``)."""
    var N = s.N
    var vector_end = N - N % V
    var n = 0
    while n < vector_end:
        _modes_after[V](keep, n, N, a, local, re_out, im_out)
        n += V
    while n < N:
        _modes_after[1](keep, n, N, a, local, re_out, im_out)
        n += 1


def _toeplitz(row: F32P, x: F32P, taps: F32P, carried: F32P, d: Float32, C: Int, carried_in: Bool):
    """row[j] = carried[j] (if carried_in) + (K[0] + D) x[j] + sum_{0 < k <= j} K[k] x[j - k]:
    for each lag k, a vector of tokens j at a time."""
    var t0 = SIMD[F32, W](taps[unsafe_offset=0] + d)
    var j = 0
    while j + W <= C:
        var v = t0 * x.unsafe_load[width=W](j)
        if carried_in:
            v += carried.unsafe_load[width=W](j)
        row.unsafe_store(j, v)
        j += W
    while j < C:
        row[unsafe_offset=j] = (taps[unsafe_offset=0] + d) * x[unsafe_offset=j] + (
            carried[unsafe_offset=j] if carried_in else 0)
        j += 1
    for k in range(1, C):
        var tk = taps[unsafe_offset=k]
        var tv = SIMD[F32, W](tk)
        j = k
        while j + W <= C:
            row.unsafe_store(j, tv.fma(x.unsafe_load[width=W](j - k), row.unsafe_load[width=W](j)))
            j += W
        while j < C:
            row[unsafe_offset=j] += tk * x[unsafe_offset=j - k]
            j += 1


@fieldwise_init
struct Rows(ImplicitlyCopyable, Movable):
    """A worker's rows, reused unit after unit."""

    var xt: F32P  # [MR, C]: the unit's channels' inputs in one chunk, zero past H
    var ends: F32P  # [MR, ends_width]: their chunk's own final states
    var q: F32P  # [MR, 2N]: Ct P, zero past H
    var carried: F32P  # [MR, out_width]: the carried-in share of y
    var row: F32P  # [C]: one channel's outputs in one chunk
    var p: F64P  # [MR, 2N]: the states entering the chunk
    var keep: F64P  # [MR, 2N]: the states entering the prompt's last chunk


def _unit(s: Scan, u: Int, r: Rows):
    """Sample b, channels h0 .. h0 + MR (those below H): every chunk in order."""
    var tiles = (s.H + MR - 1) // MR
    var b = u // tiles
    var h0 = (u % tiles) * MR
    var rows = min(MR, s.H - h0)
    var C = s.C
    var H = s.H
    var N = s.N
    var two_n = 2 * N
    var ew = s.ends_width()
    var ow = s.out_width()
    var length = Int(s.lengths[unsafe_offset=b])
    var chunks = (length + C - 1) // C
    var pe = (two_n + NB - 1) // NB
    # P_0 = 0 (keep is written in the prompt's last chunk before it is read)
    var i = 0
    while i + V <= rows * two_n:
        r.p.unsafe_store(i, SIMD[F64, V](0))
        i += V
    while i < rows * two_n:
        r.p[unsafe_offset=i] = 0
        i += 1
    for m in range(s.M):
        if m >= chunks:  # past the prompt: nothing to carry; zero outputs, no caller reads them
            if not s.whole:
                for j in range(C):
                    for g in range(rows):
                        s.y[unsafe_offset=((b * s.M + m) * C + j) * H + h0 + g] = 0
            continue
        var chunk = s.xs.unsafe_offset((b * s.M + m) * C * H)
        for i in range(C):
            for g in range(rows):
                r.xt[unsafe_offset=g * C + i] = chunk[unsafe_offset=i * H + h0 + g]
        var is_last = m == chunks - 1
        for panel in range(pe):
            tile_product(r.ends.unsafe_offset(panel * NB), ew, r.xt, C, s.end_panels.unsafe_offset(panel * C * NB), C)
        for g in range(rows):
            _carry(s, r.p.unsafe_offset(g * two_n), r.ends.unsafe_offset(g * ew), s.ct.unsafe_offset((h0 + g) * two_n),
                   r.q.unsafe_offset(g * two_n), r.keep.unsafe_offset(g * two_n), is_last)
        # the carried share of the outputs (nothing is carried into chunk 0; the whole-prompt
        # sum holds it)
        var po = (C + NB - 1) // NB if m > 0 and not s.whole else 0
        for panel in range(po):
            var whole = (panel + 1) * NB <= C
            var src = s.p_out_t.unsafe_offset(panel * NB) if whole else s.out_tail
            tile_product(r.carried.unsafe_offset(panel * NB), ow, r.q, two_n, src, two_n, C if whole else NB)
        if is_last:
            # the state after the last token, offset j: A**(j+1) P_m + the chunk's inputs
            # up to j times p_end's last j + 1 rows (A**(j-i)), the same product as S_m's
            var j = length - 1 - m * C
            for panel in range(pe):
                tile_product(r.ends.unsafe_offset(panel * NB), ew, r.xt, C,
                             s.end_panels.unsafe_offset((panel * C + C - 1 - j) * NB), j + 1)
            for g in range(rows):
                var re_out = s.state.unsafe_offset((b * 2 * H + h0 + g) * N)
                _state_after(s, r.keep.unsafe_offset(g * two_n), s.steps.unsafe_offset((j + 1) * two_n),
                             r.ends.unsafe_offset(g * ew), re_out, re_out.unsafe_offset(H * N))
        if s.whole:
            continue
        for g in range(rows):
            var h = h0 + g
            _toeplitz(r.row, r.xt.unsafe_offset(g * C), s.taps.unsafe_offset(h * C), r.carried.unsafe_offset(g * ow),
                      s.d[unsafe_offset=h], C, m > 0)
            for j in range(C):
                s.y[unsafe_offset=((b * s.M + m) * C + j) * H + h] = r.row[unsafe_offset=j]
    if chunks == 0:
        for g in range(rows):
            var re_out = s.state.unsafe_offset((b * 2 * H + h0 + g) * N)
            for n in range(N):
                re_out[unsafe_offset=n] = 0
                re_out[unsafe_offset=H * N + n] = 0


@always_inline
def _long_rows[R: Int, WV: Int](s: Scan, x: F32P, y: F32P, j0: Int, h: Int):
    """y[j, h .. h + WV) = sum_{k <= j} K[k] x[j - k] + D x[j] for the R rows j = j0 + r of
    one sample (x, y: its first row; rows H floats apart). Lags are taken two at a time:
    the R + 1 input rows j0 - k - 1 + i serve row r at lag k (i = r + 1) and at lag k + 1
    (i = r), so each loaded vector feeds two FMAs."""
    var H = s.H
    var taps = s.long_taps
    var acc = stack_allocation[R * WV, Float32]()
    var xv = stack_allocation[(R + 1) * WV, Float32]()
    var dv = s.d.unsafe_load[width=WV](h)
    comptime for r in range(R):
        acc.unsafe_store(r * WV, dv * x.unsafe_load[width=WV]((j0 + r) * H + h))
    var k = 0
    while k + 1 <= j0:  # lags every row has
        var t0 = taps.unsafe_load[width=WV](k * H + h)
        var t1 = taps.unsafe_load[width=WV]((k + 1) * H + h)
        comptime for i in range(R + 1):
            xv.unsafe_store(i * WV, x.unsafe_load[width=WV]((j0 - k - 1 + i) * H + h))
        comptime for r in range(R):
            var a = t0.fma(xv.unsafe_load[width=WV]((r + 1) * WV), acc.unsafe_load[width=WV](r * WV))
            acc.unsafe_store(r * WV, t1.fma(xv.unsafe_load[width=WV](r * WV), a))
        k += 2
    if k <= j0:
        var t0 = taps.unsafe_load[width=WV](k * H + h)
        comptime for r in range(R):
            acc.unsafe_store(r * WV, t0.fma(x.unsafe_load[width=WV]((j0 + r - k) * H + h),
                                            acc.unsafe_load[width=WV](r * WV)))
    comptime for q in range(1, R):  # lag j0 + q reaches rows r >= q only
        var t = taps.unsafe_load[width=WV]((j0 + q) * H + h)
        comptime for r in range(q, R):
            acc.unsafe_store(r * WV, t.fma(x.unsafe_load[width=WV]((r - q) * H + h), acc.unsafe_load[width=WV](r * WV)))
    comptime for r in range(R):
        y.unsafe_store((j0 + r) * H + h, acc.unsafe_load[width=WV](r * WV))


@always_inline
def _long_block[R: Int](s: Scan, x: F32P, y: F32P, j0: Int):
    """``_long_rows`` over every channel: whole vectors, then single channels."""
    var h = 0
    while h + W <= s.H:
        _long_rows[R, W](s, x, y, j0, h)
        h += W
    while h < s.H:
        _long_rows[R, 1](s, x, y, j0, h)
        h += 1


def _long_unit(s: Scan, u: Int):
    """The outputs of LONG_UNIT rows of one sample, every channel, by the whole-prompt sum
    (zeros past the prompt's chunks, as ``_unit`` leaves them). A sample's units are taken
    last rows first: they are the dearest, so the cheap ones fill the workers' ends."""
    var T = s.M * s.C
    var per = (T + LONG_UNIT - 1) // LONG_UNIT
    var b = u // per
    var first = (per - 1 - u % per) * LONG_UNIT
    var end = min(first + LONG_UNIT, T)
    var length = Int(s.lengths[unsafe_offset=b])
    var live = min(end, (length + s.C - 1) // s.C * s.C)
    var x = s.xs.unsafe_offset(b * T * s.H)
    var y = s.y.unsafe_offset(b * T * s.H)
    var j = first
    while j + LR <= live:
        _long_block[LR](s, x, y, j)
        j += LR
    while j < live:
        _long_block[1](s, x, y, j)
        j += 1
    for i in range(j * s.H, end * s.H):
        y[unsafe_offset=i] = 0


def _worker(s: Scan, counter: I64P):
    var C = s.C
    var two_n = 2 * s.N
    var f32_store = List[Float32](length=MR * (C + s.ends_width() + two_n + s.out_width()) + C, fill=0)
    var f64_store = List[Float64](length=2 * MR * two_n, fill=0)
    var f = F32P(unsafe_from_address=Int(f32_store.unsafe_ptr()))
    var p = F64P(unsafe_from_address=Int(f64_store.unsafe_ptr()))
    var xt = f
    var ends = xt.unsafe_offset(MR * C)
    var q = ends.unsafe_offset(MR * s.ends_width())
    var carried = q.unsafe_offset(MR * two_n)
    var row = carried.unsafe_offset(MR * s.out_width())
    var rows = Rows(xt, ends, q, carried, row, p, p.unsafe_offset(MR * two_n))
    var chunk_units = s.B * ((s.H + MR - 1) // MR)
    var units = chunk_units + (s.B * ((s.M * s.C + LONG_UNIT - 1) // LONG_UNIT) if s.whole else 0)
    while True:
        var u = Int(Atomic[Int64].fetch_add(counter, 1))
        if u >= units:
            break
        if u < chunk_units:
            _unit(s, u, rows)
        else:
            _long_unit(s, u - chunk_units)
    _ = f32_store^
    _ = f64_store^


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
        y: OutputTensor[dtype=DType.float32, rank=4, ...],
        state: OutputTensor[dtype=DType.float32, rank=4, ...],
        xs: InputTensor[dtype=DType.float32, rank=4, ...],
        taps: InputTensor[dtype=DType.float32, rank=2, ...],
        long_taps: InputTensor[dtype=DType.float32, rank=2, ...],
        d: InputTensor[dtype=DType.float32, rank=1, ...],
        p_end: InputTensor[dtype=DType.float32, rank=2, ...],
        p_out_t: InputTensor[dtype=DType.float32, rank=2, ...],
        p_step: InputTensor[dtype=DType.float32, rank=2, ...],
        ct: InputTensor[dtype=DType.float32, rank=2, ...],
        lengths: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pha_gss_scan: CPU only")
        var B = xs.dim_size(0)
        var M = xs.dim_size(1)
        var C = xs.dim_size(2)
        var H = xs.dim_size(3)
        var row = p_end.dim_size(1)
        var N = row // 2
        if C == 0:
            raise Error("pha_gss_scan: xs must be [B, M, C, H] with chunks of C > 0 tokens")
        if row % 2 != 0:
            raise Error("pha_gss_scan: p_end's last axis (", row, ") must be 2N: real parts, then imaginary")
        if taps.dim_size(0) != H or taps.dim_size(1) != C:
            raise Error("pha_gss_scan: taps must be [H, C] = [", H, ", ", C, "]")
        if long_taps.dim_size(1) != H:
            raise Error("pha_gss_scan: long_taps must be [LT, H] with H = ", H)
        if d.dim_size(0) != H:
            raise Error("pha_gss_scan: d has ", d.dim_size(0), " entries for ", H, " channels")
        if p_end.dim_size(0) != C:
            raise Error("pha_gss_scan: p_end must be [C, 2N] = [", C, ", ", row, "]")
        if p_out_t.dim_size(0) != row or p_out_t.dim_size(1) != C:
            raise Error("pha_gss_scan: p_out_t must be [2N, C] = [", row, ", ", C, "]")
        if p_step.dim_size(0) <= C or p_step.dim_size(1) != row:
            raise Error("pha_gss_scan: p_step must be [S, 2N] with S > C = ", C, " (A**k for k <= C)")
        if ct.dim_size(0) != H or ct.dim_size(1) != row:
            raise Error("pha_gss_scan: ct must be [H, 2N] = [", H, ", ", row, "]")
        if lengths.dim_size(0) != B:
            raise Error("pha_gss_scan: lengths must have one entry per sample")
        for a in range(4):
            if y.dim_size(a) != xs.dim_size(a):
                raise Error("pha_gss_scan: y must have xs' shape [B, M, C, H]")
        if state.dim_size(0) != B or state.dim_size(1) != 2 or state.dim_size(2) != H or state.dim_size(3) != N:
            raise Error("pha_gss_scan: state must be [B, 2, H, N]")
        for b in range(B):
            var n = Int(lengths[b])
            if n < 0 or n > M * C:
                raise Error("pha_gss_scan: lengths[", b, "] = ", n, " outside [0, ", M * C, "]")
        if B * H == 0:
            return

        # p_end in panels (its rows are 2N floats apart: a panel read in place would step
        # through memory a whole row per k); p_out_t's last panel if narrower than NB
        var pe = (row + NB - 1) // NB
        var out_cols = C % NB
        var end_store = List[Float32](length=max(1, pe * C * NB), fill=0)
        var out_store = List[Float32](length=row * NB if out_cols else 1, fill=0)
        var end_panels = F32P(unsafe_from_address=Int(end_store.unsafe_ptr()))
        var out_tail = F32P(unsafe_from_address=Int(out_store.unsafe_ptr()))
        var pe_in = _in(p_end)
        var po_in = _in(p_out_t)
        for panel in range(pe):
            var cols = min(NB, row - panel * NB)
            for i in range(C):
                var src = pe_in.unsafe_offset(i * row + panel * NB)
                var dst = end_panels.unsafe_offset((panel * C + i) * NB)
                if cols == NB:
                    comptime for v in range(NB // W):
                        dst.unsafe_store(v * W, src.unsafe_load[width=W](v * W))
                else:
                    for j in range(cols):
                        dst[unsafe_offset=j] = src[unsafe_offset=j]
        for k in range(row if out_cols else 0):
            for j in range(out_cols):
                out_tail[unsafe_offset=k * NB + j] = po_in[unsafe_offset=k * C + C - out_cols + j]
        var steps = _in(p_step)
        var s = Scan(B, M, C, H, N, _in(xs), _in(d), steps.unsafe_offset(C * row), steps,
                     I64P(unsafe_from_address=Int(lengths.unsafe_ptr())), end_panels, po_in, out_tail, _in(ct),
                     _in(taps), _in(long_taps), M * C <= min(long_taps.dim_size(0), max(C, WHOLE_ROWS_PER_MODE * N)),
                     _out(y), _out(state))
        var counter = List[Int64](length=8, fill=0)  # a cache line of its own
        var cp = I64P(unsafe_from_address=Int(counter.unsafe_ptr()))
        var workers = min(num_physical_cores(), MAX_WORKERS, B * ((H + MR - 1) // MR))

        def work(i: Int) {var s, var cp}:
            _worker(s, cp)

        sync_parallelize(work, workers)
        _ = counter^
        _ = end_store^
        _ = out_store^
