"""Small-batch SRM decode on the CPU: one fused op per layer, one for the logits.

At small batches a decode step is bound by reading the weights (about 4 bytes per
parameter per step), and a graph of separate ops adds a launch per norm, bias,
activation and residual. These ops read every weight matrix once per step for
the whole batch (each weight vector is multiplied into all B inputs while it is
in registers) and keep the small activations in a scratch output.

    srm_decode_layer(x [B, d], state [B, H, hd], positions [B] int64,
                     cn_w, cn_b [d], fc1_w [f, d], fc1_b [f], fc2_w [d, f], fc2_b [d],
                     tn_w, tn_b [d], proj_w [d, d], proj_b [d],
                     w, beta [H, n], lam [H], out_w [d, d], out_b [d], eps [1])
        -> x_out [B, d], new_state [B, H, hd], scratch [B, f + 2d]

    one SRM block, the same math as graphs/decode.py's `step` for one layer:
        x += fc2 silu(fc1 LN_c(x) + b1) + b2
        u  = proj LN_t(x) + proj_b
        mixer step (heads 0 .. H/2-1 column-repeat, the rest row-repeat):
            column:  s = u + lam*s;          y = w[h,t]*s + beta[h,t]
            row:     s = w[h,t]*u + lam*s;   y = s + beta[h,t]
        x += out y + out_b

    srm_linear_small(x [B, K], w [N, K]) -> y [B, N] = x @ w^T

Positions must lie in [0, n) (the graph clamps them). The four matrices (and
the logits' w) are float32 or bfloat16, widened to float32 in registers (half
the bytes to read at batch 1); everything else, the accumulation and the state
are float32. Contiguous row-major tensors, 1 <= B <= MAX_BATCH (the graph
routes larger batches to its plain ops). CPU only. Matrices of PARALLEL_MIN
elements or more are read by two threads (two halves of the rows), smaller
ones by one (a fork-join costs more than it saves there).
"""
from std.memory import stack_allocation
from max.algorithm import sync_parallelize
from std.math import exp, sqrt
from std.sys import simd_width_of

from extensibility import InputTensor, OutputTensor, register
from max.gpu.host import DeviceContext

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutAnyOrigin]
comptime MAX_BATCH = 16
comptime BLOCK = 8  # batch rows multiplied per pass over a weight row
comptime PARALLEL_MIN = 1 << 18  # multiply-adds of a product split across two cores


def _in(t: InputTensor[dtype=F32, ...]) -> F32P:
    return F32P(unsafe_from_address=Int(t.unsafe_ptr()))


def _out(t: OutputTensor[dtype=F32, ...]) -> F32P:
    return F32P(unsafe_from_address=Int(t.unsafe_ptr()))


def _matrix(t: InputTensor[rank=2, ...]) -> Pointer[Scalar[t.dtype], MutAnyOrigin]:
    return Pointer[Scalar[t.dtype], MutAnyOrigin](unsafe_from_address=Int(t.unsafe_ptr()))


@always_inline
def _as_input[WD: DType, n: Int](v: SIMD[F32, n]) -> SIMD[F32, n]:
    """v rounded to the weights' dtype: with bfloat16 weights the products see
    bfloat16 inputs and outputs, exactly as graphs/layers.py's `linear` (the path
    of larger batches), so a sample's tokens do not depend on its batch size."""
    comptime if WD == F32:
        return v
    else:
        return v.cast[WD]().cast[F32]()


@always_inline
def _rows[NB: Int, R: Int, U: Int, WD: DType](
    y: F32P, x: F32P, w: Pointer[Scalar[WD], MutAnyOrigin], bias: F32P, has_bias: Bool,
    j: Int, K: Int, N: Int,
):
    """y[b, j .. j+R) = x[b] . w[j .. j+R) (+ bias) for NB batch rows; w read once
    (float32 or bfloat16, widened to float32 in registers). U: independent
    accumulators per (row, batch) along k."""
    # one W-wide accumulator per (row, unroll, batch); a fixed-size stack array
    # with constant indices after unrolling, so it lives in registers
    var acc = stack_allocation[NB * R * U * W, Float32]()
    comptime for a in range(NB * R * U):
        acc.unsafe_store(a * W, SIMD[F32, W](0))
    var k = 0
    while k + U * W <= K:
        comptime for r in range(R):
            comptime for u in range(U):
                var wv = w.unsafe_load[width=W]((j + r) * K + k + u * W).cast[F32]()
                comptime for b in range(NB):
                    var xv = _as_input[WD](x.unsafe_load[width=W](b * K + k + u * W))
                    comptime a = ((r * U + u) * NB + b) * W
                    acc.unsafe_store(a, acc.unsafe_load[width=W](a) + wv * xv)
        k += U * W
    while k + W <= K:
        comptime for r in range(R):
            var wv = w.unsafe_load[width=W]((j + r) * K + k).cast[F32]()
            comptime for b in range(NB):
                var xv = _as_input[WD](x.unsafe_load[width=W](b * K + k))
                comptime a = (r * U * NB + b) * W
                acc.unsafe_store(a, acc.unsafe_load[width=W](a) + wv * xv)
        k += W
    comptime for r in range(R):
        comptime for b in range(NB):
            var s = SIMD[F32, W](0)
            comptime for u in range(U):
                s += acc.unsafe_load[width=W](((r * U + u) * NB + b) * W)
            var total = s.reduce_add()
            for kk in range(k, K):
                total += _as_input[WD, 1](x[unsafe_offset=b * K + kk]) * w[
                    unsafe_offset=(j + r) * K + kk
                ].cast[F32]()
            total = _as_input[WD, 1](total)  # the product's dtype, as MAX's matmul returns it
            if has_bias:
                total += bias[unsafe_offset=j + r]
            y[unsafe_offset=b * N + j + r] = total


def _matvec_nb[NB: Int, WD: DType](
    y: F32P, x: F32P, w: Pointer[Scalar[WD], MutAnyOrigin], bias: F32P, has_bias: Bool,
    K: Int, N: Int, j0: Int, j1: Int,
):
    """Rows j0 .. j1 of y for NB batch rows (j1 - j0 even unless j1 == N). Two weight
    rows at a time; up to 4 batch rows also two accumulators along k (16 registers
    either way at the largest NB)."""
    comptime U = 2 if NB <= 4 else 1
    var j = j0
    while j + 2 <= j1:
        _rows[NB, 2, U, WD](y, x, w, bias, has_bias, j, K, N)
        j += 2
    if j < j1:
        _rows[NB, 1, U, WD](y, x, w, bias, has_bias, j, K, N)


def _matvec_part[WD: DType](
    y: F32P, x: F32P, w: Pointer[Scalar[WD], MutAnyOrigin], bias: F32P, has_bias: Bool,
    B: Int, K: Int, N: Int, j0: Int, j1: Int,
):
    """Rows j0 .. j1 of y for all B batch rows, BLOCK batch rows per pass over w."""
    for b0 in range(0, B, BLOCK):
        var nb = min(BLOCK, B - b0)
        var yb = y.unsafe_offset(b0 * N)
        var xb = x.unsafe_offset(b0 * K)
        comptime for n in range(1, BLOCK + 1):
            if nb == n:
                _matvec_nb[n, WD](yb, xb, w, bias, has_bias, K, N, j0, j1)


def _matvec[WD: DType](
    y: F32P, x: F32P, w: Pointer[Scalar[WD], MutAnyOrigin], bias: F32P, has_bias: Bool,
    B: Int, K: Int, N: Int,
):
    """y [B, N] = x [B, K] @ w[N, K]^T (+ bias [N]), B in 1 .. MAX_BATCH.

    A product of PARALLEL_MIN multiply-adds or more is split in two halves of rows
    run side by side (one read stream per core: one core alone does not saturate
    the memory bandwidth); smaller ones are not worth the fork-join."""
    if B * N * K < PARALLEL_MIN or N < 4:
        _matvec_part[WD](y, x, w, bias, has_bias, B, K, N, 0, N)
        return
    var half = (N // 4) * 2  # even: each half runs whole row pairs

    def part(i: Int) {var y, var x, var w, var bias, var has_bias, var B, var K, var N, var half}:
        if i == 0:
            _matvec_part[WD](y, x, w, bias, has_bias, B, K, N, 0, half)
        else:
            _matvec_part[WD](y, x, w, bias, has_bias, B, K, N, half, N)

    sync_parallelize(part, 2)


def _layer_norm(y: F32P, x: F32P, g: F32P, b: F32P, eps: Float32, B: Int, d: Int):
    """Row-wise LayerNorm (biased variance, as torch) of x [B, d] into y."""
    for r in range(B):
        var o = r * d
        var s = SIMD[F32, W](0)
        var i = 0
        while i + W <= d:
            s += x.unsafe_load[width=W](o + i)
            i += W
        var mean = s.reduce_add()
        for t in range(i, d):
            mean += x[unsafe_offset=o + t]
        mean /= Float32(d)
        var q = SIMD[F32, W](0)
        i = 0
        while i + W <= d:
            var c = x.unsafe_load[width=W](o + i) - mean
            q += c * c
            i += W
        var var_ = q.reduce_add()
        for t in range(i, d):
            var c = x[unsafe_offset=o + t] - mean
            var_ += c * c
        var inv = 1 / sqrt(var_ / Float32(d) + eps)
        i = 0
        while i + W <= d:
            var v = (x.unsafe_load[width=W](o + i) - mean) * inv
            y.unsafe_store(o + i, v * g.unsafe_load[width=W](i) + b.unsafe_load[width=W](i))
            i += W
        for t in range(i, d):
            y[unsafe_offset=o + t] = (
                (x[unsafe_offset=o + t] - mean) * inv * g[unsafe_offset=t] + b[unsafe_offset=t]
            )


def _silu_inplace(p: F32P, n: Int):
    var i = 0
    while i + W <= n:
        var v = p.unsafe_load[width=W](i)
        p.unsafe_store(i, v / (1 + exp(-v)))
        i += W
    for t in range(i, n):
        var v = p[unsafe_offset=t]
        p[unsafe_offset=t] = v / (1 + exp(-v))


def _add_inplace(y: F32P, x: F32P, n: Int):
    """y += x."""
    var i = 0
    while i + W <= n:
        y.unsafe_store(i, y.unsafe_load[width=W](i) + x.unsafe_load[width=W](i))
        i += W
    for t in range(i, n):
        y[unsafe_offset=t] = y[unsafe_offset=t] + x[unsafe_offset=t]


def _check_batch(name: StaticString, B: Int) raises:
    if B < 1 or B > MAX_BATCH:
        raise Error(name, ": batch ", B, " outside 1 ..", MAX_BATCH)


@register("srm_decode_layer")
struct SrmDecodeLayer:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        x_out: OutputTensor[dtype=F32, rank=2, ...],
        new_state: OutputTensor[dtype=F32, rank=3, ...],
        scratch: OutputTensor[dtype=F32, rank=2, ...],
        x: InputTensor[dtype=F32, rank=2, ...],
        state: InputTensor[dtype=F32, rank=3, ...],
        positions: InputTensor[dtype=DType.int64, rank=1, ...],
        cn_w: InputTensor[dtype=F32, rank=1, ...],
        cn_b: InputTensor[dtype=F32, rank=1, ...],
        fc1_w: InputTensor[rank=2, ...],
        fc1_b: InputTensor[dtype=F32, rank=1, ...],
        fc2_w: InputTensor[dtype=fc1_w.dtype, rank=2, ...],
        fc2_b: InputTensor[dtype=F32, rank=1, ...],
        tn_w: InputTensor[dtype=F32, rank=1, ...],
        tn_b: InputTensor[dtype=F32, rank=1, ...],
        proj_w: InputTensor[dtype=fc1_w.dtype, rank=2, ...],
        proj_b: InputTensor[dtype=F32, rank=1, ...],
        w: InputTensor[dtype=F32, rank=2, ...],
        beta: InputTensor[dtype=F32, rank=2, ...],
        lam: InputTensor[dtype=F32, rank=1, ...],
        out_w: InputTensor[dtype=fc1_w.dtype, rank=2, ...],
        out_b: InputTensor[dtype=F32, rank=1, ...],
        eps: InputTensor[dtype=F32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("srm_decode_layer: CPU only")
        var B = x.dim_size(0)
        var d = x.dim_size(1)
        var H = state.dim_size(1)
        var hd = state.dim_size(2)
        var f = fc1_w.dim_size(0)
        var n = w.dim_size(1)
        _check_batch("srm_decode_layer", B)
        if H * hd != d or fc1_w.dim_size(1) != d or fc2_w.dim_size(0) != d or (
            fc2_w.dim_size(1) != f
        ):
            raise Error("srm_decode_layer: inconsistent shapes")
        if w.dim_size(0) != H or beta.dim_size(0) != H or lam.dim_size(0) != H:
            raise Error("srm_decode_layer: w, beta, lam must have H rows")
        if scratch.dim_size(1) < f + 2 * d:
            raise Error("srm_decode_layer: scratch too small")
        var xo = _out(x_out)
        var so = _out(new_state)
        var hf = _out(scratch)  # [B, f]
        var z = hf.unsafe_offset(B * f)  # [B, d]
        var u = z.unsafe_offset(B * d)  # [B, d]
        var e = eps[0]

        # channel MLP: x_out = x + fc2 silu(fc1 LN(x) + b1) + b2
        _layer_norm(z, _in(x), _in(cn_w), _in(cn_b), e, B, d)
        _matvec(hf, z, _matrix(fc1_w), _in(fc1_b), True, B, d, f)
        _silu_inplace(hf, B * f)
        _matvec(xo, hf, _matrix(fc2_w), _in(fc2_b), True, B, f, d)
        _add_inplace(xo, _in(x), B * d)

        # token mixer: u = proj LN(x_out) + b; recurrent step; z = y
        _layer_norm(z, xo, _in(tn_w), _in(tn_b), e, B, d)
        _matvec(u, z, _matrix(proj_w), _in(proj_b), True, B, d, d)
        var half = H // 2
        var sp = _in(state)
        for b in range(B):
            var t = Int(positions[b])
            if t < 0 or t >= n:
                raise Error("srm_decode_layer: position ", t, " outside [0, ", n, ")")
            for h in range(H):
                var l = lam[h]
                var wt = w[h, t]
                var bt = beta[h, t]
                for i in range(hd):
                    var o = (b * H + h) * hd + i
                    var ui = u[unsafe_offset=b * d + h * hd + i]
                    var s = sp[unsafe_offset=o]
                    var yv: Float32
                    if h < half:
                        s = ui + l * s
                        yv = wt * s + bt
                    else:
                        s = wt * ui + l * s
                        yv = s + bt
                    so[unsafe_offset=o] = s
                    z[unsafe_offset=b * d + h * hd + i] = yv

        # x_out += out y + out_b
        _matvec(u, z, _matrix(out_w), _in(out_b), True, B, d, d)
        _add_inplace(xo, u, B * d)


@register("srm_linear_small")
struct SrmLinearSmall:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[dtype=F32, rank=2, ...],
        x: InputTensor[dtype=F32, rank=2, ...],
        w: InputTensor[rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("srm_linear_small: CPU only")
        var B = x.dim_size(0)
        var K = x.dim_size(1)
        var N = w.dim_size(0)
        _check_batch("srm_linear_small", B)
        if w.dim_size(1) != K or y.dim_size(1) != N:
            raise Error("srm_linear_small: inconsistent shapes")
        var yp = _out(y)
        _matvec(yp, _in(x), _matrix(w), yp, False, B, K, N)
