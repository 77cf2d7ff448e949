"""A dense layer on the CPU through the register-tiled product (mojo/tiled_product.mojo).

    srm_linear(x [R, K] f32, w [N, K] f32 or bf16, b [N] f32) -> y [R, N] f32

y[r, n] = sum_k x[r, k] * w[n, k] + b[n]: ``w`` as the checkpoint stores it, one row per
output. x and w must be row-major. A bfloat16 PHA prefill the decode op cannot run (hence
without the packed copies mojo/linear_packed.mojo reads) runs its dense layers and its
scored rows' output layer through it on a CPU (graphs/ops.py ``linear``,
graphs/pha/prefill.py ``dense_op_device``), where MAX's bfloat16 matmul is far slower. With bfloat16 weights the
sum (float32, over the widened weights) is rounded to bfloat16 before the bias, as MAX's
bfloat16 matmul returns it; the caller rounds x (``linear`` does).

How: w is packed into panels of NB outputs (zero past N) once per call, shared by the
workers; each worker (one per core) takes blocks of BLOCK_ROWS rows from a shared
counter and, per panel, computes the block's MR-row tiles into a small tile in the
first-level cache, then adds the bias and stores the columns below N. Rows past R in the
last tile are read from a zero-padded copy, so every tile has MR rows to read.

A call with fewer than MR rows (a prefill's output layer at each prompt's last token)
skips the packing, which would read and write all of w for a product that reads it
once: each worker takes blocks of ROW_BLOCK outputs and computes each output's R dot
products along w's row, so w streams from memory once.
"""
from std.atomic import Atomic
from std.memory import stack_allocation
from std.sys import num_physical_cores

from extensibility import InputTensor, OutputTensor, register
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from .decode_step import _rnd
from .tiled_product import MR, NB, NV, W, pack_panel, tile_product

comptime F32 = DType.float32
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
# rows per block: the block's rows of x (BLOCK_ROWS x K floats, 15 KiB at K = 256 with
# AVX2) stay in the first-level cache while each panel is reused for its BLOCK_ROWS / MR tiles
comptime BLOCK_ROWS = 3 * MR
comptime MAX_WORKERS = 8
# outputs per work item of the few-rows path (a 64 KiB share of w at K = 256)
comptime ROW_BLOCK = 64


@always_inline
def _few_rows[WD: DType](y: F32P, x: F32P, w: Pointer[Scalar[WD], MutUntrackedOrigin], b: F32P, R: Int, K: Int,
                         N: Int, n0: Int, n1: Int):
    """y[r, n] = sum_k x[r, k] * w[n, k] (in the weights' dtype) + b[n] for r < R < MR and
    n0 <= n < n1: one vector accumulator per row, w's row read once for all R rows."""
    var acc = stack_allocation[MR * W, Float32]()
    for n in range(n0, n1):
        var wr = w.unsafe_offset(n * K)
        for r in range(R):
            acc.unsafe_store(r * W, SIMD[F32, W](0))
        var k = 0
        while k + W <= K:
            var wv = wr.unsafe_load[width=W](k).cast[F32]()
            for r in range(R):
                acc.unsafe_store(r * W, x.unsafe_load[width=W](r * K + k).fma(wv, acc.unsafe_load[width=W](r * W)))
            k += W
        for r in range(R):
            var total = acc.unsafe_load[width=W](r * W).reduce_add()
            for kk in range(k, K):
                total += x[unsafe_offset=r * K + kk] * wr[unsafe_offset=kk].cast[F32]()
            y[unsafe_offset=r * N + n] = _rnd[WD, 1](total) + b[unsafe_offset=n]


@always_inline
def _store_tile[WD: DType](y: F32P, N: Int, row0: Int, rows: Int, col0: Int, t: F32P, bias: F32P):
    """y[row0 + r, col0 + j] = t[r, j] (in the weights' dtype) + bias[j] for r < rows and
    col0 + j < N (t is [MR, NB], bias the panel's NB biases, zero past N)."""
    var cols = min(NB, N - col0)
    for r in range(rows):
        var out = y.unsafe_offset((row0 + r) * N + col0)
        if cols == NB:
            comptime for v in range(NV):
                var s = _rnd[WD](t.unsafe_load[width=W](r * NB + v * W))
                out.unsafe_store(v * W, s + bias.unsafe_load[width=W](v * W))
        else:
            for j in range(cols):
                out[unsafe_offset=j] = _rnd[WD, 1](t.unsafe_load[width=1](r * NB + j)) + bias[unsafe_offset=j]


@register("srm_linear")
struct SrmLinear:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w: InputTensor[rank=2, ...],
        b: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime WD = w.dtype
        comptime WP = Pointer[Scalar[WD], MutUntrackedOrigin]
        comptime if target != "cpu":
            raise Error("srm_linear: CPU only")
        comptime if WD != F32 and WD != DType.bfloat16:
            raise Error("srm_linear: float32 or bfloat16 weights only")
        var R = x.dim_size(0)
        var K = x.dim_size(1)
        var N = w.dim_size(0)
        if w.dim_size(1) != K:
            raise Error("srm_linear: w is [", N, ", ", w.dim_size(1), "] but x has width ", K)
        if b.dim_size(0) != N:
            raise Error("srm_linear: b has ", b.dim_size(0), " entries for ", N, " outputs")
        if y.dim_size(0) != R or y.dim_size(1) != N:
            raise Error("srm_linear: y must be [", R, ", ", N, "]")
        if R == 0 or N == 0:
            return
        if R < MR:
            var xs = F32P(unsafe_from_address=Int(x.unsafe_ptr()))
            var ws = WP(unsafe_from_address=Int(w.unsafe_ptr()))
            var bs = F32P(unsafe_from_address=Int(b.unsafe_ptr()))
            var ys = F32P(unsafe_from_address=Int(y.unsafe_ptr()))
            var items = (N + ROW_BLOCK - 1) // ROW_BLOCK

            def few(item: Int) {var ys, var xs, var ws, var bs, var R, var K, var N}:
                _few_rows[WD](ys, xs, ws, bs, R, K, N, item * ROW_BLOCK, min(N, (item + 1) * ROW_BLOCK))

            sync_parallelize(few, items)
            return
        var panels = (N + NB - 1) // NB
        var packed_store = List[Float32](length=panels * K * NB, fill=0)
        var packed = F32P(unsafe_from_address=Int(packed_store.unsafe_ptr()))
        var w_in = WP(unsafe_from_address=Int(w.unsafe_ptr()))

        def pack(panel: Int) {var packed, var w_in, var N, var K}:
            pack_panel[WD](packed, w_in, panel, N, K)

        sync_parallelize(pack, panels)

        var bias_store = List[Float32](length=panels * NB, fill=0)
        for n in range(N):
            bias_store[n] = b[n]
        var bias = F32P(unsafe_from_address=Int(bias_store.unsafe_ptr()))
        var x_in = F32P(unsafe_from_address=Int(x.unsafe_ptr()))
        var y_out = F32P(unsafe_from_address=Int(y.unsafe_ptr()))
        var blocks = (R + BLOCK_ROWS - 1) // BLOCK_ROWS
        var workers = min(num_physical_cores(), MAX_WORKERS, blocks)
        var next_block = List[Int64](length=1, fill=0)
        var counter = I64P(unsafe_from_address=Int(next_block.unsafe_ptr()))

        def work(worker: Int) {
            var packed, var bias, var x_in, var y_out, var counter, var R, var K, var N, var panels, var blocks
        }:
            # the last tile's rows of x, zero past R
            var tail_store = List[Float32](length=MR * K, fill=0)
            var tail = F32P(unsafe_from_address=Int(tail_store.unsafe_ptr()))
            var t = F32P(unsafe_from_address=Int(stack_allocation[MR * NB, Float32]()))
            while True:
                var block = Int(Atomic[Int64].fetch_add(counter, 1))
                if block >= blocks:
                    break
                var first = block * BLOCK_ROWS
                var n = min(BLOCK_ROWS, R - first)
                var tiles = (n + MR - 1) // MR
                var full = n // MR  # tiles with MR rows of x
                if full < tiles:
                    var r0 = first + full * MR
                    for i in range(MR * K):
                        tail[unsafe_offset=i] = x_in[unsafe_offset=r0 * K + i] if i < (R - r0) * K else 0
                for panel in range(panels):
                    var p = packed.unsafe_offset(panel * K * NB)
                    for g in range(tiles):
                        var row0 = first + g * MR
                        var src = x_in.unsafe_offset(row0 * K) if g < full else tail
                        tile_product(t, NB, src, K, p, K)
                        _store_tile[WD](y_out, N, row0, min(MR, R - row0), panel * NB, t, bias.unsafe_offset(panel * NB))
            _ = tail_store^

        sync_parallelize(work, workers)
        _ = packed_store^
        _ = bias_store^
        _ = next_block^
