"""The PHA prefill's queries and keys made ready for attention on the CPU, in one pass
over the rows: each head scaled to unit length, rotated by its position (RoPE), the
queries times their logit scale.

    pha_qk_rope(q [B, T, Hq*dh] f32, k [B, T, Hkv*dh] f32, pos [T] int64,
                freq [dh/2] f32, scale [Hq*dh] f32) -> (q' [B, T, Hq*dh], k' [B, T, Hkv*dh])

Per head x of dh channels (halves x1, x2) at row t, with a_i = pos[t] * freq[i] (float32):

    u  = x * (1 / max(|x|, 1e-12))
    x' = (u1 cos a - u2 sin a, u1 sin a + u2 cos a)            (times scale, for q)

which is what graphs/pha/model.py ``_qkv`` computes with plain ops (the GPU path, and
this op's reference); there each step is a kernel of its own and the head sums and the
rotation's partner channels are gathers, a pass over q and k each, where this op reads
each row once and writes it once. The workers take contiguous ranges of rows; each row's
cos and sin table (dh/2 angles) serves every head of that row. The tensors must be
contiguous and row-major.
"""
from std.math import cos, sin, sqrt
from std.sys import num_physical_cores, simd_width_of
from max.algorithm import sync_parallelize

from extensibility import InputTensor, OutputTensor, register
from max.gpu.host import DeviceContext

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
comptime MAX_WORKERS = 8
# rows below which one worker does all (a decode-sized call would pay more to start workers)
comptime ROWS_PER_WORKER = 16


@fieldwise_init
struct QK(ImplicitlyCopyable, Movable):
    """Sizes and addresses of one call."""

    var rows: Int  # B * T
    var T: Int
    var Hq: Int
    var Hkv: Int
    var half: Int  # dh / 2
    var q: F32P
    var k: F32P
    var q_out: F32P
    var k_out: F32P
    var pos: I64P
    var freq: F32P
    var scale: F32P


@always_inline
def _sum_of_squares(x: F32P, n: Int) -> Float32:
    var acc = SIMD[F32, W](0)
    var i = 0
    while i + W <= n:
        var v = x.unsafe_load[width=W](i)
        acc = v.fma(v, acc)
        i += W
    var s = acc.reduce_add()
    while i < n:
        s += x[unsafe_offset=i] * x[unsafe_offset=i]
        i += 1
    return s


def _angles(a: QK, t: Int, table: F32P):
    """table = cos, then sin, of pos[t] * freq (float32, as the graph computes the angle)."""
    var p = Float32(Int(a.pos[unsafe_offset=t]))
    var i = 0
    while i + W <= a.half:
        var angle = p * a.freq.unsafe_load[width=W](i)
        table.unsafe_store(i, cos(angle))
        table.unsafe_store(a.half + i, sin(angle))
        i += W
    while i < a.half:
        var angle = p * a.freq[unsafe_offset=i]
        table[unsafe_offset=i] = cos(angle)
        table[unsafe_offset=a.half + i] = sin(angle)
        i += 1


def _head[scaled: Bool](dst: F32P, src: F32P, table: F32P, half: Int, scale: F32P):
    """dst = rope(l2norm(src)) for one head of 2 * half channels (times ``scale`` if scaled)."""
    var inv = 1 / max(sqrt(_sum_of_squares(src, 2 * half)), Float32(1e-12))
    var i = 0
    while i + W <= half:
        var c = table.unsafe_load[width=W](i)
        var s = table.unsafe_load[width=W](half + i)
        var x1 = src.unsafe_load[width=W](i) * inv
        var x2 = src.unsafe_load[width=W](half + i) * inv
        var y1 = x1 * c - x2 * s
        var y2 = x1 * s + x2 * c
        comptime if scaled:
            y1 = y1 * scale.unsafe_load[width=W](i)
            y2 = y2 * scale.unsafe_load[width=W](half + i)
        dst.unsafe_store(i, y1)
        dst.unsafe_store(half + i, y2)
        i += W
    while i < half:
        var c = table[unsafe_offset=i]
        var s = table[unsafe_offset=half + i]
        var x1 = src[unsafe_offset=i] * inv
        var x2 = src[unsafe_offset=half + i] * inv
        var y1 = x1 * c - x2 * s
        var y2 = x1 * s + x2 * c
        comptime if scaled:
            y1 = y1 * scale[unsafe_offset=i]
            y2 = y2 * scale[unsafe_offset=half + i]
        dst[unsafe_offset=i] = y1
        dst[unsafe_offset=half + i] = y2
        i += 1


def _rows(a: QK, first: Int, last: Int):
    var dh = 2 * a.half
    var scratch = List[Float32](length=dh, fill=0)
    var table = F32P(unsafe_from_address=Int(scratch.unsafe_ptr()))
    for r in range(first, last):
        _angles(a, r % a.T, table)
        var qr = r * a.Hq * dh
        for h in range(a.Hq):
            var at = qr + h * dh
            _head[True](a.q_out.unsafe_offset(at), a.q.unsafe_offset(at), table, a.half, a.scale.unsafe_offset(h * dh))
        var kr = r * a.Hkv * dh
        for h in range(a.Hkv):
            var at = kr + h * dh
            _head[False](a.k_out.unsafe_offset(at), a.k.unsafe_offset(at), table, a.half, a.scale)
    _ = scratch^


def _ptr(t: InputTensor[dtype=F32, ...]) -> F32P:
    return F32P(unsafe_from_address=Int(t.unsafe_ptr()))


@register("pha_qk_rope")
struct PhaQkRope:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        q_out: OutputTensor[dtype=DType.float32, rank=3, ...],
        k_out: OutputTensor[dtype=DType.float32, rank=3, ...],
        q: InputTensor[dtype=DType.float32, rank=3, ...],
        k: InputTensor[dtype=DType.float32, rank=3, ...],
        pos: InputTensor[dtype=DType.int64, rank=1, ...],
        freq: InputTensor[dtype=DType.float32, rank=1, ...],
        scale: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pha_qk_rope: CPU only")
        var B = q.dim_size(0)
        var T = q.dim_size(1)
        var half = freq.dim_size(0)
        var dh = 2 * half
        if half < 1:
            raise Error("pha_qk_rope: freq must hold dh / 2 >= 1 frequencies")
        if k.dim_size(0) != B or k.dim_size(1) != T:
            raise Error("pha_qk_rope: q and k must have the same B and T")
        if q.dim_size(2) % dh != 0 or k.dim_size(2) % dh != 0:
            raise Error("pha_qk_rope: q's and k's widths must be multiples of the head width ", dh,
                        " (2 x the frequencies)")
        if pos.dim_size(0) != T:
            raise Error("pha_qk_rope: pos must hold one position per token (", T, ")")
        if scale.dim_size(0) != q.dim_size(2):
            raise Error("pha_qk_rope: scale must have q's width")
        for d in range(3):
            if q_out.dim_size(d) != q.dim_size(d) or k_out.dim_size(d) != k.dim_size(d):
                raise Error("pha_qk_rope: the outputs must have q's and k's shapes")
        var a = QK(B * T, T, q.dim_size(2) // dh, k.dim_size(2) // dh, half, _ptr(q), _ptr(k),
                   F32P(unsafe_from_address=Int(q_out.unsafe_ptr())),
                   F32P(unsafe_from_address=Int(k_out.unsafe_ptr())),
                   I64P(unsafe_from_address=Int(pos.unsafe_ptr())), _ptr(freq), _ptr(scale))
        if a.rows == 0:
            return
        var workers = max(1, min(num_physical_cores(), MAX_WORKERS, a.rows // ROWS_PER_WORKER))
        var per = (a.rows + workers - 1) // workers

        def work(i: Int) {var a, var per}:
            _rows(a, i * per, min(a.rows, (i + 1) * per))

        sync_parallelize(work, workers)
