"""The PHA prefill's GSS scan on the CPU: the DSS output of every token of right-padded
prompts in chunks, and each sample's state after its last token, in one op.

    pha_gss_scan(xs [B, M, C, H] f32, kin [H, C, C] f32, d [H] f32, p_end [C, 2N] f32,
                 p_out [C, 2N] f32, p_step [S, 2N] f32, ct_t_re [N, H] f32,
                 ct_t_im [N, H] f32, lengths [B] int64)
        -> y [B, M, C, H] f32, state [B, 2, H, N] f32

The tables are the graph's load-time GSS tables (graphs/pha/gss.py ``gss_tables``, float64
rounded once): kin[h, k, 0] = K[k, h], the in-chunk kernel Re(sum_n Ct A**k); p_end[i] =
A**(C-1-i) and p_out[j] = (Re, -Im) of A**(j+1) per mode (real parts, then imaginary
parts); p_step[k] = A**k (S > C); ct_t_re, ct_t_im = Ct transposed. xs[b, m, i, h] is
the DSS input x of token m C + i. Per sample, channel h and mode n, with P_0 = 0:

    S_m      = sum_i A**(C-1-i) x[mC + i]         chunk m's own final state (p_end)
    P_{m+1}  = A**C P_m + S_m                     the state entering each chunk (float64)
    y[mC + j] = sum_{i <= j} K[j - i] x[mC + i]   inside the chunk
              + Re(sum_n Ct A**(j+1) P_m)         the state carried in (p_out)
              + D x[mC + j]

for the chunks holding the prompt (k = ceil(lengths[b] / C) of them); past them the
carried share is zero (padding: no caller reads those rows). state[b, :, h] is the state
after the prompt's last token, P_{k-1} stepped through the last chunk's tokens by
s = A s + x (real parts, then imaginary parts: [B, 2 H N] is the engine's layout), zero
for an empty prompt. O(T C H + T H N) work and O(M H N) for the scan, where the plain
graph spends O(M**2 H N) on an [M, M] decay matrix per mode (graphs/pha/gss.py
``carried_by_matmuls``, the op's reference). The state is carried in float64, so the
only rounding that compounds is that of A**C and A to float32.

Work: a unit is (sample, MR channels), walking its chunks in order; the workers (one per
core) claim units from an atomic counter. Per chunk a unit copies its channels' inputs
into rows of its own ([MR, C]), multiplies them by p_end (the register-tiled product of
mojo/tiled_product.mojo; p_end is packed into panels once per call), carries its
channels' float64 states, multiplies Ct P by p_out (packed likewise) and adds the
Toeplitz sum along each row, a vector of tokens at a time. The tensors must be
contiguous and row-major.
"""
from std.atomic import Atomic
from std.sys import num_physical_cores, simd_width_of

from extensibility import InputTensor, OutputTensor, register
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from .tiled_product import MR, NB, W, pack_panel, tile_product

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
    """Sizes and addresses of one call; ``end_panels``, ``out_panels``, ``ct`` [H, 2N] and
    ``taps`` [H, C] (K[k, h] per channel) are prepared once per call."""

    var B: Int
    var M: Int
    var C: Int
    var H: Int
    var N: Int
    var xs: F32P
    var d: F32P
    var a_chunk: F32P
    var a_step: F32P
    var lengths: I64P
    var end_panels: F32P  # [PE, C, NB]: p_end's columns, NB a panel, zero past 2N
    var out_panels: F32P  # [PO, 2N, NB]: p_out's rows as columns, NB a panel, zero past C
    var ct: F32P
    var taps: F32P
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
def _last_tokens[width: Int](q: F64P, n: Int, N: Int, a: F32P, x: F32P, tokens: Int, re_out: F32P, im_out: F32P):
    """Modes n .. n + width of the state after the prompt's last token: s = A s + x_i
    over the last chunk's ``tokens`` inputs x_i = x[i] (real), from s = q, in registers."""
    var s_re = q.unsafe_load[width=width](n)
    var s_im = q.unsafe_load[width=width](N + n)
    var a_re = a.unsafe_load[width=width](n).cast[F64]()
    var a_im = a.unsafe_load[width=width](N + n).cast[F64]()
    for i in range(tokens):
        var xi = SIMD[F64, width](x[unsafe_offset=i].cast[F64]())
        var re = a_re * s_re - a_im * s_im + xi
        s_im = a_re * s_im + a_im * s_re
        s_re = re
    re_out.unsafe_store(n, s_re.cast[F32]())
    im_out.unsafe_store(n, s_im.cast[F32]())


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


def _state_after(s: Scan, keep: F64P, x: F32P, tokens: Int, re_out: F32P, im_out: F32P):
    """One channel's state after its prompt's last token (``_last_tokens``)."""
    var N = s.N
    var vector_end = N - N % V
    var n = 0
    while n + LANES <= N:
        _last_tokens[LANES](keep, n, N, s.a_step, x, tokens, re_out, im_out)
        n += LANES
    while n < vector_end:
        _last_tokens[V](keep, n, N, s.a_step, x, tokens, re_out, im_out)
        n += V
    while n < N:
        _last_tokens[1](keep, n, N, s.a_step, x, tokens, re_out, im_out)
        n += 1


def _toeplitz(row: F32P, x: F32P, taps: F32P, carried: F32P, d: Float32, C: Int, live: Bool):
    """row[j] = carried[j] (if live) + (K[0] + D) x[j] + sum_{0 < k <= j} K[k] x[j - k]:
    for each lag k, a vector of tokens j at a time."""
    var t0 = SIMD[F32, W](taps[unsafe_offset=0] + d)
    var j = 0
    while j + W <= C:
        var v = t0 * x.unsafe_load[width=W](j)
        if live:
            v += carried.unsafe_load[width=W](j)
        row.unsafe_store(j, v)
        j += W
    while j < C:
        row[unsafe_offset=j] = (taps[unsafe_offset=0] + d) * x[unsafe_offset=j] + (
            carried[unsafe_offset=j] if live else 0)
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
    for i in range(MR * two_n):
        r.p[unsafe_offset=i] = 0
        r.keep[unsafe_offset=i] = 0
    for m in range(s.M):
        var chunk = s.xs.unsafe_offset((b * s.M + m) * C * H)
        for i in range(C):
            for g in range(rows):
                r.xt[unsafe_offset=g * C + i] = chunk[unsafe_offset=i * H + h0 + g]
        var live = m < chunks
        var is_last = m == chunks - 1
        if live:
            var pe = (two_n + NB - 1) // NB
            for panel in range(pe):
                tile_product(r.ends.unsafe_offset(panel * NB), ew, r.xt, C, s.end_panels.unsafe_offset(panel * C * NB),
                             C)
            for g in range(rows):
                _carry(s, r.p.unsafe_offset(g * two_n), r.ends.unsafe_offset(g * ew), s.ct.unsafe_offset((h0 + g) * two_n),
                       r.q.unsafe_offset(g * two_n), r.keep.unsafe_offset(g * two_n), is_last)
            var po = (C + NB - 1) // NB
            for panel in range(po):
                tile_product(r.carried.unsafe_offset(panel * NB), ow, r.q, two_n,
                             s.out_panels.unsafe_offset(panel * two_n * NB), two_n)
        for g in range(rows):
            var h = h0 + g
            _toeplitz(r.row, r.xt.unsafe_offset(g * C), s.taps.unsafe_offset(h * C), r.carried.unsafe_offset(g * ow),
                      s.d[unsafe_offset=h], C, live)
            for j in range(C):
                s.y[unsafe_offset=((b * s.M + m) * C + j) * H + h] = r.row[unsafe_offset=j]
            if is_last:
                var re_out = s.state.unsafe_offset((b * 2 * H + h) * N)
                _state_after(s, r.keep.unsafe_offset(g * two_n), r.xt.unsafe_offset(g * C), length - m * C, re_out,
                             re_out.unsafe_offset(H * N))
    if chunks == 0:
        for g in range(rows):
            var re_out = s.state.unsafe_offset((b * 2 * H + h0 + g) * N)
            for n in range(N):
                re_out[unsafe_offset=n] = 0
                re_out[unsafe_offset=H * N + n] = 0


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
    var units = s.B * ((s.H + MR - 1) // MR)
    while True:
        var u = Int(Atomic[Int64].fetch_add(counter, 1))
        if u >= units:
            break
        _unit(s, u, rows)
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
        kin: InputTensor[dtype=DType.float32, rank=3, ...],
        d: InputTensor[dtype=DType.float32, rank=1, ...],
        p_end: InputTensor[dtype=DType.float32, rank=2, ...],
        p_out: InputTensor[dtype=DType.float32, rank=2, ...],
        p_step: InputTensor[dtype=DType.float32, rank=2, ...],
        ct_t_re: InputTensor[dtype=DType.float32, rank=2, ...],
        ct_t_im: InputTensor[dtype=DType.float32, rank=2, ...],
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
        if kin.dim_size(0) != H or kin.dim_size(1) != C or kin.dim_size(2) != C:
            raise Error("pha_gss_scan: kin must be [H, C, C] = [", H, ", ", C, ", ", C, "]")
        if d.dim_size(0) != H:
            raise Error("pha_gss_scan: d has ", d.dim_size(0), " entries for ", H, " channels")
        if p_end.dim_size(0) != C or p_out.dim_size(0) != C or p_out.dim_size(1) != row:
            raise Error("pha_gss_scan: p_end and p_out must be [C, 2N] = [", C, ", ", row, "]")
        if p_step.dim_size(0) <= C or p_step.dim_size(1) != row:
            raise Error("pha_gss_scan: p_step must be [S, 2N] with S > C = ", C, " (A**k for k <= C)")
        if ct_t_re.dim_size(0) != N or ct_t_re.dim_size(1) != H or ct_t_im.dim_size(0) != N or ct_t_im.dim_size(1) != H:
            raise Error("pha_gss_scan: ct_t_re and ct_t_im must be [N, H] = [", N, ", ", H, "]")
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
        var units = B * ((H + MR - 1) // MR)
        if units == 0:
            return

        # once per call: p_end's columns and p_out's rows in panels, Ct as rows, K per channel
        var pe = (row + NB - 1) // NB
        var po = (C + NB - 1) // NB
        var end_store = List[Float32](length=max(1, pe * C * NB), fill=0)
        var out_store = List[Float32](length=max(1, po * row * NB), fill=0)
        var ct_store = List[Float32](length=max(1, H * row), fill=0)
        var tap_store = List[Float32](length=H * C, fill=0)
        var end_panels = F32P(unsafe_from_address=Int(end_store.unsafe_ptr()))
        var out_panels = F32P(unsafe_from_address=Int(out_store.unsafe_ptr()))
        var ct = F32P(unsafe_from_address=Int(ct_store.unsafe_ptr()))
        var taps = F32P(unsafe_from_address=Int(tap_store.unsafe_ptr()))
        var pe_in = _in(p_end)
        for panel in range(pe):
            for i in range(C):
                for j in range(min(NB, row - panel * NB)):
                    end_panels[unsafe_offset=(panel * C + i) * NB + j] = pe_in[unsafe_offset=i * row + panel * NB + j]
        for panel in range(po):
            pack_panel[F32](out_panels, _in(p_out), panel, C, row)
        var re_in = _in(ct_t_re)
        var im_in = _in(ct_t_im)
        for n in range(N):
            for h in range(H):
                ct[unsafe_offset=h * row + n] = re_in[unsafe_offset=n * H + h]
                ct[unsafe_offset=h * row + N + n] = im_in[unsafe_offset=n * H + h]
        var kin_in = _in(kin)
        for h in range(H):
            for k in range(C):
                taps[unsafe_offset=h * C + k] = kin_in[unsafe_offset=(h * C + k) * C]
        var steps = _in(p_step)
        var s = Scan(B, M, C, H, N, _in(xs), _in(d), steps.unsafe_offset(C * row), steps.unsafe_offset(row),
                     I64P(unsafe_from_address=Int(lengths.unsafe_ptr())), end_panels, out_panels, ct, taps, _out(y),
                     _out(state))
        var counter = List[Int64](length=8, fill=0)  # a cache line of its own
        var cp = I64P(unsafe_from_address=Int(counter.unsafe_ptr()))
        var workers = min(num_physical_cores(), MAX_WORKERS, units)

        def work(i: Int) {var s, var cp}:
            _worker(s, cp)

        sync_parallelize(work, workers)
        _ = counter^
        _ = end_store^
        _ = out_store^
        _ = ct_store^
        _ = tap_store^
