"""SRM token-mixer prefill scan as a MAX custom op.

    srm_mixer_scan(u [B, T, H, hd], lengths [B] int64, start [B] int64,
                   init [B, H, hd], w [H, n], beta [H, n], lam [H])
        -> y [B, T, H, hd], final_state [B, H, hd]    (float32 but lengths and start)

Sample b's token t (t = 0 .. T-1) sits at the absolute position p = start[b] + t:
a sample continues from the state ``init[b]`` it had after start[b] tokens (start 0
with a zero init: a fresh prompt). w and beta are the whole per-position tables, read
at p clamped to [0, n-1]: a prompt padded to whole chunks can run past n (T > n when
n is not a multiple of the chunk), and the padding's outputs are never read.
Heads 0 .. H/2-1 are column-repeat, H/2 .. H-1 are row-repeat:
    column:  s_t = u_t + lam*s_{t-1};         y_t = w[h,p]*s_t + beta[h,p]
    row:     r_t = w[h,p]*u_t + lam*r_{t-1};   y_t = r_t + beta[h,p]
with s_{-1} = r_{-1} = init[b]. y is computed for every t < T (positions at or past a
sample's length are padding: their y is what the recurrence gives for the padded
input, and they never affect earlier outputs). final_state is the state after
token lengths[b]-1 (init[b] for length 0; lengths are clamped to [0, T]).

The scan is sequential in t per channel (no lam**-t rescaling, so it is stable
for any T) and accumulates in float32.
CPU: parallel over (b, h, block of 4*W channels); inside a block, SIMD
     vectors along hd (4*W wide, then W wide) and a scalar tail for hd % W.
GPU: `foreach` over final_state: one thread per (b, h, channel-vector), each
     running the sequential scan over t.
"""
from max.algorithm import sync_parallelize
from std.sys import simd_width_of
from std.utils.index import IndexList

from extensibility import InputTensor, OutputTensor, foreach, register
from layout import Coord
from max.gpu.host import DeviceContext


@register("srm_mixer_scan")
struct SrmMixerScan:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[dtype=DType.float32, rank=4, ...],
        final_state: OutputTensor[dtype=y.dtype, rank=3, ...],
        u: InputTensor[dtype=y.dtype, rank=4, ...],
        lengths: InputTensor[dtype=DType.int64, rank=1, ...],
        start: InputTensor[dtype=DType.int64, rank=1, ...],
        init: InputTensor[dtype=y.dtype, rank=3, ...],
        w: InputTensor[dtype=y.dtype, rank=2, ...],
        beta: InputTensor[dtype=y.dtype, rank=2, ...],
        lam: InputTensor[dtype=y.dtype, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var B = u.dim_size(0)
        var T = u.dim_size(1)
        var H = u.dim_size(2)
        var D = u.dim_size(3)
        var n = w.dim_size(1)
        if w.dim_size(0) != H or beta.dim_size(0) != H or lam.dim_size(0) != H:
            raise Error("srm_mixer_scan: w, beta, lam must have H rows")
        if start.dim_size(0) != B or init.dim_size(0) != B:
            raise Error("srm_mixer_scan: start and init must have B rows")
        if init.dim_size(1) != H or init.dim_size(2) != D:
            raise Error("srm_mixer_scan: init must be [B, H, hd]")
        if beta.dim_size(1) != n:
            raise Error("srm_mixer_scan: w and beta must have the same length n")
        var half = H // 2

        comptime if target == "cpu":
            comptime W = simd_width_of[y.dtype]()
            # A work item is one block of up to CB channels of one (b, h).
            # Inside a block, 4*W channels advance together (4 independent
            # FMA chains per t hide the latency of the sequential recurrence),
            # then W-wide vectors, then a scalar tail for hd % W.
            comptime CB = 4 * W
            var nblk = (D + CB - 1) // CB

            def block(item: Int) {
                var y, var final_state, var u, var lengths, var start, var init, var w,
                var beta, var lam, var T, var H, var D, var n, var half, var nblk
            }:
                var bh = item // nblk
                var d = (item % nblk) * CB
                var end = min(d + CB, D)
                var b = bh // H
                var h = bh % H
                var L = Int(lengths[b])
                if L < 0:
                    L = 0
                if L > T:
                    L = T
                var p0 = Int(start[b])
                var is_col = h < half
                var lh = lam[h]
                comptime for k in range(3):
                    comptime width = CB if k == 0 else (W if k == 1 else 1)
                    while d + width <= end:
                        var l = SIMD[y.dtype, width](lh)
                        var s = init.load[width](IndexList[3](b, h, d))
                        var fin = s
                        if is_col:
                            for t in range(T):
                                var i = IndexList[4](b, t, h, d)
                                var p = min(max(p0 + t, 0), n - 1)
                                s = u.load[width](i) + l * s
                                y.store[width](
                                    i,
                                    SIMD[y.dtype, width](w[h, p]) * s
                                    + SIMD[y.dtype, width](beta[h, p]),
                                )
                                if t == L - 1:
                                    fin = s
                        else:
                            for t in range(T):
                                var i = IndexList[4](b, t, h, d)
                                var p = min(max(p0 + t, 0), n - 1)
                                s = (
                                    SIMD[y.dtype, width](w[h, p]) * u.load[width](i)
                                    + l * s
                                )
                                y.store[width](
                                    i, s + SIMD[y.dtype, width](beta[h, p])
                                )
                                if t == L - 1:
                                    fin = s
                        final_state.store[width](IndexList[3](b, h, d), fin)
                        d += width

            sync_parallelize(block, B * H * nblk)
        else:
            # One GPU thread per (b, h, channel-vector): sequential over t.
            def f[
                width: Int
            ](idx: Coord[...]) {
                var y, var u, var lengths, var start, var init, var w, var beta, var lam,
                var T, var n, var half
            } -> SIMD[y.dtype, width]:
                var b = Int(idx[0].value())
                var h = Int(idx[1].value())
                var d = Int(idx[2].value())
                var L = Int(lengths[b])
                if L < 0:
                    L = 0
                if L > T:
                    L = T
                var p0 = Int(start[b])
                var l = SIMD[y.dtype, width](lam[h])
                var s = init.load[width](IndexList[3](b, h, d))
                var fin = s
                for t in range(T):
                    var i = IndexList[4](b, t, h, d)
                    var p = min(max(p0 + t, 0), n - 1)
                    var wt = SIMD[y.dtype, width](w[h, p])
                    var bt = SIMD[y.dtype, width](beta[h, p])
                    if h < half:
                        s = u.load[width](i) + l * s
                        y.store[width](i, wt * s + bt)
                    else:
                        s = wt * u.load[width](i) + l * s
                        y.store[width](i, s + bt)
                    if t == L - 1:
                        fin = s
                return fin

            foreach[target=target](f, final_state, ctx)
