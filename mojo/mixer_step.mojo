"""SRM token-mixer decode step (one position per sample) as MAX custom ops.

Shapes (float32 unless noted; H heads, hd head dim, n context length):
    u          [B, H, hd]   per-head token-mixer input at this step
    positions  [B] int64    absolute position t of this step, per sample
    w, beta    [H, n]       per-head, per-position mixer weight and bias
    lam        [H]          per-head decay (already clip(decay,0.9,1)**(1/c))
    state      [B, H, hd]   recurrent state (s for column heads, r for row heads)

Heads 0 .. H/2-1 are column-repeat, heads H/2 .. H-1 are row-repeat:
    column:  s = u + lam*s;          y = w[h,t]*s + beta[h,t]
    row:     r = w[h,t]*u + lam*r;   y = r + beta[h,t]

A position outside [0, n) yields NaN in y and in the new state (the caller is
expected to reject such positions before running the graph).

Op: srm_mixer_step_functional, state in, outputs (y, new_state): the decode graph's
mixer step on a GPU (on a CPU the whole step is mojo/decode_step.mojo). It has a CPU
path and a GPU path (the same `foreach` elementwise kernel: one work item per
(b, h, channel-vector); state is read and written once).
"""
from std.utils.index import IndexList

from extensibility import InputTensor, OutputTensor, foreach, register
from layout import Coord
from max.gpu.host import DeviceContext


@register("srm_mixer_step_functional")
struct SrmMixerStepFunctional:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[dtype=DType.float32, rank=3, ...],
        new_state: OutputTensor[dtype=y.dtype, rank=3, ...],
        state: InputTensor[dtype=y.dtype, rank=3, ...],
        u: InputTensor[dtype=y.dtype, rank=3, ...],
        positions: InputTensor[dtype=DType.int64, rank=1, ...],
        w: InputTensor[dtype=y.dtype, rank=2, ...],
        beta: InputTensor[dtype=y.dtype, rank=2, ...],
        lam: InputTensor[dtype=y.dtype, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var H = u.dim_size(1)
        var n = w.dim_size(1)
        if w.dim_size(0) != H or beta.dim_size(0) != H or lam.dim_size(0) != H:
            raise Error("srm_mixer_step_functional: w, beta, lam must have H rows")
        if beta.dim_size(1) != n:
            raise Error("srm_mixer_step_functional: w and beta must have the same length n")
        var half = H // 2

        def f[
            width: Int
        ](idx: Coord[...]) {
            var new_state, var state, var u, var positions, var w, var beta, var lam, var half, var n
        } -> SIMD[y.dtype, width]:
            var b = Int(idx[0].value())
            var h = Int(idx[1].value())
            var i = IndexList[3](b, h, Int(idx[2].value()))
            var t = Int(positions[b])
            var x = u.load[width](i)
            var s = state.load[width](i)
            var out: SIMD[y.dtype, width]
            if t < 0 or t >= n:
                var z = SIMD[y.dtype, width](0)
                s = z / z
                out = s
            else:
                var l = SIMD[y.dtype, width](lam[h])
                var wt = SIMD[y.dtype, width](w[h, t])
                var bt = SIMD[y.dtype, width](beta[h, t])
                if h < half:
                    s = x + l * s
                    out = wt * s + bt
                else:
                    s = wt * x + l * s
                    out = s + bt
            new_state.store[width](i, s)
            return out

        foreach[target=target](f, y, ctx)
