"""The output layer and the per-position reduction of a prefill's scored rows in one op, CPU
(graphs/scoring.py).

    srm_score_head(x [R, d] f32, mats [S] f32 or bf16, head_at [2] int64, targets [R] int64)
        -> logprobs [R] f32, top_values [R, K] f32, top_ids [R, K] int64

The logits of row r are logits[r, v] = sum_k x[r, k] * head[v, k] (the output layer, one
row per token), where head [V, d] is the matrix packed at element ``head_at[0]`` of
``mats`` and V = ``head_at[1]``: the engines' packed copy of it, made at load for their
decode ops in the weights' dtype (srm_max/models/srm/packing.py ``pack_matrix``'s layout,
the one mojo/linear_packed.mojo reads). With bfloat16 copies each logit is rounded to
bfloat16, as MAX's bfloat16 matmul returns it; the caller rounds x. The outputs are then
exactly srm_score_rows' on those logits (mojo/score_rows.mojo: the target's
log-probability, the K largest log-probabilities descending, ties to the lower id; K is
the outputs' width, 1 <= K <= V; a target outside [0, V) raises). x must be row-major.

Why one op: the matmul and the row op apart write all [R, V] logits to memory and read
them back (a GiB at 64 texts of 1,000 tokens and V = 4,096). Here a block of BLOCK_ROWS
rows is computed into a scratch tile of BLOCK_ROWS x V (a few hundred KiB, in the
core's second-level cache) and reduced from there at once.

How: each block's logits are computed a register tile at a time (mojo/tiled_product.mojo),
reading the packed head's panels of NB tokens in place, as srm_linear_packed does: no
call packs the head (a copy of every weight of a 32,000-token vocabulary, written on each
call, would cost a short text's score several times its product). Each worker (one per
core) takes blocks of rows from a shared counter and keeps its own scratch, so nothing is
allocated per block. With fewer blocks than cores (a short text: up to BLOCK_ROWS rows
would leave a core idle) the cores split the head's panels for all the rows instead, into
one shared scratch, then the rows' reductions.
"""
from std.atomic import Atomic
from std.memory import stack_allocation
from std.sys import num_physical_cores

from extensibility import InputTensor, OutputTensor, register
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from .decode_step import _padded, _rnd
from .linear_packed import narrow_last_panel, panel_at
from .score_rows import DEPTH, TopList, score_row
from .tiled_product import MR, NB, W, tile_product

comptime F32 = DType.float32
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
# rows per block: its scratch (BLOCK_ROWS x V floats: 320 KiB at V = 4,096 with AVX2)
# stays in a core's second-level cache while a panel is reused for BLOCK_ROWS / MR tiles
comptime BLOCK_ROWS = 4 * MR
comptime MAX_WORKERS = 8


@always_inline
def _panel_logits[MD: DType](scratch: F32P, Vp: Int, rows: F32P, tiles: Int, d: Int,
                             w: Pointer[Scalar[MD], MutUntrackedOrigin],
                             narrow: Pointer[Scalar[MD], MutUntrackedOrigin], panel: Int, Np: Int):
    """The logits of ``tiles`` register tiles of rows (MR rows each, d apart from ``rows``)
    for the tokens of panel ``panel`` of the packed head, into scratch (rows Vp apart)."""
    var p = panel_at[MD](w, narrow, panel, Np, d)
    for g in range(tiles):
        tile_product(scratch.unsafe_offset(g * MR * Vp + panel * NB), Vp, rows.unsafe_offset(g * MR * d), d, p[0], d,
                     p[1])


@always_inline
def _scored_row[MD: DType](row: F32P, Vp: Int, V: Int, target: Int, mut top: TopList, lanes: F32P, logprob: F32P,
                           values: F32P, ids: I64P):
    """``score_row`` on a row of logits, first rounded to bfloat16 where the head is, as a
    bfloat16 product returns them."""
    comptime if MD != F32:
        for i in range(Vp // W):
            row.unsafe_store(i * W, _rnd[MD](row.unsafe_load[width=W](i * W)))
    score_row(row, V, target, top, lanes, logprob, values, ids)


def _few_rows[MD: DType](lp_out: F32P, values_out: F32P, ids_out: I64P, x_in: F32P, tg: I64P,
                         w: Pointer[Scalar[MD], MutUntrackedOrigin], narrow: Pointer[Scalar[MD], MutUntrackedOrigin],
                         R: Int, d: Int, V: Int, Np: Int, K: Int, cores: Int):
    """The op for fewer rows than the cores have blocks to take: the cores split the head's
    panels for all R rows (the logits of every row, R x Vp floats, in one shared scratch),
    then the rows' reductions."""
    var panels = (Np + NB - 1) // NB
    var Vp = panels * NB
    var tiles = (R + MR - 1) // MR
    var rows_store = List[Float32](length=tiles * MR * d, fill=0)  # x, zero past R
    for i in range(R * d):
        rows_store[i] = x_in[unsafe_offset=i]
    var rows = F32P(unsafe_from_address=Int(rows_store.unsafe_ptr()))
    var scratch_store = List[Float32](length=tiles * MR * Vp, fill=0)
    var scratch = F32P(unsafe_from_address=Int(scratch_store.unsafe_ptr()))
    var groups = min(panels, 4 * cores)  # shares of the panels, a few per core for balance

    def product(group: Int) {var w, var narrow, var rows, var scratch, var d, var Np, var Vp, var panels, var tiles,
                             var groups}:
        for panel in range(group * panels // groups, (group + 1) * panels // groups):
            _panel_logits[MD](scratch, Vp, rows, tiles, d, w, narrow, panel, Np)

    sync_parallelize(product, groups)

    def reduce(r: Int) {var scratch, var lp_out, var values_out, var ids_out, var tg, var V, var Vp, var K}:
        var top = TopList(K)
        var lanes = F32P(unsafe_from_address=Int(stack_allocation[W * DEPTH, Float32]()))
        _scored_row[MD](scratch.unsafe_offset(r * Vp), Vp, V, Int(tg[unsafe_offset=r]), top, lanes,
                        lp_out.unsafe_offset(r), values_out.unsafe_offset(r * K), ids_out.unsafe_offset(r * K))

    sync_parallelize(reduce, R)
    _ = rows_store^
    _ = scratch_store^


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
        mats: InputTensor[rank=1, ...],
        head_at: InputTensor[dtype=DType.int64, rank=1, ...],
        targets: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime MD = mats.dtype
        comptime MP = Pointer[Scalar[MD], MutUntrackedOrigin]
        comptime if target != "cpu":
            raise Error("srm_score_head: CPU only")
        comptime if MD != F32 and MD != DType.bfloat16:
            raise Error("srm_score_head: float32 or bfloat16 matrices only")
        var R = x.dim_size(0)
        var d = x.dim_size(1)
        var K = top_values.dim_size(1)
        if head_at.dim_size(0) != 2:
            raise Error("srm_score_head: head_at must hold an offset and a vocabulary size, got ",
                        head_at.dim_size(0), " entries")
        if targets.dim_size(0) != R or logprobs.dim_size(0) != R:
            raise Error("srm_score_head: targets and logprobs need one entry per row of x")
        if top_values.dim_size(0) != R or top_ids.dim_size(0) != R or top_ids.dim_size(1) != K:
            raise Error("srm_score_head: top_values and top_ids must both be [R, K]")
        if R == 0:
            return
        var head_first = Int(head_at[0])
        var V = Int(head_at[1])
        var Np = _padded(V)
        if V < 1 or head_first < 0 or head_first + Np * d > mats.dim_size(0):
            raise Error("srm_score_head: a packed [", V, ", ", d, "] head at ", head_first, " does not fit in mats of ",
                        mats.dim_size(0))
        if K < 1 or K > V:
            raise Error("srm_score_head: K=", K, " must be 1 to the vocabulary size ", V)
        for r in range(R):
            var t = Int(targets[r])
            if t < 0 or t >= V:
                raise Error("srm_score_head: row ", r, " has target ", t, " outside [0, ", V, ")")
        var w = MP(unsafe_from_address=Int(mats.unsafe_ptr())).unsafe_offset(head_first)
        var narrow_store = narrow_last_panel[MD](w, Np, d)
        var narrow = MP(unsafe_from_address=Int(narrow_store.unsafe_ptr()))
        var panels = (Np + NB - 1) // NB
        var Vp = panels * NB  # a scratch row: V logits, then the padded panel's zeros
        var x_in = F32P(unsafe_from_address=Int(x.unsafe_ptr()))
        var lp_out = F32P(unsafe_from_address=Int(logprobs.unsafe_ptr()))
        var values_out = F32P(unsafe_from_address=Int(top_values.unsafe_ptr()))
        var ids_out = I64P(unsafe_from_address=Int(top_ids.unsafe_ptr()))
        var tg = I64P(unsafe_from_address=Int(targets.unsafe_ptr()))
        var blocks = (R + BLOCK_ROWS - 1) // BLOCK_ROWS
        var cores = min(num_physical_cores(), MAX_WORKERS)
        if blocks < cores:  # too few blocks to keep every core busy: they split the head instead
            _few_rows[MD](lp_out, values_out, ids_out, x_in, tg, w, narrow, R, d, V, Np, K, cores)
            _ = narrow_store^
            return
        var workers = min(cores, blocks)
        var next_block = List[Int64](length=1, fill=0)
        var counter = I64P(unsafe_from_address=Int(next_block.unsafe_ptr()))

        def work(worker: Int) {
            var w, var narrow, var x_in, var lp_out, var values_out, var ids_out, var tg, var counter,
            var R, var d, var V, var Np, var Vp, var K, var panels, var blocks
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
                    _panel_logits[MD](scratch, Vp, rows, tiles, d, w, narrow, panel, Np)
                for i in range(n):
                    var r = first + i
                    _scored_row[MD](scratch.unsafe_offset(i * Vp), Vp, V, Int(tg[unsafe_offset=r]), top, lanes,
                                    lp_out.unsafe_offset(r), values_out.unsafe_offset(r * K),
                                    ids_out.unsafe_offset(r * K))
            _ = scratch_store^
            _ = rows_store^

        sync_parallelize(work, workers)
        _ = narrow_store^
        _ = next_block^
