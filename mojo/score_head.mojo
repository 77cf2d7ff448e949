"""The score graph's output layer and per-position reduction in one op, CPU
(graphs/scoring.py).

    srm_score_head(x [R, d] f32, head [V, d] f32, targets [R] int64)
        -> logprobs [R] f32, top_values [R, K] f32, top_ids [R, K] int64

The logits of row r are logits[r, v] = sum_k x[r, k] * head[v, k] (the output layer,
``head`` as the checkpoint stores it: one row per token); the outputs are then exactly
srm_score_rows' on those logits (mojo/score_rows.mojo: the target's log-probability, the
K largest log-probabilities descending, ties to the lower id; K is the outputs' width,
1 <= K <= V; a target outside [0, V) raises). x and head must be row-major.

Why one op: the matmul and the row op apart write all [R, V] logits to memory and read
them back (a GiB at 64 texts of 1,000 tokens and V = 4,096). Here a block of BLOCK_ROWS
rows is computed into a scratch tile of BLOCK_ROWS x V (a few hundred KiB, in the
core's second-level cache) and reduced from there at once.

How: the head is first packed into panels of NB = NV * W tokens, each panel [d, NB]
(k-major, zero past V), so that a register tile of MR rows x NV vectors streams one
panel front to back: per k, NV vector loads, MR broadcasts of x, MR * NV FMAs into
accumulators that stay in registers (MR x NV per SIMD width: 5 x 2 with AVX2's 16
registers, 6 x 4 with AVX-512's 32). Each worker (one per core) takes blocks of rows
from a shared counter and keeps its own scratch, so nothing is allocated per block.
"""
from std.atomic import Atomic
from std.memory import stack_allocation
from std.sys import num_physical_cores, simd_width_of

from extensibility import InputTensor, OutputTensor, register
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from .score_rows import DEPTH, TopList, score_row

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
# A register tile: MR rows x NV vectors of tokens. MR * NV accumulators, NV weight
# vectors and one broadcast fit in the vector registers (AVX2 16: 5 x 2 uses 13, and at
# 6 x 2 the compiler keeps an accumulator on the stack; AVX-512 32: 6 x 4 uses 29).
comptime NV = 2 if W == 8 else 4
comptime MR = 5 if W == 8 else 6
comptime NB = NV * W  # tokens per packed panel
# rows per block: its scratch (BLOCK_ROWS x V floats: 320 KiB at V = 4,096 with AVX2)
# stays in a core's second-level cache while a panel is reused for BLOCK_ROWS / MR tiles
comptime BLOCK_ROWS = 4 * MR
comptime KU = 4  # k unrolled
comptime MAX_WORKERS = 8


@always_inline
def _tile(t: F32P, ldt: Int, x: F32P, ldx: Int, p: F32P, d: Int):
    """t[r, 0 .. NB) = sum_k x[r, k] * p[k, 0 .. NB) for MR rows (x's rows ldx apart, t's
    ldt apart); p is one packed panel [d, NB]. The accumulators are a fixed-size stack
    array indexed by constants after unrolling, which the compiler keeps in registers."""
    var acc = stack_allocation[MR * NV * W, Float32]()
    var wv = stack_allocation[NV * W, Float32]()
    comptime for a in range(MR * NV):
        acc.unsafe_store(a * W, SIMD[F32, W](0))
    var k = 0
    while k + KU <= d:
        comptime for kk in range(KU):
            var wp = p.unsafe_offset((k + kk) * NB)
            comptime for v in range(NV):
                wv.unsafe_store(v * W, wp.unsafe_load[width=W](v * W))
            comptime for r in range(MR):
                var xb = SIMD[F32, W](x[unsafe_offset=r * ldx + k + kk])
                comptime for v in range(NV):
                    comptime a = (r * NV + v) * W
                    acc.unsafe_store(a, xb.fma(wv.unsafe_load[width=W](v * W), acc.unsafe_load[width=W](a)))
        k += KU
    while k < d:
        var wp = p.unsafe_offset(k * NB)
        comptime for r in range(MR):
            var xb = SIMD[F32, W](x[unsafe_offset=r * ldx + k])
            comptime for v in range(NV):
                comptime a = (r * NV + v) * W
                acc.unsafe_store(a, xb.fma(wp.unsafe_load[width=W](v * W), acc.unsafe_load[width=W](a)))
        k += 1
    comptime for r in range(MR):
        comptime for v in range(NV):
            t.unsafe_store(r * ldt + v * W, acc.unsafe_load[width=W]((r * NV + v) * W))


def _pack_panel(packed: F32P, head: F32P, panel: Int, V: Int, d: Int):
    """Panel ``panel`` of the head: packed[panel][k, j] = head[panel * NB + j, k], 0 past V."""
    var out = packed.unsafe_offset(panel * d * NB)
    for j in range(NB):
        var v = panel * NB + j
        if v < V:
            var src = head.unsafe_offset(v * d)
            for k in range(d):
                out[unsafe_offset=k * NB + j] = src[unsafe_offset=k]
        else:
            for k in range(d):
                out[unsafe_offset=k * NB + j] = 0


@register("srm_score_head")
struct SrmScoreHead:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        logprobs: OutputTensor[dtype=DType.float32, rank=1, ...],
        top_values: OutputTensor[dtype=DType.float32, rank=2, ...],
        top_ids: OutputTensor[dtype=DType.int64, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        head: InputTensor[dtype=DType.float32, rank=2, ...],
        targets: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("srm_score_head: CPU only")
        var R = x.dim_size(0)
        var d = x.dim_size(1)
        var V = head.dim_size(0)
        var K = top_values.dim_size(1)
        if head.dim_size(1) != d:
            raise Error("srm_score_head: head is [V, ", head.dim_size(1), "] but x has width ", d)
        if targets.dim_size(0) != R or logprobs.dim_size(0) != R:
            raise Error("srm_score_head: targets and logprobs need one entry per row of x")
        if top_values.dim_size(0) != R or top_ids.dim_size(0) != R or top_ids.dim_size(1) != K:
            raise Error("srm_score_head: top_values and top_ids must both be [R, K]")
        if K < 1 or K > V:
            raise Error("srm_score_head: K=", K, " must be 1 to the vocabulary size ", V)
        for r in range(R):
            var t = Int(targets[r])
            if t < 0 or t >= V:
                raise Error("srm_score_head: row ", r, " has target ", t, " outside [0, ", V, ")")
        if R == 0:
            return
        var panels = (V + NB - 1) // NB
        var Vp = panels * NB  # a scratch row: V logits, then the padded panel's zeros
        var packed_store = List[Float32](length=panels * d * NB, fill=0)
        var packed = F32P(unsafe_from_address=Int(packed_store.unsafe_ptr()))
        var head_in = F32P(unsafe_from_address=Int(head.unsafe_ptr()))

        def pack(panel: Int) {var packed, var head_in, var V, var d}:
            _pack_panel(packed, head_in, panel, V, d)

        sync_parallelize(pack, panels)

        var x_in = F32P(unsafe_from_address=Int(x.unsafe_ptr()))
        var lp_out = F32P(unsafe_from_address=Int(logprobs.unsafe_ptr()))
        var values_out = F32P(unsafe_from_address=Int(top_values.unsafe_ptr()))
        var ids_out = I64P(unsafe_from_address=Int(top_ids.unsafe_ptr()))
        var tg = I64P(unsafe_from_address=Int(targets.unsafe_ptr()))
        var blocks = (R + BLOCK_ROWS - 1) // BLOCK_ROWS
        var workers = min(num_physical_cores(), MAX_WORKERS, blocks)
        var next_block = List[Int64](length=1, fill=0)
        var counter = I64P(unsafe_from_address=Int(next_block.unsafe_ptr()))

        def work(worker: Int) {
            var packed, var x_in, var lp_out, var values_out, var ids_out, var tg, var counter,
            var R, var d, var V, var Vp, var K, var panels, var blocks
        }:
            var scratch_store = List[Float32](length=BLOCK_ROWS * Vp, fill=0)
            var scratch = F32P(unsafe_from_address=Int(scratch_store.unsafe_ptr()))
            # the block's rows of x, zero past R, so that every tile has MR rows to read
            var rows_store = List[Float32](length=BLOCK_ROWS * d, fill=0)
            var rows = F32P(unsafe_from_address=Int(rows_store.unsafe_ptr()))
            var top = TopList(K)
            var lanes = F32P(unsafe_from_address=Int(stack_allocation[W * DEPTH, Float32]()))
            while True:
                var block = Int(Atomic[Int64].fetch_add(counter, 1))
                if block >= blocks:
                    break
                var first = block * BLOCK_ROWS
                var n = min(BLOCK_ROWS, R - first)
                for i in range(BLOCK_ROWS * d):
                    rows[unsafe_offset=i] = x_in[unsafe_offset=first * d + i] if i < n * d else 0
                var tiles = (n + MR - 1) // MR
                for panel in range(panels):
                    var p = packed.unsafe_offset(panel * d * NB)
                    for g in range(tiles):
                        _tile(scratch.unsafe_offset(g * MR * Vp + panel * NB), Vp, rows.unsafe_offset(g * MR * d),
                              d, p, d)
                for i in range(n):
                    var r = first + i
                    score_row(scratch.unsafe_offset(i * Vp), V, Int(tg[unsafe_offset=r]), top, lanes,
                              lp_out.unsafe_offset(r), values_out.unsafe_offset(r * K), ids_out.unsafe_offset(r * K))
            _ = scratch_store^
            _ = rows_store^

        sync_parallelize(work, workers)
        _ = packed_store^
        _ = next_block^
