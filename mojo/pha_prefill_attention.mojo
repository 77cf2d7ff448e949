"""The PHA prefill's causal GQA attention on the CPU, in tiles with an online softmax:
no [T, T] score matrix; besides its inputs and output, each worker holds a few tiles.

    pha_prefill_attention(q [B, R, Hq, dh] f32, k [B, T, Hkv, dh] f32,
                          v [B, T, Hkv, dh] f32, lengths [B] int64, at [B, R] int64)
        -> attended [B, R, Hq, dh] f32

Query row r of sample b is the query at position t = at[b, r] (0 <= t < T); query head h
reads KV head g = h // (Hq / Hkv). For t < lengths[b]:

    attended[b, r, h] = sum_{j <= t} softmax_j(q[b, r, h] . k[b, j, g]) v[b, j, g]

A prefill's blocks ask for every position (at[b] = 0 .. T-1, R = T); its last block only
for the rows the graph reads (the last token's, the scored ones: graphs/pha/prefill.py),
in any order. q already carries the logit scale (mojo/pha_qk_rope.mojo prepares it), so
the logits are plain dot products. Rows at t >= lengths[b] (a right-padded prompt's
padding) are zeros: causal attention never lets them reach a row before them. The
tensors must be contiguous and row-major (the graph's reshapes of its products are).

Work: a unit is (sample, query head, block of QB query rows); the workers claim units
from an atomic counter, the latest blocks first so that the last units claimed are short
(with every position asked for, the latest rows attend the most keys). A unit packs its
queries transposed (Qt [dh, QB]) and walks the keys 0 .. its latest query in tiles of KB
rows:

    S  [KB, QB] = K_tile Qt                  keys down, queries across
    m, l        the running max and sum per query, over the tiles so far
    Ot [dh, QB] = Ot exp(m_old - m) + V_tile^T exp(S - m)

so both products broadcast one element of K or V (read in place, rows of dh) against
vectors of queries, and the softmax's max, exponentials and sums run a vector of
queries at a time. Only tiles past a block's earliest query are masked (keys after each
query): with every position asked for, the tile on the diagonal.
At the end attended = Ot^T / l. Register tiles of MR rows by NVT vectors of queries;
QB = KB = NVT * W * 2 follows the SIMD width W (32 queries with AVX2, 64 with AVX-512).
"""
from std.memory import stack_allocation
from std.math import exp
from std.atomic import Atomic
from std.sys import num_physical_cores, simd_width_of
from max.algorithm import sync_parallelize

from extensibility import InputTensor, OutputTensor, register
from max.gpu.host import DeviceContext

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]

comptime MR = 6  # rows of a register tile: 6 x 2 accumulators fit AVX2's 16 registers
comptime NVT = 2  # vectors of queries per register tile
comptime QB = 2 * NVT * W  # queries per unit
comptime KB = QB  # keys per tile: the diagonal tile is the query block's own positions
comptime NEG: Float32 = -1.0e30  # below every logit: exp(NEG - max) is 0
comptime MAX_WORKERS = 8


@fieldwise_init
struct Attn(ImplicitlyCopyable, Movable):
    """Sizes and addresses of one call."""

    var B: Int
    var R: Int  # query rows per sample
    var T: Int  # keys per sample
    var Hq: Int
    var Hkv: Int
    var dh: Int
    var q: F32P
    var k: F32P
    var v: F32P
    var o: F32P
    var lengths: I64P
    var at: I64P  # [B, R]: each query row's position


@always_inline
def _tile[R: Int, accumulate: Bool](dst: F32P, ldd: Int, x: F32P, xr: Int, xk: Int, p: F32P, ps: Int, K: Int):
    """dst[r, :NVT W] (+)= sum_k x[r xr + k xk] p[k ps :+ NVT W] for R rows: the
    accumulators in registers (a stack array with constant indices after unrolling)."""
    var acc = stack_allocation[R * NVT * W, Float32]()
    var pv = stack_allocation[NVT * W, Float32]()
    comptime for r in range(R):
        comptime for c in range(NVT):
            comptime if accumulate:
                acc.unsafe_store((r * NVT + c) * W, dst.unsafe_load[width=W](r * ldd + c * W))
            else:
                acc.unsafe_store((r * NVT + c) * W, SIMD[F32, W](0))
    for k in range(K):
        var pk = p.unsafe_offset(k * ps)
        var xk_ = x.unsafe_offset(k * xk)
        comptime for c in range(NVT):
            pv.unsafe_store(c * W, pk.unsafe_load[width=W](c * W))
        comptime for r in range(R):
            var xb = SIMD[F32, W](xk_[unsafe_offset=r * xr])
            comptime for c in range(NVT):
                comptime a = (r * NVT + c) * W
                acc.unsafe_store(a, xb.fma(pv.unsafe_load[width=W](c * W), acc.unsafe_load[width=W](a)))
    comptime for r in range(R):
        comptime for c in range(NVT):
            dst.unsafe_store(r * ldd + c * W, acc.unsafe_load[width=W]((r * NVT + c) * W))


def _product[accumulate: Bool](dst: F32P, x: F32P, xr: Int, xk: Int, p: F32P, K: Int, rows: Int):
    """dst[r, :QB] (+)= sum_k x[r xr + k xk] p[k, :QB] for ``rows`` rows (dst and p
    rows QB apart): register tiles of MR rows, the last one shorter."""
    var r0 = 0
    while r0 < rows:
        var rr = min(MR, rows - r0)
        comptime for R in range(1, MR + 1):
            if rr == R:
                var c0 = 0
                while c0 < QB:
                    _tile[R, accumulate](dst.unsafe_offset(r0 * QB + c0), QB, x.unsafe_offset(r0 * xr), xr, xk,
                                         p.unsafe_offset(c0), QB, K)
                    c0 += NVT * W
        r0 += rr


def _mask_after(s: F32P, kb: Int, key0: Int, pos: I64P):
    """Keys after a query get NEG in the tile S [kb, QB] (key key0 + j, query i at position
    pos[i]). A column without a query (pos -1) is left as it is: its output row is written
    as zeros, its scores never read."""
    for i in range(QB):
        var p = Int(pos[unsafe_offset=i])
        if p < 0:
            continue
        var first_masked = max(p + 1 - key0, 0)  # keys j >= this are after it
        for j in range(first_masked, kb):
            s[unsafe_offset=j * QB + i] = NEG


def _softmax_tile(s: F32P, kb: Int, ot: F32P, dh: Int, m: F32P, l: F32P):
    """The online softmax over one key tile, a vector of queries at a time: S becomes
    exp(S - m_new); m, l and the output so far Ot [dh, QB] are rescaled to m_new."""
    for g in range(QB // W):
        var at = g * W
        var m_old = m.unsafe_load[width=W](at)
        var m_new = m_old
        for j in range(kb):
            m_new = max(m_new, s.unsafe_load[width=W](j * QB + at))
        var total = SIMD[F32, W](0)
        for j in range(kb):
            var e = exp(s.unsafe_load[width=W](j * QB + at) - m_new)
            s.unsafe_store(j * QB + at, e)
            total += e
        var alpha = exp(m_old - m_new)
        l.unsafe_store(at, l.unsafe_load[width=W](at) * alpha + total)
        m.unsafe_store(at, m_new)
        for c in range(dh):
            ot.unsafe_store(c * QB + at, ot.unsafe_load[width=W](c * QB + at) * alpha)


def _units(a: Attn) -> Int:
    return a.B * a.Hq * ((a.R + QB - 1) // QB)


def _unit(a: Attn, u: Int, qt: F32P, s: F32P, ot: F32P, m: F32P, l: F32P, pos: I64P):
    """One (sample, query head, block of query rows): the latest blocks first. ``pos``
    [QB]: each column's query position, -1 where the column has no query (past R, or a
    row at the prompt's padding, whose output is zeros)."""
    var blocks = (a.R + QB - 1) // QB
    var heads = a.B * a.Hq
    var r0 = (blocks - 1 - u // heads) * QB
    var b = (u % heads) // a.Hq
    var h = u % a.Hq
    var dh = a.dh
    var rows_here = min(QB, a.R - r0)
    var length = Int(a.lengths[unsafe_offset=b])
    var end = 0  # keys 0 .. end - 1: up to the block's latest query
    var earliest = a.T  # the keys after the earliest query need the mask
    for i in range(QB):
        var t = Int(a.at[unsafe_offset=b * a.R + r0 + i]) if i < rows_here else -1
        t = t if t < length else -1
        pos[unsafe_offset=i] = Int64(t)
        if t >= 0:
            end = max(end, t + 1)
            earliest = min(earliest, t)
    var g = h // (a.Hq // a.Hkv)
    var ldq = a.Hq * dh
    var ldkv = a.Hkv * dh
    # Qt [dh, QB]: the block's queries across, zeros where a column has none
    for i in range(QB):
        if Int(pos[unsafe_offset=i]) >= 0:
            var qrow = a.q.unsafe_offset((b * a.R + r0 + i) * ldq + h * dh)
            for c in range(dh):
                qt[unsafe_offset=c * QB + i] = qrow[unsafe_offset=c]
        else:
            for c in range(dh):
                qt[unsafe_offset=c * QB + i] = 0
    for c in range(dh * QB):
        ot[unsafe_offset=c] = 0
    for i in range(QB):
        m[unsafe_offset=i] = NEG
        l[unsafe_offset=i] = 0
    var keys = a.k.unsafe_offset(b * a.T * ldkv + g * dh)
    var values = a.v.unsafe_offset(b * a.T * ldkv + g * dh)
    var j0 = 0
    while j0 < end:
        var kb = min(KB, end - j0)
        _product[False](s, keys.unsafe_offset(j0 * ldkv), ldkv, 1, qt, dh, kb)  # S = K Qt
        if j0 + kb > earliest + 1:
            _mask_after(s, kb, j0, pos)
        _softmax_tile(s, kb, ot, dh, m, l)
        _product[True](ot, values.unsafe_offset(j0 * ldkv), 1, ldkv, s, kb, dh)  # Ot += V^T S
        j0 += kb
    for i in range(rows_here):
        var row = a.o.unsafe_offset(((b * a.R + r0 + i) * a.Hq + h) * dh)
        if Int(pos[unsafe_offset=i]) < 0:
            for c in range(dh):
                row[unsafe_offset=c] = 0
            continue
        var inv = 1 / l[unsafe_offset=i]
        for c in range(dh):
            row[unsafe_offset=c] = ot[unsafe_offset=c * QB + i] * inv


def _worker(a: Attn, counter: I64P):
    var scratch = List[Float32](length=(2 * a.dh + KB + 2) * QB, fill=0)
    var qt = F32P(unsafe_from_address=Int(scratch.unsafe_ptr()))
    var ot = qt.unsafe_offset(a.dh * QB)
    var s = ot.unsafe_offset(a.dh * QB)
    var m = s.unsafe_offset(KB * QB)
    var l = m.unsafe_offset(QB)
    var positions = List[Int64](length=QB, fill=-1)
    var pos = I64P(unsafe_from_address=Int(positions.unsafe_ptr()))
    var n = _units(a)
    while True:
        var u = Int(Atomic[Int64].fetch_add(counter, 1))
        if u >= n:
            break
        _unit(a, u, qt, s, ot, m, l, pos)
    _ = scratch^
    _ = positions^


def _ptr(t: InputTensor[dtype=F32, ...]) -> F32P:
    return F32P(unsafe_from_address=Int(t.unsafe_ptr()))


@register("pha_prefill_attention")
struct PhaPrefillAttention:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        attended: OutputTensor[dtype=DType.float32, rank=4, ...],
        q: InputTensor[dtype=DType.float32, rank=4, ...],
        k: InputTensor[dtype=DType.float32, rank=4, ...],
        v: InputTensor[dtype=DType.float32, rank=4, ...],
        lengths: InputTensor[dtype=DType.int64, rank=1, ...],
        at: InputTensor[dtype=DType.int64, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pha_prefill_attention: CPU only")
        var B = q.dim_size(0)
        var R = q.dim_size(1)
        var Hq = q.dim_size(2)
        var dh = q.dim_size(3)
        var T = k.dim_size(1)
        var Hkv = k.dim_size(2)
        for d in range(4):
            if attended.dim_size(d) != q.dim_size(d):
                raise Error("pha_prefill_attention: the output must have q's shape [B, R, Hq, dh]")
            if v.dim_size(d) != k.dim_size(d):
                raise Error("pha_prefill_attention: k and v must have the same shape [B, T, Hkv, dh]")
        if k.dim_size(0) != B or k.dim_size(3) != dh:
            raise Error("pha_prefill_attention: k must be [B, T, Hkv, dh] with q's B and dh")
        if at.dim_size(0) != B or at.dim_size(1) != R:
            raise Error("pha_prefill_attention: at must be [B, R], a position per query row: [",
                        at.dim_size(0), ", ", at.dim_size(1), "] for q's [", B, ", ", R, "]")
        if Hkv < 1 or Hq % Hkv != 0:
            raise Error("pha_prefill_attention: ", Hq, " query heads are not a multiple of ", Hkv, " KV heads")
        if lengths.dim_size(0) != B:
            raise Error("pha_prefill_attention: lengths must have one entry per sample")
        for b in range(B):
            var n = Int(lengths[b])
            if n < 0 or n > T:
                raise Error("pha_prefill_attention: lengths[", b, "] = ", n, " outside [0, ", T, "]")
            for r in range(R):
                var t = Int(at[b, r])
                if t < 0 or t >= T:
                    raise Error("pha_prefill_attention: at[", b, ", ", r, "] = ", t, " outside [0, ", T, ")")
        var a = Attn(B, R, T, Hq, Hkv, dh, _ptr(q), _ptr(k), _ptr(v),
                     F32P(unsafe_from_address=Int(attended.unsafe_ptr())),
                     I64P(unsafe_from_address=Int(lengths.unsafe_ptr())),
                     I64P(unsafe_from_address=Int(at.unsafe_ptr())))
        var units = _units(a)
        if units == 0:
            return
        var counter = List[Int64](length=8, fill=0)  # a cache line of its own
        var cp = I64P(unsafe_from_address=Int(counter.unsafe_ptr()))
        var workers = min(num_physical_cores(), MAX_WORKERS, units)

        def work(i: Int) {var a, var cp}:
            _worker(a, cp)

        sync_parallelize(work, workers)
        _ = counter^
