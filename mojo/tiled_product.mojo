"""The register-tiled matrix product the CPU ops share (no op here: score_head.mojo and
linear.mojo call it).

    pack_panel(packed, m, panel, N, K)      one panel of a row-major m [N, K], transposed (float32)
    tile_product(t, ldt, x, ldx, p, K, ldp) MR rows of x times one packed panel (rows ldp apart;
                                            float32, or bfloat16 widened as it is loaded)

The matrix on the right, m [N, K] (one row per output column, as a checkpoint stores a
weight), is packed into panels of NB = NV * W columns, each panel [K, NB] (k-major, zero
past N), so that a register tile of MR rows x NV vectors streams one panel front to back:
per k, NV vector loads, MR broadcasts of x, MR * NV FMAs into accumulators that stay in
registers (MR x NV per SIMD width: 5 x 2 with AVX2's 16 registers, 6 x 4 with AVX-512's 32).
A panel's rows may also lie ldp floats apart inside a wider row-major matrix [K, ldp] (NB
of its columns: no packing where the matrix is stored k-major already).
"""
from std.memory import stack_allocation
from std.sys import simd_width_of

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
# A register tile: MR rows x NV vectors of columns. MR * NV accumulators, NV weight
# vectors and one broadcast fit in the vector registers (AVX2 16: 5 x 2 uses 13, and at
# 6 x 2 the compiler keeps an accumulator on the stack; AVX-512 32: 6 x 4 uses 29).
comptime NV = 2 if W == 8 else 4
comptime MR = 5 if W == 8 else 6
comptime NB = NV * W  # columns per packed panel
comptime KU = 4  # k unrolled


@always_inline
def tile_product[PD: DType](t: F32P, ldt: Int, x: F32P, ldx: Int, p: Pointer[Scalar[PD], MutUntrackedOrigin], K: Int,
                            ldp: Int = NB):
    """t[r, 0 .. NB) = sum_k x[r, k] * p[k, 0 .. NB) for MR rows (x's rows ldx apart, t's
    ldt apart, p's ldp apart); p is one panel [K, NB], its entries widened to float32 as
    they are loaded where they are bfloat16. The accumulators are a fixed-size stack
    array indexed by constants after unrolling, which the compiler keeps in registers."""
    var acc = stack_allocation[MR * NV * W, Float32]()
    var wv = stack_allocation[NV * W, Float32]()
    comptime for a in range(MR * NV):
        acc.unsafe_store(a * W, SIMD[F32, W](0))
    var k = 0
    while k + KU <= K:
        comptime for kk in range(KU):
            var wp = p.unsafe_offset((k + kk) * ldp)
            comptime for v in range(NV):
                wv.unsafe_store(v * W, wp.unsafe_load[width=W](v * W).cast[F32]())
            comptime for r in range(MR):
                var xb = SIMD[F32, W](x[unsafe_offset=r * ldx + k + kk])
                comptime for v in range(NV):
                    comptime a = (r * NV + v) * W
                    acc.unsafe_store(a, xb.fma(wv.unsafe_load[width=W](v * W), acc.unsafe_load[width=W](a)))
        k += KU
    while k < K:
        var wp = p.unsafe_offset(k * ldp)
        comptime for r in range(MR):
            var xb = SIMD[F32, W](x[unsafe_offset=r * ldx + k])
            comptime for v in range(NV):
                comptime a = (r * NV + v) * W
                acc.unsafe_store(a, xb.fma(wp.unsafe_load[width=W](v * W).cast[F32](), acc.unsafe_load[width=W](a)))
        k += 1
    comptime for r in range(MR):
        comptime for v in range(NV):
            t.unsafe_store(r * ldt + v * W, acc.unsafe_load[width=W]((r * NV + v) * W))


def pack_panel[MD: DType](packed: F32P, m: Pointer[Scalar[MD], MutUntrackedOrigin], panel: Int, N: Int, K: Int):
    """Panel ``panel`` of m [N, K]: packed[panel][k, j] = m[panel * NB + j, k], 0 past N
    (m's entries widened to float32 if they are bfloat16). Written a row of the panel at
    a time, so the stores run along memory; the reads step through the panel's NB rows of
    m, whose cache lines stay in the first-level cache for the next k."""
    var out = packed.unsafe_offset(panel * K * NB)
    var first = panel * NB
    var cols = max(0, min(NB, N - first))
    var src = m.unsafe_offset(first * K)
    for k in range(K):
        var row = out.unsafe_offset(k * NB)
        for j in range(cols):
            row[unsafe_offset=j] = src[unsafe_offset=j * K + k].cast[F32]()
        for j in range(cols, NB):
            row[unsafe_offset=j] = 0
