"""The register-tiled matrix product the CPU ops share (no op here: score_head.mojo,
linear.mojo and the decode ops call it).

    pack_panel(packed, m, panel, N, K)      one panel of a row-major m [N, K], transposed (float32)
    tile_product(t, ldt, x, ldx, p, K, ldp) MR rows of x times one packed panel (rows ldp apart;
                                            float32, or bfloat16 widened as it is loaded)
    load_weights(wv, wp), store_sums(...)   a tile's row of weights widened to float32, and its
                                            sums stored in column order (for tiles of any shape)

The matrix on the right, m [N, K] (one row per output column, as a checkpoint stores a
weight), is packed into panels of NB = NV * W columns, each panel [K, NB] (k-major, zero
past N), so that a register tile of MR rows x NV vectors streams one panel front to back:
per k, NV vector loads, MR broadcasts of x, MR * NV FMAs into accumulators that stay in
registers (MR x NV per SIMD width: 5 x 2 with AVX2's 16 registers, 6 x 4 with AVX-512's 32).
A panel's rows may also lie ldp floats apart inside a wider row-major matrix [K, ldp] (NB
of its columns: no packing where the matrix is stored k-major already).
"""
from std.memory import bitcast, stack_allocation
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
def _pairs[NVT: Int, WD: DType]() -> Int:
    """Vectors of a tile's row of weights widened two at a time: bfloat16 pairs of
    vectors load as one vector of 32-bit words, each the bits of two neighbouring
    columns."""
    return NVT // 2 if WD == DType.bfloat16 else 0


@always_inline
def load_weights[NVT: Int, WD: DType](wv: F32P, wp: Pointer[Scalar[WD], MutUntrackedOrigin]):
    """wv = NVT vectors of one row of a panel, widened to float32. A bfloat16 is the
    upper half of a float32's bits, so a word of two columns widens by a shift (the
    even column, in its lower half) and a mask (the odd one): two cheap instructions per
    two vectors, where widening each vector alone takes a cross-lane shuffle and a
    shift, more than a tile of one batch row has time for while its panel streams in
    from the cache (bench/product_read_rate.py). The pair's vectors hold the even and
    the odd columns of 2 W; ``store_sums`` puts their sums back in order."""
    comptime PAIRS = _pairs[NVT, WD]()
    comptime for j in range(PAIRS):
        var words = Pointer[UInt32, MutUntrackedOrigin](unsafe_from_address=Int(wp.unsafe_offset(2 * j * W)))
        var two = words.unsafe_load[width=W](0)
        wv.unsafe_store(2 * j * W, bitcast[F32, W](two << 16))
        wv.unsafe_store((2 * j + 1) * W, bitcast[F32, W](two & SIMD[DType.uint32, W](0xFFFF0000)))
    comptime for v in range(2 * PAIRS, NVT):
        wv.unsafe_store(v * W, wp.unsafe_load[width=W](v * W).cast[F32]())


@always_inline
def store_sums[R: Int, NVT: Int, WD: DType](t: F32P, ldt: Int, acc: F32P):
    """t[r, 0 .. NVT W) = the tile's sums in column order (a widened pair's even and
    odd columns interleaved)."""
    comptime PAIRS = _pairs[NVT, WD]()
    comptime for r in range(R):
        comptime for j in range(PAIRS):
            comptime a = (r * NVT + 2 * j) * W
            var even = acc.unsafe_load[width=W](a)
            t.unsafe_store(r * ldt + 2 * j * W, even.interleave(acc.unsafe_load[width=W](a + W)))
        comptime for v in range(2 * PAIRS, NVT):
            t.unsafe_store(r * ldt + v * W, acc.unsafe_load[width=W]((r * NVT + v) * W))


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
            load_weights[NV, PD](wv, p.unsafe_offset((k + kk) * ldp))
            comptime for r in range(MR):
                var xb = SIMD[F32, W](x[unsafe_offset=r * ldx + k + kk])
                comptime for v in range(NV):
                    comptime a = (r * NV + v) * W
                    acc.unsafe_store(a, xb.fma(wv.unsafe_load[width=W](v * W), acc.unsafe_load[width=W](a)))
        k += KU
    while k < K:
        load_weights[NV, PD](wv, p.unsafe_offset(k * ldp))
        comptime for r in range(MR):
            var xb = SIMD[F32, W](x[unsafe_offset=r * ldx + k])
            comptime for v in range(NV):
                comptime a = (r * NV + v) * W
                acc.unsafe_store(a, xb.fma(wv.unsafe_load[width=W](v * W), acc.unsafe_load[width=W](a)))
        k += 1
    store_sums[MR, NV, PD](t, ldt, acc)


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
