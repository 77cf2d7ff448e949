"""PHA decode on the CPU as one op: S whole steps (every block, the logits and the
token choice) per call, the per-sample state [L, B, X] updated in place.

    pha_decode_steps(states [L, B, X] f32, mutable;
                     ids [B] int64, embedding [V, E], positions [B] int64,
                     mats [M] (packed matrices), vecs [P] f32, layout [L, SLOTS] int64,
                     dims [NDIMS] int64, scalars [2] f32 (eps, alpha),
                     steps [S] int64: only its length is read,
                     temperature [B] f32, top_k [B] int64, top_p [B] f32, seed [B] uint64,
                     mode [1] int64: graphs/sampler.py's MODE_*,
                     scored [1] int64: 1 to return the log-probabilities below, 0 not)
        -> tokens [B, S] int64, last [B] int64 (= tokens[:, S-1]),
           next positions [B] int64 (= positions + S),
           logprobs [B, S] f32, top_values [B, S, N] f32, top_ids [B, S, N] int64:
           with ``scored``, each chosen token's raw log-probability and the N most likely
           tokens (row_logprobs.mojo, as decode_step.mojo); else left unwritten

The math is graphs/pha/decode.py's ``step`` (the reference's ``PHA.step``), in the
parallel mode: per block, on the same input x,

    gss:   u = gelu(W_u x); xn = LN(gelu(W_v x + b_v)); s = Abar s + xn (complex, per
           channel h and mode m); y = Re(Ct . s) + D xn; out = W_o((W_g y) * u) + b_o
    attn:  q, k = rope(l2norm(W_q x)), rope(l2norm(W_k x)), q times the logit scale;
           softmax over the cached keys 0 .. pos-1 and the new one; out = W_o att
    ffn_i: W_2 gelu(W_1 x + b_1) + b_2
    x = LN(alpha x + sum_i w_i RMSNorm(out_i))   (w_i folded into the RMSNorm weights)

then logits = head x and each row's token: the first argmax in MODE_GREEDY, else
row_sampler.mojo's draw, whose random counter is the new token's position (as
decode_step.mojo's srm_decode_steps). The state of a sample is its GSS state (real
parts, then imaginary, [H, N] each), its keys and its values ([Hkv, n, dh] each);
a step writes the new GSS state and one key and one value row per KV head (row
min(pos, n - 1): a position past the context is a finished sample whose tokens the
host discards). Nothing else of the caches is written.

Work: each phase of a step (the products from x, the GSS update and the attention
over the cache, the attention's merge, the products from the branches' hidden
values, the gate's product, the block norm, the logits, the choice) is cut into
units that the workers claim from an atomic counter, as in decode_step.mojo. The
attention of a (sample, KV head) reads its cached keys and values once, in slices
of the context when there are few samples, each slice an online softmax over blocks
of rows whose partial sums the merge phase combines with the new token's column.

The products take decode_step.mojo's packed panels (srm_max/models/srm/packing.py)
and register tiles. ``layout`` holds, per block, the element offsets of each
matrix in ``mats`` and of each vector in ``vecs`` (-1: absent), in the SLOT order
below (srm_max/models/pha/packing.py writes both). The matrices and the embedding
are float32 or bfloat16 (widened in registers); with bfloat16 the op rounds where
graphs/pha/decode.py's plain graph rounds (``ops.linear``: each product's input and
its output, before the bias, go through bfloat16; decode_step.mojo's ``_rnd``): the
products from x read a rounded copy of it (``xr``; x itself, the residual, stays
float32), the GSS output y, the attention's output and the FFNs' and the gate's
hidden values are stored rounded, being only a product's input. Vectors, states,
the caches and every sum are float32.
"""
from std.memory import stack_allocation
from std.math import exp, sqrt, cos, sin
from std.atomic import Atomic
from std.time import perf_counter_ns
from std.sys import num_physical_cores, simd_width_of, size_of
from max.algorithm import sync_parallelize

from extensibility import InputTensor, OutputTensor, register
from extensibility import _MutableInputTensor as MutableInputTensor
from max.gpu.host import DeviceContext

from .row_logprobs import score_token
from .row_sampler import RowScratch, choose_token, first_argmax
from .decode_step import (
    CLAIM_SHARE, KU, MR, NV, PANEL, _claim, _fetch_line, _next_panel_lines, _prefetches_next_panel, _unit_tile,
    _tile_rows, _tile_vectors, _row_chunk, _chunks, _panels, _padded, _layer_norm, _rnd,
)

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
comptime U64P = Pointer[UInt64, MutUntrackedOrigin]

# ---- the layout's slots per block (srm_max/models/pha/packing.py SLOTS)
comptime MAX_FFN = 4
comptime M_U = 0  # to_u [F, E]
comptime M_V = 1  # to_v [H, E]
comptime M_Q = 2  # q_proj [Hq dh, E]
comptime M_K = 3  # k_proj [Hkv dh, E]
comptime M_VA = 4  # v_proj [Hkv dh, E]
comptime M_FC = 5  # ffn_i.fc [f_i, E], i < MAX_FFN
comptime M_GATE = 9  # to_gate [F, H]
comptime M_OUT = 10  # to_out [E, F]
comptime M_O = 11  # o_proj [E, Hq dh]
comptime M_PROJ = 12  # ffn_i.proj [E, f_i]
comptime V_VB = 16  # to_v bias [H]
comptime V_NW = 17  # the DSS LayerNorm [H], then its bias
comptime V_NB = 18
comptime V_D = 19  # D [H]
comptime V_OUTB = 20  # to_out bias [E]
comptime V_AR = 21  # Abar, real and imaginary [N]
comptime V_AI = 22
comptime V_CR = 23  # Ct, real and imaginary [H, N]
comptime V_CI = 24
comptime V_SCALE = 25  # the logit scale per query channel [Hq dh]
comptime V_FCB = 26  # ffn_i.fc bias [f_i]
comptime V_PROJB = 30  # ffn_i.proj bias [E]
comptime V_BN = 34  # the branch norms' weights [E] (times the mixing weight), branch order
comptime V_PW = 40  # the block's LayerNorm [E], then its bias
comptime V_PB = 41
comptime SLOTS = 42
# ---- dims
comptime D_E = 0
comptime D_L = 1
comptime D_V = 2
comptime D_F = 3
comptime D_H = 4
comptime D_N = 5
comptime D_HQ = 6
comptime D_HKV = 7
comptime D_DH = 8
comptime D_CTX = 9
comptime D_NFFN = 10
comptime D_FFN = 11  # MAX_FFN widths
comptime D_GSS = 15  # 1: the GSS branch is on
comptime D_ATTN = 16  # 1: the attention branch is on
comptime D_HEAD = 17  # the head's offset in mats
comptime D_ROPE = 18  # the RoPE inverse frequencies' offset in vecs [dh / 2]
comptime NDIMS = 19

# ---- product segments: one matrix times one input, and what its epilogue does
comptime SEGF = 11
comptime S_MAT = 0  # the packed matrix's address
comptime S_K = 1
comptime S_N = 2
comptime S_X = 3  # the input's address, rows ldx apart
comptime S_LDX = 4
comptime S_DST = 5  # the output's address, rows ldd apart
comptime S_LDD = 6
comptime S_BIAS = 7  # a bias's address, or 0
comptime S_KIND = 8
comptime S_MUL = 9  # E_MUL: the factor's address (rows ldd apart)
comptime S_ROUND = 10  # 1: the output is only a later product's input, stored rounded to the weights' dtype
comptime E_STORE = 0
comptime E_GELU = 1
comptime E_MUL = 2
comptime MAX_SEGS = 5 + MAX_FFN  # the most segments of one phase

# ---- phases: per block, then the logits and the choice
comptime P_IN = 0  # the products from x
comptime P_MID = 1  # the GSS update and the attention over the cache
comptime P_MERGE = 2  # the attention's slices merged with the new token; k, v written
comptime P_HID = 3  # gate, o_proj and the FFNs' second products
comptime P_GATE = 4  # to_out
comptime P_NORM = 5  # the block's norms and residual
comptime PER_BLOCK = 6
comptime P_HEAD = 6
comptime P_ARGMAX = 7
comptime P_DRAW = 8
comptime MODE_GREEDY = 0  # graphs/sampler.py
comptime MODE_FILTERED = 2

comptime NORM_CHUNK = 8
comptime GSS_CHANNELS = 16  # channels per unit of the GSS update
comptime ROWS_PER_SLICE = 64  # the fewest cached rows worth a slice of their own
comptime BLOCK = 32  # cached rows per block of the online softmax
comptime NEG: Float32 = -1.0e30  # below every logit (|logit| <= the logit scale's bound)
comptime MAX_WORKERS = 8
comptime STRIDE = 16
comptime STEPS_PER_FORK = 64
# bench/pha_phase_times.py turns this on in a copy of these sources: each call then
# prints how long each kind of phase took (P_IN .. P_NORM summed over the blocks, then
# the logits, then the choice), and how much of it the workers spent waiting for each
# other at its end, for where a step's time goes
comptime PHASE_TIMES = False
comptime TIMED_KINDS = PER_BLOCK + 2


@fieldwise_init
struct Pha(ImplicitlyCopyable, Movable):
    """Sizes and addresses of one call."""

    var B: Int
    var E: Int
    var L: Int
    var V: Int
    var F: Int
    var H: Int
    var N: Int
    var Hq: Int
    var Hkv: Int
    var dh: Int
    var n: Int
    var nffn: Int
    var gss: Bool
    var attn: Bool
    var nbr: Int  # branches
    var X: Int  # state width per layer and sample
    var eps: Float32
    var alpha: Float32
    var slices: Int  # context slices of the attention
    var workers: Int
    var S: Int
    var s: Int
    var states: F32P
    var lay: I64P  # [L, SLOTS]
    var vecs: F32P
    var segs: I64P  # the product segments, SEGF each
    var seg_at: I64P  # per product phase (3 per block, then the head): first segment, count
    var x: F32P  # [B, E] the residual stream
    var xr: F32P  # [B, E] x rounded to the weights' dtype, the products' input (x itself with float32)
    var u: F32P  # [B, F] gelu(W_u x), then (W_g y) * u
    var g: F32P  # [B, F]
    var vr: F32P  # [B, H] gelu(W_v x + b_v)
    var y: F32P  # [B, H]
    var q: F32P  # [B, Hq dh] raw
    var k: F32P  # [B, Hkv dh] raw
    var v: F32P  # [B, Hkv dh]
    var att: F32P  # [B, Hq dh]
    var part: F32P  # [B, Hq, slices, dh + 2]: max, sum, weighted values
    var rope: F32P  # [B, dh]: cos then sin of each frequency at the row's position
    var freq: F32P  # [dh / 2] the RoPE inverse frequencies
    var bo: F32P  # [nbr, B, E] the branches' outputs
    var logits: F32P  # [B, V]
    var emb: Int
    var pos: I64P  # the step's positions (not clamped)
    var pos_in: I64P
    var tokens: I64P
    var temperature: F32P
    var top_k: I64P
    var top_p: F32P
    var seed: U64P
    var filtered: Bool
    # the chosen tokens' raw log-probabilities (with ``scored`` only)
    var scored: Bool
    var logprobs: F32P  # [B, S]
    var top_n: Int  # alternatives per token
    var top_values: F32P  # [B, S, top_n]
    var top_ids: I64P  # [B, S, top_n]


# erf(x) = x P(x^2) / Q(x^2) for |x| < 3.9 and +-1 beyond (erf(3.9) rounds to 1 in float32);
# scripts/fit_erf.py fits the coefficients and measures the error (about 5 ulp of 1 at most)
comptime ERF_CLAMP: Float32 = 3.9
comptime ERF_P = (1.128379225730896, 0.18469013273715973, 0.054260291159152985, 0.0038298205472528934,
                  0.00037963836803101003, 4.698068551078904e-06, -1.3230639694938873e-08)
comptime ERF_Q = (1.0, 0.49701088666915894, 0.11375634372234344, 0.015423203818500042, 0.0013035339070484042,
                  6.323386332951486e-05)


@always_inline
def _erf[n: Int](v: SIMD[F32, n]) -> SIMD[F32, n]:
    """erf in one branch of fused multiply-adds and a division: the standard library's
    computes two (a polynomial, and an exp with a polynomial) and selects, on every output of
    a GELU layer's tiles."""
    var x = min(max(v, -ERF_CLAMP), ERF_CLAMP)
    var t = x * x
    var num = SIMD[F32, n](Float32(ERF_P[6]))
    comptime for i in range(5, -1, -1):
        num = num.fma(t, Float32(ERF_P[i]))
    var den = SIMD[F32, n](Float32(ERF_Q[5]))
    comptime for i in range(4, -1, -1):
        den = den.fma(t, Float32(ERF_Q[i]))
    return x * num / den


@always_inline
def _gelu[n: Int](v: SIMD[F32, n]) -> SIMD[F32, n]:
    """The exact GELU (erf), as torch's and MAX's default."""
    var half = 0.5 * v
    return half.fma(_erf[n](v * 0.7071067811865476), half)


@always_inline
def _at(a: Pha, l: Int, slot: Int) -> Int:
    return Int(a.lay[unsafe_offset=l * SLOTS + slot])


@always_inline
def _vec(a: Pha, l: Int, slot: Int) -> F32P:
    return a.vecs.unsafe_offset(_at(a, l, slot))


# ------------------------------------------------------------------ products
@always_inline
def _finish[WD: DType, n: Int](seg: I64P, r: Int, c: Int, acc: SIMD[F32, n]):
    """Columns c .. c+n of row r of a segment's product, from their sums."""
    var v = _rnd[WD](acc)  # the product's dtype, as MAX's matmul returns it
    var bias = Int(seg[unsafe_offset=S_BIAS])
    if bias != 0:
        v += F32P(unsafe_from_address=bias).unsafe_load[width=n](c)
    var o = r * Int(seg[unsafe_offset=S_LDD]) + c
    var kind = Int(seg[unsafe_offset=S_KIND])
    if kind == E_GELU:
        v = _gelu(v)
    elif kind == E_MUL:
        v *= F32P(unsafe_from_address=Int(seg[unsafe_offset=S_MUL])).unsafe_load[width=n](o)
    if seg[unsafe_offset=S_ROUND] != 0:
        v = _rnd[WD](v)
    F32P(unsafe_from_address=Int(seg[unsafe_offset=S_DST])).unsafe_store(o, v)


def _seg_units(seg: I64P, B: Int) -> Int:
    return _panels(Int(seg[unsafe_offset=S_N])) * _chunks(B)


def _product_unit[WD: DType](a: Pha, seg: I64P, u: Int, next_panel: Int, next_weights: Int):
    """One unit of a segment: a panel of output columns for a chunk of rows (as
    decode_step.mojo's ``_product_unit``). Its tiles prefetch the panel of ``next_weights``
    weights at address ``next_panel`` (where this worker's next unit reads:
    ``_run_units_starting_in``)."""
    var K = Int(seg[unsafe_offset=S_K])
    var N = Int(seg[unsafe_offset=S_N])
    var ldx = Int(seg[unsafe_offset=S_LDX])
    var x = F32P(unsafe_from_address=Int(seg[unsafe_offset=S_X]))
    var Np = _padded(N)
    var rows_per = _row_chunk(a.B)
    var chunks = _chunks(a.B)
    var q = u // chunks
    var r0 = (u % chunks) * rows_per
    var r1 = min(a.B, r0 + rows_per)
    var width = min(PANEL, Np - q * PANEL)
    var p = Pointer[Scalar[WD], MutUntrackedOrigin](unsafe_from_address=Int(seg[unsafe_offset=S_MAT])).unsafe_offset(q * PANEL * K)
    var t = stack_allocation[MR * PANEL, Float32]()
    var unit_rows = r1 - r0
    var nv_max = _tile_vectors[WD](unit_rows) if unit_rows <= MR else NV
    # with AVX2 every tile prefetches its share of the next unit's panel (decode_step.mojo's ``_product_unit``)
    comptime LINE = 64 // size_of[WD]()
    var ahead = Pointer[Scalar[WD], MutUntrackedOrigin](unsafe_from_address=next_panel)
    var next_lines = _next_panel_lines[WD](a.B, next_weights, next_panel == Int(p))
    var tiles = 0  # this unit's tiles so far
    var c0 = 0
    while c0 < width:
        var nv = min(nv_max, (width - c0) // W)
        var r = r0
        while r < r1:
            var rows = _tile_rows(r1 - r)
            var xr = x.unsafe_offset(r * ldx)
            var pc = p.unsafe_offset(c0)
            var line = _fetch_line(tiles, K)
            var fetch = line < next_lines
            _unit_tile[WD, KU](rows, nv, fetch, t, xr, ldx, pc, width, K, ahead.unsafe_offset(line * LINE), LINE)
            var cs = q * PANEL + c0
            for i in range(rows):
                for vv in range(nv):
                    var c = cs + vv * W
                    if c + W <= N:
                        _finish[WD, W](seg, r + i, c, t.unsafe_load[width=W](i * PANEL + vv * W))
                    else:
                        for j in range(N - c):
                            _finish[WD, 1](seg, r + i, c + j, t.unsafe_load[width=1](i * PANEL + vv * W + j))
            r += rows
            tiles += 1
        c0 += nv * W


# ------------------------------------------------------------------ the GSS update
def _gss_unit[WD: DType](a: Pha, l: Int, u: Int):
    """Channels of one row: s = Abar s + xn, y = Re(Ct . s) + D xn, xn the DSS
    LayerNorm of the row's gelu(W_v x + b_v) (each unit normalises the row: H is small)."""
    var per_row = (a.H + GSS_CHANNELS - 1) // GSS_CHANNELS
    var r = u // per_row
    var h0 = (u % per_row) * GSS_CHANNELS
    var h1 = min(a.H, h0 + GSS_CHANNELS)
    var v = a.vr.unsafe_offset(r * a.H)
    var mean: Float32 = 0
    for h in range(a.H):
        mean += v[unsafe_offset=h]
    mean /= Float32(a.H)
    var var_: Float32 = 0
    for h in range(a.H):
        var c = v[unsafe_offset=h] - mean
        var_ += c * c
    var inv = 1 / sqrt(var_ / Float32(a.H) + a.eps)
    var nw = _vec(a, l, V_NW)
    var nb = _vec(a, l, V_NB)
    var D = _vec(a, l, V_D)
    var ar = _vec(a, l, V_AR)
    var ai = _vec(a, l, V_AI)
    var cr = _vec(a, l, V_CR)
    var ci = _vec(a, l, V_CI)
    var HN = a.H * a.N
    var st = a.states.unsafe_offset((l * a.B + r) * a.X)
    for h in range(h0, h1):
        var xn = (v[unsafe_offset=h] - mean) * inv * nw[unsafe_offset=h] + nb[unsafe_offset=h]
        var re = st.unsafe_offset(h * a.N)
        var im = re.unsafe_offset(HN)
        var crh = cr.unsafe_offset(h * a.N)
        var cih = ci.unsafe_offset(h * a.N)
        # the real and imaginary sums apart: two chains of FMAs instead of one
        var acc_re = SIMD[F32, W](0)
        var acc_im = SIMD[F32, W](0)
        var m = 0
        while m + W <= a.N:
            var sr = re.unsafe_load[width=W](m)
            var si = im.unsafe_load[width=W](m)
            var pr = ar.unsafe_load[width=W](m)
            var pi = ai.unsafe_load[width=W](m)
            var nr = pr * sr - pi * si + xn
            var ni = pr * si + pi * sr
            re.unsafe_store(m, nr)
            im.unsafe_store(m, ni)
            acc_re = nr.fma(crh.unsafe_load[width=W](m), acc_re)
            acc_im = ni.fma(cih.unsafe_load[width=W](m), acc_im)
            m += W
        var total = acc_re.reduce_add() - acc_im.reduce_add()
        while m < a.N:
            var sr = re[unsafe_offset=m]
            var si = im[unsafe_offset=m]
            var nr = ar[unsafe_offset=m] * sr - ai[unsafe_offset=m] * si + xn
            var ni = ar[unsafe_offset=m] * si + ai[unsafe_offset=m] * sr
            re[unsafe_offset=m] = nr
            im[unsafe_offset=m] = ni
            total += nr * crh[unsafe_offset=m] - ni * cih[unsafe_offset=m]
            m += 1
        a.y[unsafe_offset=r * a.H + h] = _rnd[WD, 1](total + D[unsafe_offset=h] * xn)  # the gate's input


# ------------------------------------------------------------------ attention
@always_inline
def _dot(x: F32P, y: F32P, n: Int) -> Float32:
    var acc = SIMD[F32, W](0)
    var i = 0
    while i + W <= n:
        acc = x.unsafe_load[width=W](i).fma(y.unsafe_load[width=W](i), acc)
        i += W
    var total = acc.reduce_add()
    while i < n:
        total += x[unsafe_offset=i] * y[unsafe_offset=i]
        i += 1
    return total


@always_inline
def _axpy(c: Float32, x: F32P, y: F32P, n: Int):
    """y += c x."""
    var i = 0
    while i + W <= n:
        y.unsafe_store(i, x.unsafe_load[width=W](i).fma(c, y.unsafe_load[width=W](i)))
        i += W
    while i < n:
        y[unsafe_offset=i] += c * x[unsafe_offset=i]
        i += 1


@always_inline
def _scale(c: Float32, y: F32P, n: Int):
    """y *= c."""
    var i = 0
    while i + W <= n:
        y.unsafe_store(i, y.unsafe_load[width=W](i) * c)
        i += W
    while i < n:
        y[unsafe_offset=i] *= c
        i += 1


@always_inline
def _dots4(q: F32P, k: F32P, dh: Int, dst: F32P):
    """dst[i] = q . k[i dh : (i+1) dh] for 4 rows of k: four independent chains of FMAs."""
    var a0 = SIMD[F32, W](0)
    var a1 = SIMD[F32, W](0)
    var a2 = SIMD[F32, W](0)
    var a3 = SIMD[F32, W](0)
    var i = 0
    while i + W <= dh:
        var qv = q.unsafe_load[width=W](i)
        a0 = qv.fma(k.unsafe_load[width=W](i), a0)
        a1 = qv.fma(k.unsafe_load[width=W](dh + i), a1)
        a2 = qv.fma(k.unsafe_load[width=W](2 * dh + i), a2)
        a3 = qv.fma(k.unsafe_load[width=W](3 * dh + i), a3)
        i += W
    var t0 = a0.reduce_add()
    var t1 = a1.reduce_add()
    var t2 = a2.reduce_add()
    var t3 = a3.reduce_add()
    while i < dh:
        var qi = q[unsafe_offset=i]
        t0 += qi * k[unsafe_offset=i]
        t1 += qi * k[unsafe_offset=dh + i]
        t2 += qi * k[unsafe_offset=2 * dh + i]
        t3 += qi * k[unsafe_offset=3 * dh + i]
        i += 1
    dst[unsafe_offset=0] = t0
    dst[unsafe_offset=1] = t1
    dst[unsafe_offset=2] = t2
    dst[unsafe_offset=3] = t3


@always_inline
def _max_of(s: F32P, n: Int) -> Float32:
    var mv = SIMD[F32, W](NEG)
    var i = 0
    while i + W <= n:
        mv = max(mv, s.unsafe_load[width=W](i))
        i += W
    var m = mv.reduce_max()
    while i < n:
        m = max(m, s[unsafe_offset=i])
        i += 1
    return m


@always_inline
def _exp_shifted(s: F32P, n: Int, shift: Float32) -> Float32:
    """s[i] = exp(s[i] - shift); -> their sum."""
    var tv = SIMD[F32, W](0)
    var i = 0
    while i + W <= n:
        var w = exp(s.unsafe_load[width=W](i) - shift)
        s.unsafe_store(i, w)
        tv += w
        i += W
    var total = tv.reduce_add()
    while i < n:
        var w = exp(s[unsafe_offset=i] - shift)
        s[unsafe_offset=i] = w
        total += w
        i += 1
    return total


@always_inline
def _weighted_rows(o: F32P, v: F32P, w: F32P, nb: Int, dh: Int):
    """o[:dh] += sum_i w[i] v[i dh : (i+1) dh]: the sums in registers across the rows,
    four vectors of columns at a time (independent chains)."""
    var c = 0
    while c + 4 * W <= dh:
        var a0 = o.unsafe_load[width=W](c)
        var a1 = o.unsafe_load[width=W](c + W)
        var a2 = o.unsafe_load[width=W](c + 2 * W)
        var a3 = o.unsafe_load[width=W](c + 3 * W)
        for i in range(nb):
            var p = w[unsafe_offset=i]
            var vr = v.unsafe_offset(i * dh + c)
            a0 = vr.unsafe_load[width=W](0).fma(p, a0)
            a1 = vr.unsafe_load[width=W](W).fma(p, a1)
            a2 = vr.unsafe_load[width=W](2 * W).fma(p, a2)
            a3 = vr.unsafe_load[width=W](3 * W).fma(p, a3)
        o.unsafe_store(c, a0)
        o.unsafe_store(c + W, a1)
        o.unsafe_store(c + 2 * W, a2)
        o.unsafe_store(c + 3 * W, a3)
        c += 4 * W
    while c + W <= dh:
        var acc = o.unsafe_load[width=W](c)
        for i in range(nb):
            acc = v.unsafe_load[width=W](i * dh + c).fma(w[unsafe_offset=i], acc)
        o.unsafe_store(c, acc)
        c += W
    while c < dh:
        var acc = o[unsafe_offset=c]
        for i in range(nb):
            acc += w[unsafe_offset=i] * v[unsafe_offset=i * dh + c]
        o[unsafe_offset=c] = acc
        c += 1


def _rope_row(a: Pha, r: Int):
    """Row r's RoPE table at its position: cos, then sin, of pos * inv_freq (float32, as
    the graph computes the angle)."""
    var half = a.dh // 2
    var freq = a.freq
    var p = Float32(Int(a.pos[unsafe_offset=r]))
    var t = a.rope.unsafe_offset(r * a.dh)
    for i in range(half):
        var angle = p * freq[unsafe_offset=i]
        t[unsafe_offset=i] = cos(angle)
        t[unsafe_offset=half + i] = sin(angle)


def _prepare_head(a: Pha, r: Int, src: F32P, dst: F32P, scale: F32P, scaled: Bool):
    """dst = rope(l2norm(src)) for one head of dh channels (times ``scale`` if scaled)."""
    var half = a.dh // 2
    var ss = _dot(src, src, a.dh)
    var inv = 1 / max(sqrt(ss), Float32(1e-12))
    var t = a.rope.unsafe_offset(r * a.dh)
    for i in range(half):
        var c = t[unsafe_offset=i]
        var s = t[unsafe_offset=half + i]
        var x1 = src[unsafe_offset=i] * inv
        var x2 = src[unsafe_offset=half + i] * inv
        dst[unsafe_offset=i] = x1 * c - x2 * s
        dst[unsafe_offset=half + i] = x1 * s + x2 * c
    if scaled:
        for i in range(a.dh):
            dst[unsafe_offset=i] *= scale[unsafe_offset=i]


@always_inline
def _kv(a: Pha, l: Int, r: Int, kh: Int, values: Bool) -> F32P:
    """The cache of KV head kh of row r in layer l: [n, dh]."""
    var base = (l * a.B + r) * a.X + 2 * a.H * a.N * Int(a.gss)
    var kv = a.Hkv * a.n * a.dh
    return a.states.unsafe_offset(base + (kv if values else 0) + kh * a.n * a.dh)


def _attn_unit(a: Pha, l: Int, u: Int, ws: F32P):
    """One slice of the cached rows of a (row, KV head): per query head of the group,
    the running max, the sum of exp and the weighted values over the slice's rows
    (an online softmax in blocks of BLOCK rows), into ``part``."""
    var G = a.Hq // a.Hkv
    var dh = a.dh
    var sl = u % a.slices
    var kh = (u // a.slices) % a.Hkv
    var r = u // (a.slices * a.Hkv)
    var ctx = min(Int(a.pos[unsafe_offset=r]), a.n)
    var j0 = sl * ctx // a.slices
    var j1 = (sl + 1) * ctx // a.slices
    var qs = ws  # [G, dh] the group's prepared queries
    var sc = ws.unsafe_offset(G * dh)  # [G, BLOCK] a block's logits, then weights
    var scale = _vec(a, l, V_SCALE)
    for g in range(G):
        var h = kh * G + g
        _prepare_head(a, r, a.q.unsafe_offset(r * a.Hq * dh + h * dh), qs.unsafe_offset(g * dh),
                      scale.unsafe_offset(h * dh), True)
    var keys = _kv(a, l, r, kh, False)
    var values = _kv(a, l, r, kh, True)
    var part = a.part.unsafe_offset(((r * a.Hq + kh * G) * a.slices + sl) * (dh + 2))
    var part_step = a.slices * (dh + 2)  # from one query head's sums to the next's
    _start_sums(part, part_step, G, dh)
    if dh % W == 0:
        if G == 1:
            _attn_group_blocks[1](keys, values, qs, sc, part, part_step, j0, j1, dh)
            return
        if G == 2:
            _attn_group_blocks[2](keys, values, qs, sc, part, part_step, j0, j1, dh)
            return
        if G == 4:
            _attn_group_blocks[4](keys, values, qs, sc, part, part_step, j0, j1, dh)
            return
    _attn_head_blocks(keys, values, qs, sc, part, part_step, j0, j1, dh, G)


def _start_sums(part: F32P, part_step: Int, G: Int, dh: Int):
    """Each of the G query heads' running max, sum of exp and weighted values (``dh + 2``
    floats, ``part_step`` apart), before any cached row."""
    for g in range(G):
        var o = part.unsafe_offset(g * part_step)
        o[unsafe_offset=0] = NEG
        o[unsafe_offset=1] = 0
        for i in range(dh):
            o[unsafe_offset=2 + i] = 0


def _attn_head_blocks(
    keys: F32P, values: F32P, qs: F32P, sc: F32P, part: F32P, part_step: Int, j0: Int, j1: Int, dh: Int, G: Int
):
    """``_attn_unit``'s block loop for any head width: one query head after the other over
    each block of rows (``_attn_group_blocks`` takes the heads together where it can)."""
    var j = j0
    while j < j1:
        # a block's keys and values stay in the L1 cache while every head of the group
        # reads them
        var nb = min(BLOCK, j1 - j)
        for g in range(G):
            var o = part.unsafe_offset(g * part_step)
            var s = sc.unsafe_offset(g * BLOCK)
            var qg = qs.unsafe_offset(g * dh)
            var i = 0
            while i + 4 <= nb:
                _dots4(qg, keys.unsafe_offset((j + i) * dh), dh, s.unsafe_offset(i))
                i += 4
            while i < nb:
                s[unsafe_offset=i] = _dot(qg, keys.unsafe_offset((j + i) * dh), dh)
                i += 1
            _online_softmax_update(o, s, nb, dh)
            _weighted_rows(o.unsafe_offset(2), values.unsafe_offset(j * dh), s, nb, dh)
        j += nb


@always_inline
def _online_softmax_update(o: F32P, s: F32P, nb: Int, dh: Int):
    """A block's logits s[:nb] into a head's running (max, sum, sums o[2:]): s becomes
    the block's weights, and the sums so far are rescaled to the new max."""
    var m_old = o[unsafe_offset=0]
    var m_new = max(m_old, _max_of(s, nb))
    var corr = exp(m_old - m_new)
    var total = _exp_shifted(s, nb, m_new)
    o[unsafe_offset=0] = m_new
    o[unsafe_offset=1] = o[unsafe_offset=1] * corr + total
    if corr != 1:
        _scale(corr, o.unsafe_offset(2), dh)


def _attn_group_blocks[G: Int](
    keys: F32P, values: F32P, qs: F32P, sc: F32P, part: F32P, part_step: Int, j0: Int, j1: Int, dh: Int
):
    """``_attn_unit``'s block loop with the G query heads of the group together (dh a
    multiple of W): each key row is loaded once for the G logits and each value row once
    for the G weighted sums, which stay in registers across the block's rows. Reading a
    row once instead of once per head, with G times the arithmetic per load, is what lets
    the reads from memory overlap the computing (bench/pha_attention_loop.py). The same
    sums in the same order as the per-head loop."""
    # The logits of 8 / G key rows a pass: eight chains of FMAs cover the FMA's latency,
    # where one key row's G chains waited on it. (With AVX2 the 2 heads' 64 columns of
    # sums fill the 16 registers and the compiler keeps some on the stack; two passes of
    # 32 columns read the values more slowly from memory all the same: bench/pha_attention_loop.)
    comptime KR = max(1, 8 // G)  # key rows per pass of the logits
    comptime CW = 64 if G <= 2 else 128 // G  # the columns of one pass over a block's values
    var acc = stack_allocation[KR * G * W, Float32]()
    var sums = stack_allocation[G * CW, Float32]()
    var j = j0
    while j < j1:
        var nb = min(BLOCK, j1 - j)
        var i = 0
        while i + KR <= nb:
            _group_logits[G, KR](keys.unsafe_offset((j + i) * dh), qs, sc.unsafe_offset(i), acc, dh)
            i += KR
        while i < nb:
            _group_logits[G, 1](keys.unsafe_offset((j + i) * dh), qs, sc.unsafe_offset(i), acc, dh)
            i += 1
        comptime for g in range(G):
            _online_softmax_update(part.unsafe_offset(g * part_step), sc.unsafe_offset(g * BLOCK), nb, dh)
        var v = values.unsafe_offset(j * dh)
        var c0 = 0
        while c0 + CW <= dh:
            _group_weighted_rows[G, CW](part, part_step, v, sc, sums, nb, dh, c0)
            c0 += CW
        while c0 < dh:
            _group_weighted_rows[G, W](part, part_step, v, sc, sums, nb, dh, c0)
            c0 += W
        j += nb


@always_inline
def _group_logits[G: Int, KR: Int](k: F32P, qs: F32P, sc: F32P, acc: F32P, dh: Int):
    """sc[g BLOCK + r] = q_g . k_r for the KR key rows from k (dh apart) and the G queries
    qs: G KR independent chains of FMAs, each reduced on its own."""
    comptime for a in range(G * KR):
        acc.unsafe_store(a * W, SIMD[F32, W](0))
    var c = 0
    while c < dh:
        comptime for r in range(KR):
            var kv = k.unsafe_load[width=W](r * dh + c)
            comptime for g in range(G):
                comptime a = (r * G + g) * W
                acc.unsafe_store(a, qs.unsafe_load[width=W](g * dh + c).fma(kv, acc.unsafe_load[width=W](a)))
        c += W
    comptime for r in range(KR):
        comptime for g in range(G):
            sc[unsafe_offset=g * BLOCK + r] = acc.unsafe_load[width=W]((r * G + g) * W).reduce_add()


@always_inline
def _group_weighted_rows[G: Int, CW: Int](
    part: F32P, part_step: Int, v: F32P, sc: F32P, sums: F32P, nb: Int, dh: Int, c0: Int
):
    """Columns c0 .. c0+CW of each head's sums += its weights times the block's nb value rows."""
    comptime for g in range(G):
        sums.unsafe_store(g * CW, part.unsafe_load[width=CW](g * part_step + 2 + c0))
    for i in range(nb):
        var row = v.unsafe_load[width=CW](i * dh + c0)
        comptime for g in range(G):
            sums.unsafe_store(g * CW, row.fma(sc[unsafe_offset=g * BLOCK + i], sums.unsafe_load[width=CW](g * CW)))
    comptime for g in range(G):
        part.unsafe_store(g * part_step + 2 + c0, sums.unsafe_load[width=CW](g * CW))


def _merge_unit[WD: DType](a: Pha, l: Int, u: Int, ws: F32P):
    """A (row, KV head): each query head's slices merged with the new token's column
    into ``att``; then the new key and value written as the cache's row min(pos, n-1)
    (every read of the cache is done: the phase before read it)."""
    var G = a.Hq // a.Hkv
    var dh = a.dh
    var kh = u % a.Hkv
    var r = u // a.Hkv
    var kn = ws  # [dh] the new key, prepared
    var qs = ws.unsafe_offset(dh)
    var scale = _vec(a, l, V_SCALE)
    _prepare_head(a, r, a.k.unsafe_offset(r * a.Hkv * dh + kh * dh), kn, scale, False)
    var vn = a.v.unsafe_offset(r * a.Hkv * dh + kh * dh)
    for g in range(G):
        var h = kh * G + g
        _prepare_head(a, r, a.q.unsafe_offset(r * a.Hq * dh + h * dh), qs, scale.unsafe_offset(h * dh), True)
        var s_new = _dot(qs, kn, dh)
        var m = s_new
        for sl in range(a.slices):
            m = max(m, a.part[unsafe_offset=((r * a.Hq + h) * a.slices + sl) * (dh + 2)])
        var out = a.att.unsafe_offset(r * a.Hq * dh + h * dh)
        var w = exp(s_new - m)
        var total = w
        for i in range(dh):
            out[unsafe_offset=i] = w * vn[unsafe_offset=i]
        for sl in range(a.slices):
            var o = a.part.unsafe_offset(((r * a.Hq + h) * a.slices + sl) * (dh + 2))
            var c = exp(o[unsafe_offset=0] - m)
            total += c * o[unsafe_offset=1]
            _axpy(c, o.unsafe_offset(2), out, dh)
        _scale(1 / total, out, dh)
        comptime if WD != F32:  # o_proj's input
            for i in range(dh):
                out[unsafe_offset=i] = _rnd[WD, 1](out[unsafe_offset=i])
    var row = min(Int(a.pos[unsafe_offset=r]), a.n - 1)
    var kc = _kv(a, l, r, kh, False).unsafe_offset(row * dh)
    var vc = _kv(a, l, r, kh, True).unsafe_offset(row * dh)
    for i in range(dh):
        kc[unsafe_offset=i] = kn[unsafe_offset=i]
        vc[unsafe_offset=i] = vn[unsafe_offset=i]


# ------------------------------------------------------------------ the block's norm
def _norm_unit[WD: DType](a: Pha, l: Int, u: Int):
    """Rows of one unit: x = LN(alpha x + sum_i RMSNorm_i(out_i)), and its rounded copy."""
    for r in range(u * NORM_CHUNK, min(a.B, (u + 1) * NORM_CHUNK)):
        var x = a.x.unsafe_offset(r * a.E)
        _scale(a.alpha, x, a.E)
        for i in range(a.nbr):
            var b = a.bo.unsafe_offset((i * a.B + r) * a.E)
            var ms = _dot(b, b, a.E) / Float32(a.E)
            var inv = 1 / sqrt(ms + a.eps)
            var wgt = _vec(a, l, V_BN + i)
            for c in range(a.E):
                x[unsafe_offset=c] += b[unsafe_offset=c] * inv * wgt[unsafe_offset=c]
        _layer_norm[F32](x, x, _vec(a, l, V_PW), _vec(a, l, V_PB), a.eps, a.E)
        _round_copy[WD](a, r)


@always_inline
def _round_copy[WD: DType](a: Pha, r: Int):
    """Row r of xr = x rounded to the weights' dtype (nothing to do with float32: xr is x)."""
    comptime if WD != F32:
        var x = a.x.unsafe_offset(r * a.E)
        var xr = a.xr.unsafe_offset(r * a.E)
        var c = 0
        while c + W <= a.E:
            xr.unsafe_store(c, _rnd[WD](x.unsafe_load[width=W](c)))
            c += W
        while c < a.E:
            xr[unsafe_offset=c] = _rnd[WD, 1](x[unsafe_offset=c])
            c += 1


# ------------------------------------------------------------------ choosing the tokens
def _embed_row[WD: DType](a: Pha, r: Int, token: Int):
    var e = Pointer[Scalar[WD], MutUntrackedOrigin](unsafe_from_address=a.emb).unsafe_offset(token * a.E)
    for c in range(a.E):
        a.x[unsafe_offset=r * a.E + c] = e[unsafe_offset=c].cast[F32]()
    _round_copy[WD](a, r)  # exact: the embedding has the weights' dtype


def _take[WD: DType](a: Pha, r: Int, token: Int):
    """Row r's token of this step and, for the next, its embedding as x, its position
    and RoPE table."""
    a.tokens[unsafe_offset=r * a.S + a.s] = Int64(token)
    if a.s + 1 < a.S:
        _embed_row[WD](a, r, token)
        a.pos[unsafe_offset=r] = a.pos_in[unsafe_offset=r] + Int64(a.s + 1)
        if a.attn:
            _rope_row(a, r)


def _choose_unit[WD: DType, kind: Int](a: Pha, u: Int, mut scratch: RowScratch):
    var raw = F32P(unsafe_from_address=Int(scratch.raw.unsafe_ptr()))
    for r in range(u * NORM_CHUNK, min(a.B, (u + 1) * NORM_CHUNK)):
        var row = a.logits.unsafe_offset(r * a.V)
        comptime if kind == P_DRAW:
            if a.scored:  # choose_token overwrites the row
                for i in range(a.V):
                    raw[unsafe_offset=i] = row[unsafe_offset=i]
        var token: Int
        comptime if kind == P_ARGMAX:
            token = first_argmax(row, a.V)
        else:
            token = choose_token(
                row, a.V, a.temperature[unsafe_offset=r], Int(a.top_k[unsafe_offset=r]), a.top_p[unsafe_offset=r],
                a.seed[unsafe_offset=r], a.pos_in[unsafe_offset=r] + Int64(a.s + 1), a.filtered, scratch,
            )
        if a.scored:  # the row as the head gave it (row_logprobs.mojo)
            var at = r * a.S + a.s
            score_token(
                raw if kind == P_DRAW else row, a.V, token, a.top_n, a.logprobs.unsafe_offset(at),
                a.top_values.unsafe_offset(at * a.top_n), a.top_ids.unsafe_offset(at * a.top_n),
            )
        _take[WD](a, r, token)


# ------------------------------------------------------------------ scheduling
@always_inline
def _product_phase(kind: Int, l: Int, L: Int) -> Int:
    """The index of a product phase in ``seg_at``."""
    if kind == P_HEAD:
        return 3 * L
    return 3 * l + (0 if kind == P_IN else (1 if kind == P_HID else 2))


def _gss_units(a: Pha) -> Int:
    return a.B * ((a.H + GSS_CHANNELS - 1) // GSS_CHANNELS) if a.gss else 0


def _units(a: Pha, kind: Int) -> Int:
    """Units of a phase other than a product phase (those count theirs by ``_phase_cost``)."""
    if kind == P_MID:
        return _gss_units(a) + (a.B * a.Hkv * a.slices if a.attn else 0)
    if kind == P_MERGE:
        return a.B * a.Hkv if a.attn else 0
    return (a.B + NORM_CHUNK - 1) // NORM_CHUNK  # the norms, the choice


def _run_unit[WD: DType, kind: Int](a: Pha, l: Int, u: Int, ws: F32P, mut scratch: RowScratch):
    """One unit of a phase other than a product phase (those: ``_run_units_starting_in``)."""
    comptime if kind == P_MID:
        var gu = _gss_units(a)
        if u < gu:
            _gss_unit[WD](a, l, u)
        else:
            _attn_unit(a, l, u - gu, ws)
    elif kind == P_MERGE:
        _merge_unit[WD](a, l, u, ws)
    elif kind == P_NORM:
        _norm_unit[WD](a, l, u)
    elif kind == P_ARGMAX or kind == P_DRAW:
        _choose_unit[WD, kind](a, u, scratch)


def _unit_cost(seg: I64P) -> Int:
    """What one unit of a segment counts in its phase's claims: its panel's rows in 64s (a
    unit's time is its panel's read, or at more batch rows its tiles' K steps)."""
    return (Int(seg[unsafe_offset=S_K]) + 63) // 64


@always_inline
def _segments(a: Pha, kind: Int, l: Int) -> I64P:
    """A product phase's entry in ``seg_at``: its first segment, then how many."""
    return a.seg_at.unsafe_offset(2 * _product_phase(kind, l, a.L))


@always_inline
def _segment(a: Pha, at: I64P, i: Int) -> I64P:
    """Segment i of the product phase whose ``seg_at`` entry is ``at``."""
    return a.segs.unsafe_offset((Int(at[unsafe_offset=0]) + i) * SEGF)


def _phase_cost(a: Pha, kind: Int, l: Int) -> Int:
    """What a product phase's units count in all (``_unit_cost``)."""
    var at = _segments(a, kind, l)
    var total = 0
    for i in range(Int(at[unsafe_offset=1])):
        var seg = _segment(a, at, i)
        total += _seg_units(seg, a.B) * _unit_cost(seg)
    return total


def _panel_at[WD: DType](a: Pha, at: I64P, cost: Int) -> Tuple[Int, Int]:
    """The address and the weights of the panel of the product phase's first unit whose
    cost (``_unit_cost``, counted from the phase's first unit) starts at or after ``cost``;
    (0, 0) past the last."""
    var base = 0
    for i in range(Int(at[unsafe_offset=1])):
        var seg = _segment(a, at, i)
        var n = _seg_units(seg, a.B)
        var c = _unit_cost(seg)
        var j = max(0, (cost - base + c - 1) // c)
        if j < n:
            var q = j // _chunks(a.B)
            var K = Int(seg[unsafe_offset=S_K])
            var width = min(PANEL, _padded(Int(seg[unsafe_offset=S_N])) - q * PANEL)
            return (Int(seg[unsafe_offset=S_MAT]) + q * PANEL * K * size_of[WD](), K * width)
        base += n * c
    return (0, 0)


def _run_units_starting_in[WD: DType](a: Pha, kind: Int, l: Int, first: Int, end: Int, counter: I64P):
    """The units of a product phase whose cost (``_unit_cost``), counted from the phase's
    first unit, starts in [first, end): claims of cost intervals that cover the phase run
    each unit once. Where ``_prefetches_next_panel`` says so, each unit's tiles prefetch the
    panel of this worker's next unit: the next of the run, after the run's last the one
    the claims' counter has reached (the start of this worker's next claim, unless the
    other workers claim first)."""
    var at = _segments(a, kind, l)
    var base = 0
    for i in range(Int(at[unsafe_offset=1])):
        if base >= end:
            return
        var seg = _segment(a, at, i)
        var n = _seg_units(seg, a.B)
        var c = _unit_cost(seg)
        var j0 = max(0, (first - base + c - 1) // c)
        var j1 = min(n, (end - base + c - 1) // c)
        for j in range(j0, j1):
            var next_panel = 0
            var next_weights = 0
            if _prefetches_next_panel(a.B):  # else no walk: _next_panel_lines gives nothing
                var after = base + (j + 1) * c
                if after >= end:
                    after = Int(Atomic[Int64].load(counter))
                next_panel, next_weights = _panel_at[WD](a, at, after)
            _product_unit[WD](a, seg, j, next_panel, next_weights)
        base += n * c


def _phase[WD: DType, kind: Int](a: Pha, l: Int, counter: I64P, ws: F32P, mut scratch: RowScratch) -> Int:
    """Claim and run units of one phase until none is left, then wait for the units
    other workers claimed (counter: claimed; counter + 8: done). Product phases are
    claimed in runs (decode_step.mojo's ``_claim`` with a share): with fewer batch rows
    than a register tile a unit is a panel read in a fraction of a microsecond, and a claim
    per unit would make the counter's cache line travel between the cores for each; with
    more, a worker knows its next unit within a run and prefetches its panel
    (``_run_units_starting_in``). A phase's segments may have units of different sizes (a
    panel of K rows reads K rows), so runs are sized by the units' cost, not their count:
    by count, a run of small units holds a fraction of the bytes, and one worker is left
    with the large units while the other waits. Returns when (with PHASE_TIMES) this
    worker's own units were done, before its wait."""
    comptime products = kind == P_IN or kind == P_HID or kind == P_GATE or kind == P_HEAD
    var share = 0
    var n: Int
    comptime if products:
        share = a.workers * CLAIM_SHARE
        n = _phase_cost(a, kind, l)
    else:
        n = _units(a, kind)
    var done = counter.unsafe_offset(8)
    while True:
        var first, end = _claim(counter, n, share)
        if first >= n:
            break
        comptime if products:
            _run_units_starting_in[WD](a, kind, l, first, end, counter)
        else:
            for u in range(first, end):
                _run_unit[WD, kind](a, l, u, ws, scratch)
        _ = Atomic[Int64].fetch_add(done, Int64(end - first))
    var own_done = 0
    comptime if PHASE_TIMES:
        own_done = Int(perf_counter_ns())
    while Int(Atomic[Int64].load(done)) < n:
        pass
    return own_done


@always_inline
def _timed_phase[WD: DType, kind: Int, slot: Int](
    a: Pha, l: Int, counter: I64P, ws: F32P, mut scratch: RowScratch, times: I64P
):
    """``_phase``, with PHASE_TIMES its wall time added to ``times``' slot (a cache line each)
    and the part spent waiting for the other workers to the slot TIMED_KINDS further on."""
    comptime if PHASE_TIMES:
        var t0 = Int(perf_counter_ns())
        var own_done = _phase[WD, kind](a, l, counter, ws, scratch)
        var t1 = Int(perf_counter_ns())
        _ = Atomic[Int64].fetch_add(times.unsafe_offset(slot * STRIDE), Int64(t1 - t0))
        _ = Atomic[Int64].fetch_add(times.unsafe_offset((slot + TIMED_KINDS) * STRIDE), Int64(t1 - own_done))
    else:
        _ = _phase[WD, kind](a, l, counter, ws, scratch)


def _phases_per_step(L: Int) -> Int:
    return L * PER_BLOCK + 2


def _worker[WD: DType, choose: Int](step: Pha, counters: I64P, first: Int, last: Int, times: I64P):
    var a = step
    var c = counters
    var scratch = RowScratch(a.V if choose == P_DRAW else 0)
    var G = a.Hq // a.Hkv
    var ws = List[Float32](length=G * a.dh + G * BLOCK + a.dh + 16, fill=0)
    var wp = F32P(unsafe_from_address=Int(ws.unsafe_ptr()))
    for s in range(first, last):
        a.s = s
        for l in range(a.L):
            comptime for kind in range(PER_BLOCK):
                _timed_phase[WD, kind, kind](a, l, c, wp, scratch, times)
                c = c.unsafe_offset(STRIDE)
        _timed_phase[WD, P_HEAD, PER_BLOCK](a, a.L - 1, c, wp, scratch, times)
        c = c.unsafe_offset(STRIDE)
        _timed_phase[WD, choose, PER_BLOCK + 1](a, 0, c, wp, scratch, times)
        c = c.unsafe_offset(STRIDE)
    _ = ws^


def _workers() -> Int:
    return min(num_physical_cores(), MAX_WORKERS)


def _run[WD: DType, choose: Int](step: Pha):
    var a = step
    var per_fork = min(a.S, STEPS_PER_FORK)
    var counters = List[Int64](length=per_fork * _phases_per_step(a.L) * STRIDE, fill=0)
    var cp = I64P(unsafe_from_address=Int(counters.unsafe_ptr()))
    var workers = a.workers
    var times = List[Int64](length=2 * TIMED_KINDS * STRIDE, fill=0)
    var tp = I64P(unsafe_from_address=Int(times.unsafe_ptr()))
    var first = 0
    while first < a.S:
        var last = min(a.S, first + per_fork)
        if first > 0:  # every worker has joined the previous fork: safe to reset
            for i in range(len(counters)):
                counters[i] = 0

        def work(i: Int) {var a, var cp, var first, var last, var tp}:
            _worker[WD, choose](a, cp, first, last, tp)

        sync_parallelize(work, workers)
        first = last
    comptime if PHASE_TIMES:  # nanoseconds per kind, each worker's wall time summed, then its waits
        var line = String("pha_decode_steps phase times: B=", a.B, " S=", a.S, " workers=", workers, " ns=")
        for k in range(TIMED_KINDS):
            line += String(times[k * STRIDE], "," if k + 1 < TIMED_KINDS else " waits=")
        for k in range(TIMED_KINDS):
            line += String(times[(TIMED_KINDS + k) * STRIDE], "," if k + 1 < TIMED_KINDS else "")
        print(line)
    _ = counters^
    _ = times^


def _slices(B: Int, Hkv: Int, n: Int, workers: Int) -> Int:
    """Context slices per (row, KV head): enough units for every worker several times
    over when the batch is small, none shorter than ROWS_PER_SLICE rows."""
    var want = (4 * workers + B * Hkv - 1) // (B * Hkv)
    return max(1, min(want, n // ROWS_PER_SLICE))


def _in[dt: DType](t: InputTensor[dtype=dt, ...]) -> Pointer[Scalar[dt], MutUntrackedOrigin]:
    return Pointer[Scalar[dt], MutUntrackedOrigin](unsafe_from_address=Int(t.unsafe_ptr()))


def _out[dt: DType](t: OutputTensor[dtype=dt, ...]) -> Pointer[Scalar[dt], MutUntrackedOrigin]:
    return Pointer[Scalar[dt], MutUntrackedOrigin](unsafe_from_address=Int(t.unsafe_ptr()))


@always_inline
def _seg(
    mut segs: List[Int64], mat: Int, K: Int, N: Int, x: F32P, ldx: Int, dst: F32P, ldd: Int, bias: Int, kind: Int,
    mul: Int, rounded: Bool = False,
):
    segs.append(Int64(mat))
    segs.append(Int64(K))
    segs.append(Int64(N))
    segs.append(Int64(Int(x)))
    segs.append(Int64(ldx))
    segs.append(Int64(Int(dst)))
    segs.append(Int64(ldd))
    segs.append(Int64(bias))
    segs.append(Int64(kind))
    segs.append(Int64(mul))
    segs.append(Int64(Int(rounded)))


@register("pha_decode_steps")
struct PhaDecodeSteps:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        tokens: OutputTensor[dtype=DType.int64, rank=2, ...],
        last: OutputTensor[dtype=DType.int64, rank=1, ...],
        next_positions: OutputTensor[dtype=DType.int64, rank=1, ...],
        logprobs: OutputTensor[dtype=DType.float32, rank=2, ...],
        top_values: OutputTensor[dtype=DType.float32, rank=3, ...],
        top_ids: OutputTensor[dtype=DType.int64, rank=3, ...],
        states: MutableInputTensor[dtype=DType.float32, rank=3, ...],
        ids: InputTensor[dtype=DType.int64, rank=1, ...],
        embedding: InputTensor[rank=2, ...],
        positions: InputTensor[dtype=DType.int64, rank=1, ...],
        mats: InputTensor[dtype=embedding.dtype, rank=1, ...],
        vecs: InputTensor[dtype=DType.float32, rank=1, ...],
        layout: InputTensor[dtype=DType.int64, rank=2, ...],
        dims: InputTensor[dtype=DType.int64, rank=1, ...],
        scalars: InputTensor[dtype=DType.float32, rank=1, ...],
        steps: InputTensor[dtype=DType.int64, rank=1, ...],
        temperature: InputTensor[dtype=DType.float32, rank=1, ...],
        top_k: InputTensor[dtype=DType.int64, rank=1, ...],
        top_p: InputTensor[dtype=DType.float32, rank=1, ...],
        seed: InputTensor[dtype=DType.uint64, rank=1, ...],
        mode: InputTensor[dtype=DType.int64, rank=1, ...],
        scored: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime WD = embedding.dtype
        comptime if target != "cpu":
            raise Error("pha_decode_steps: CPU only")
        comptime if WD != F32 and WD != DType.bfloat16:
            raise Error("pha_decode_steps: float32 or bfloat16 weights only")
        var B = ids.dim_size(0)
        var S = steps.dim_size(0)
        var dm = _in(dims)
        if dims.dim_size(0) != NDIMS or layout.dim_size(1) != SLOTS:
            raise Error("pha_decode_steps: dims must be [", NDIMS, "] and layout [L, ", SLOTS, "]")
        var E = Int(dm[unsafe_offset=D_E])
        var L = Int(dm[unsafe_offset=D_L])
        var V = Int(dm[unsafe_offset=D_V])
        var F = Int(dm[unsafe_offset=D_F])
        var H = Int(dm[unsafe_offset=D_H])
        var N = Int(dm[unsafe_offset=D_N])
        var Hq = Int(dm[unsafe_offset=D_HQ])
        var Hkv = Int(dm[unsafe_offset=D_HKV])
        var dh = Int(dm[unsafe_offset=D_DH])
        var n = Int(dm[unsafe_offset=D_CTX])
        var nffn = Int(dm[unsafe_offset=D_NFFN])
        var has_gss = dm[unsafe_offset=D_GSS] != 0
        var has_attn = dm[unsafe_offset=D_ATTN] != 0
        var X = states.dim_size(2)
        var want_X = (2 * H * N if has_gss else 0) + (2 * Hkv * n * dh if has_attn else 0)
        if states.dim_size(0) != L or states.dim_size(1) != B or X != max(1, want_X):
            raise Error("pha_decode_steps: states must be [L, B, X] for this model")
        if layout.dim_size(0) != L or embedding.dim_size(1) != E or embedding.dim_size(0) < V or nffn > MAX_FFN:
            raise Error("pha_decode_steps: layout, embedding or the FFN count disagree with dims")
        if tokens.dim_size(0) != B or tokens.dim_size(1) != S or last.dim_size(0) != B or (
            next_positions.dim_size(0) != B or positions.dim_size(0) != B
        ):
            raise Error("pha_decode_steps: tokens must be [B, S], positions, last and next positions [B]")
        if temperature.dim_size(0) != B or top_k.dim_size(0) != B or top_p.dim_size(0) != B or (
            seed.dim_size(0) != B or mode.dim_size(0) != 1
        ):
            raise Error("pha_decode_steps: temperature, top_k, top_p and seed must be [B], mode [1]")
        var TN = top_values.dim_size(2)
        if scored.dim_size(0) != 1 or logprobs.dim_size(0) != B or logprobs.dim_size(1) != S or (
            top_values.dim_size(0) != B or top_values.dim_size(1) != S or top_ids.dim_size(0) != B
            or top_ids.dim_size(1) != S or top_ids.dim_size(2) != TN or TN > V
        ):
            raise Error(
                "pha_decode_steps: scored must be [1], logprobs [B, S], top values and ids [B, S, N] with N <= V"
            )
        var pin = _in(positions)
        var ids_in = _in(ids)
        for b in range(B):
            if Int(pin[unsafe_offset=b]) < 0:
                raise Error("pha_decode_steps: position ", Int(pin[unsafe_offset=b]), " is negative")
            var token = Int(ids_in[unsafe_offset=b])
            if token < 0 or token >= embedding.dim_size(0):
                raise Error("pha_decode_steps: token id ", token, " outside [0, ", embedding.dim_size(0), ")")
        if S == 0:
            for b in range(B):
                last[b] = ids_in[unsafe_offset=b]
                next_positions[b] = pin[unsafe_offset=b]
            return

        var fsum = 0
        for i in range(nffn):
            fsum += Int(dm[unsafe_offset=D_FFN + i])
        var nbr = Int(has_gss) + Int(has_attn) + nffn
        var workers = _workers()
        var slices = _slices(B, Hkv, n, workers)
        var G = Hq // max(Hkv, 1)
        # the activations, each buffer on a cache line of its own
        var sizes = List[Int]()
        for s in [E, F, F, H, H, Hq * dh, Hkv * dh, Hkv * dh, Hq * dh, Hq * slices * (dh + 2), dh, nbr * E, V, fsum,
                  E if WD != F32 else 0]:
            sizes.append((B * s + 15) // 16 * 16)
        var total = 0
        for s in sizes:
            total += s
        var buf = List[Float32](length=total, fill=0)
        var ptrs = List[Int]()
        var at = Int(buf.unsafe_ptr())
        for s in sizes:
            ptrs.append(at)
            at += s * 4
        var pos = List[Int64](length=B, fill=0)
        for b in range(B):
            pos[b] = pin[unsafe_offset=b]
        var lay = _in(layout)
        var vp = _in(vecs)
        var a = Pha(
            B, E, L, V, F, H, N, Hq, Hkv, dh, n, nffn, has_gss, has_attn, nbr, X, scalars[0], scalars[1], slices,
            workers, S, 0, F32P(unsafe_from_address=Int(states.unsafe_ptr())), lay, vp,
            # the segment tables: set below, until then valid addresses unread
            dm, dm,
            F32P(unsafe_from_address=ptrs[0]), F32P(unsafe_from_address=ptrs[14 if WD != F32 else 0]),
            F32P(unsafe_from_address=ptrs[1]), F32P(unsafe_from_address=ptrs[2]),
            F32P(unsafe_from_address=ptrs[3]), F32P(unsafe_from_address=ptrs[4]), F32P(unsafe_from_address=ptrs[5]),
            F32P(unsafe_from_address=ptrs[6]), F32P(unsafe_from_address=ptrs[7]), F32P(unsafe_from_address=ptrs[8]),
            F32P(unsafe_from_address=ptrs[9]), F32P(unsafe_from_address=ptrs[10]), vp.unsafe_offset(Int(dm[unsafe_offset=D_ROPE])),
            F32P(unsafe_from_address=ptrs[11]),
            F32P(unsafe_from_address=ptrs[12]), Int(embedding.unsafe_ptr()),
            I64P(unsafe_from_address=Int(pos.unsafe_ptr())), pin, _out(tokens),
            _in(temperature), _in(top_k), _in(top_p), _in(seed), Int(mode[0]) == MODE_FILTERED,
            scored[0] != 0, _out(logprobs), TN, _out(top_values), _out(top_ids),
        )
        var hid = F32P(unsafe_from_address=ptrs[13])

        # the product segments of every phase
        var mp = Int(mats.unsafe_ptr())
        var fbytes = size_of[WD]()

        def mat(l: Int, slot: Int) {var lay, var mp, var fbytes} -> Int:
            return mp + Int(lay[unsafe_offset=l * SLOTS + slot]) * fbytes

        def vaddr(l: Int, slot: Int) {var lay, var vp} -> Int:
            return Int(vp) + Int(lay[unsafe_offset=l * SLOTS + slot]) * 4

        var segs = List[Int64]()
        var seg_at = List[Int64]()
        for l in range(L):
            # from x: the GSS's u and v, q, k, v, the FFNs' hidden values
            var first = len(segs) // SEGF
            if has_gss:
                _seg(segs, mat(l, M_U), E, F, a.xr, E, a.u, F, 0, E_GELU, 0)
                _seg(segs, mat(l, M_V), E, H, a.xr, E, a.vr, H, vaddr(l, V_VB), E_GELU, 0)
            if has_attn:
                _seg(segs, mat(l, M_Q), E, Hq * dh, a.xr, E, a.q, Hq * dh, 0, E_STORE, 0)
                _seg(segs, mat(l, M_K), E, Hkv * dh, a.xr, E, a.k, Hkv * dh, 0, E_STORE, 0)
                _seg(segs, mat(l, M_VA), E, Hkv * dh, a.xr, E, a.v, Hkv * dh, 0, E_STORE, 0)
            var off = 0
            for i in range(nffn):
                var f = Int(dm[unsafe_offset=D_FFN + i])
                _seg(segs, mat(l, M_FC + i), E, f, a.xr, E, hid.unsafe_offset(B * off), f, vaddr(l, V_FCB + i),
                     E_GELU, 0, rounded=True)
                off += f
            seg_at.append(Int64(first))
            seg_at.append(Int64(len(segs) // SEGF - first))
            # from the branches' hidden values: the FFNs' second products, o_proj, the gate; the
            # largest units first, so that a phase's last claims are its cheapest (``_phase``)
            first = len(segs) // SEGF
            var ffn_branch = Int(has_gss) + Int(has_attn)  # branch outputs: the gate's, the attention's, the FFNs'
            off = 0
            for i in range(nffn):
                var f = Int(dm[unsafe_offset=D_FFN + i])
                _seg(segs, mat(l, M_PROJ + i), f, E, hid.unsafe_offset(B * off), f,
                     a.bo.unsafe_offset((ffn_branch + i) * B * E), E, vaddr(l, V_PROJB + i), E_STORE, 0)
                off += f
            if has_attn:
                _seg(segs, mat(l, M_O), Hq * dh, E, a.att, Hq * dh, a.bo.unsafe_offset(Int(has_gss) * B * E), E, 0,
                     E_STORE, 0)
            if has_gss:
                _seg(segs, mat(l, M_GATE), H, F, a.y, H, a.g, F, 0, E_MUL, Int(a.u), rounded=True)
            seg_at.append(Int64(first))
            seg_at.append(Int64(len(segs) // SEGF - first))
            # the gate's output product
            first = len(segs) // SEGF
            if has_gss:
                _seg(segs, mat(l, M_OUT), F, E, a.g, F, a.bo, E, vaddr(l, V_OUTB), E_STORE, 0)
            seg_at.append(Int64(first))
            seg_at.append(Int64(len(segs) // SEGF - first))
        seg_at.append(Int64(len(segs) // SEGF))
        seg_at.append(1)
        _seg(segs, mp + Int(dm[unsafe_offset=D_HEAD]) * fbytes, E, V, a.xr, E, a.logits, V, 0, E_STORE, 0)
        a.segs = I64P(unsafe_from_address=Int(segs.unsafe_ptr()))
        a.seg_at = I64P(unsafe_from_address=Int(seg_at.unsafe_ptr()))

        for b in range(B):
            _embed_row[WD](a, b, Int(ids_in[unsafe_offset=b]))
            if has_attn:
                _rope_row(a, b)
        var m = Int(mode[0])
        if m == MODE_GREEDY:
            _run[WD, P_ARGMAX](a)
        else:
            _run[WD, P_DRAW](a)
        for b in range(B):
            last[b] = tokens[b, S - 1]
            next_positions[b] = pin[unsafe_offset=b] + Int64(S)
        _ = buf^
        _ = pos^
        _ = segs^
        _ = seg_at^
