"""A dense layer on the CPU whose weight is already packed: one matrix of the decode ops'
flat array of packed matrices, read in place.

    srm_linear_packed(x [R, K] f32, mats [S] f32 or bf16, layer [2] int64, b [N] f32,
                      scale [R, N] or [0, 0] f32) -> y [R, N] f32

y[r, n] = act(sum_k x[r, k] * w[n, k] + b[n]) (* scale[r, n] where scale is not empty),
where w [N, K] is the matrix packed at element ``layer[0]`` of ``mats`` as
srm_max/models/srm/packing.py ``pack_matrix`` packs it: its rows padded with zeros to a
multiple of PAD, then panels of PANEL output columns, each its [K, width] transpose
(width PANEL, the last one what is left), and act is the identity (``layer[1]`` = 0),
the exact GELU (1) or SiLU (2). The activation and the product by scale (the PHA's GSS
gate) are applied to each tile in the first-level cache: each saves the graph a pass
over y. With bfloat16 matrices the sum (float32, over the widened weights) is rounded to
bfloat16 before the bias, as MAX's bfloat16 matmul and ``srm_linear`` return it; the
caller rounds x. The SRM and PHA engines pack every matrix so once at load for their
decode ops, in the weights' dtype (srm_max/models/srm/packing.py,
srm_max/models/pha/packing.py); their prefills run their dense layers through this op on
the same arrays, so no call packs anything (``srm_linear`` packs its weight on every
call, which costs a short prompt more than the product saves).

How: the register-tiled product (mojo/tiled_product.mojo) reads a panel of NB columns in
place, its rows ``width`` entries apart, widening bfloat16 weights as it loads them (a
copy widened ahead would cost a pass over the panel for every block of rows): NB is
PANEL with AVX-512, so a panel is one tile's columns, and a quarter of one with AVX2
(NB = 16, PAD). Only the last panel of a matrix can be narrower than NB (AVX-512, an
output count that is not a multiple of PANEL); it is copied once per call into a
zero-padded panel. Work items are a block of rows against a group of panels, taken from
a shared counter by one worker per core; an item runs each of its panels over every tile
of its block, so a panel comes in from the outer caches once per block (``_work_plan``
sizes both). Rows past R in a block's last tile are read from a zero-padded copy.
"""
from std.atomic import Atomic
from std.math import ceildiv
from std.memory import stack_allocation
from std.sys import num_physical_cores

from extensibility import InputTensor, OutputTensor, register
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

from .decode_step import PANEL, _padded, _rnd, _silu
from .linear import MAX_WORKERS
from .pha_decode_step import _gelu
from .tiled_product import MR, NB, W, tile_product

comptime F32 = DType.float32
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
comptime ACT_NONE = 0  # graphs/ops.py ``ACTIVATIONS``
comptime ACT_GELU = 1
comptime ACT_SILU = 2
# Tiles of MR rows per block of rows. A block runs each panel of its item over all of its
# tiles, so each call reads the matrix from the outer caches once per block: with AVX2's
# 5-row tiles, blocks of 3 tiles read a prefill's larger matrices from the last-level cache
# every 15 rows (they exceed the Zen 3 EPYC's 512 KiB second-level cache), blocks of 12
# every 60, while a block's rows of x (60 x K floats) still fit that cache
# (docs/pha_engine.md). AVX-512 keeps the 3-tile blocks its products were measured with.
comptime BLOCK_TILES = 12 if W == 8 else 3
comptime ITEMS_PER_WORKER = 8  # items claimed per worker: enough that the last ones even out the workers


def _work_plan(R: Int, panels: Int, workers: Int) -> Tuple[Int, Int]:
    """(rows per block, panels per item) for R rows of x and ``panels`` panels: blocks of
    BLOCK_TILES tiles against every panel where that makes ITEMS_PER_WORKER items per
    worker; else fewer panels per item, halved until it does or one is left, then fewer
    tiles per block (a few rows, a short prompt's or a prefill's last-token logits, still
    spread their columns over the cores)."""
    var rows = BLOCK_TILES * MR
    var per_item = panels
    var wanted = ITEMS_PER_WORKER * workers
    while ceildiv(R, rows) * ceildiv(panels, per_item) < wanted and per_item > 1:
        per_item = ceildiv(per_item, 2)
    while ceildiv(R, rows) * ceildiv(panels, per_item) < wanted and rows > MR:
        rows -= MR
    return (rows, per_item)


@always_inline
def _panel_start(c0: Int, Np: Int, K: Int) -> Tuple[Int, Int, Bool]:
    """Where the columns c0 .. c0 + NB of a packed matrix with Np padded outputs are:
    (their first element's offset from the matrix's start, the stride of their panel's
    rows, whether all NB lie in that panel)."""
    var q = c0 // PANEL
    var s = c0 - q * PANEL
    var width = min(PANEL, Np - q * PANEL)
    return (q * PANEL * K + s, width, s + NB <= width)


def narrow_last_panel[MD: DType](w: Pointer[Scalar[MD], MutUntrackedOrigin], Np: Int, K: Int) -> List[Scalar[MD]]:
    """The last panel of the packed matrix at w (Np padded outputs of K inputs), copied and
    zero-padded to NB columns where it is narrower than NB (AVX-512 only: an output count
    that is not a multiple of PANEL), else nothing."""
    var panels = (Np + NB - 1) // NB
    var last = _panel_start((panels - 1) * NB, Np, K)
    var narrow = List[Scalar[MD]](length=0 if last[2] else K * NB, fill=0)
    if not last[2]:
        var cols = Np - (panels - 1) * NB
        for k in range(K):
            for j in range(cols):
                narrow[k * NB + j] = w[unsafe_offset=last[0] + k * last[1] + j]
    return narrow^


@always_inline
def panel_at[MD: DType](w: Pointer[Scalar[MD], MutUntrackedOrigin], narrow: Pointer[Scalar[MD], MutUntrackedOrigin],
                        panel: Int, Np: Int, K: Int) -> Tuple[Pointer[Scalar[MD], MutUntrackedOrigin], Int]:
    """Where the product reads the columns panel * NB .. + NB of the packed matrix at w: its
    first entry and the stride of its rows, in place or in ``narrow_last_panel``'s copy."""
    var where = _panel_start(panel * NB, Np, K)
    if where[2]:
        return (w.unsafe_offset(where[0]), where[1])
    return (narrow, NB)


@always_inline
def _activated[act: Int, n: Int](v: SIMD[F32, n]) -> SIMD[F32, n]:
    comptime if act == ACT_GELU:
        return _gelu[n](v)
    elif act == ACT_SILU:
        return _silu[n](v)
    else:
        return v


@always_inline
def _store_cols[MD: DType, act: Int, scaled: Bool, n: Int](y: F32P, at: Int, t: F32P, bias: F32P, scale: F32P):
    """y[at + j] = act(t[j] (rounded to the matrices' dtype) + bias[j]) (* scale[at + j])
    for j < n, as one vector of n lanes."""
    var s = _activated[act, n](_rnd[MD, n](t.unsafe_load[width=n](0)) + bias.unsafe_load[width=n](0))
    comptime if scaled:
        s *= scale.unsafe_load[width=n](at)
    y.unsafe_store(at, s)


@always_inline
def _store_tile[MD: DType, act: Int, scaled: Bool](y: F32P, N: Int, row0: Int, rows: Int, col0: Int, t: F32P,
                                                   bias: F32P, scale: F32P):
    """y[row0 + r, col0 + j] = act(t[r, j] (rounded to the matrices' dtype) + bias[j])
    (* scale[row0 + r, col0 + j]) for r < rows and col0 + j < N (t is [MR, NB], bias the
    panel's NB biases, zero past N; scale [R, N] as y)."""
    var cols = min(NB, N - col0)
    if cols == NB and rows == MR:
        # a whole tile: each row's NB columns as one vector (NB / W registers), the rows one
        # after the other unrolled, so that the activation's long chains of dependent
        # instructions (the GELU's erf) run side by side
        comptime for r in range(MR):
            _store_cols[MD, act, scaled, NB](y, (row0 + r) * N + col0, t.unsafe_offset(r * NB), bias, scale)
        return
    for r in range(rows):
        var at = (row0 + r) * N + col0
        if cols == NB:
            _store_cols[MD, act, scaled, NB](y, at, t.unsafe_offset(r * NB), bias, scale)
        else:
            for j in range(cols):
                _store_cols[MD, act, scaled, 1](y, at + j, t.unsafe_offset(r * NB + j), bias.unsafe_offset(j), scale)


@always_inline
def _store[MD: DType](act: Int, scaled: Bool, y: F32P, N: Int, row0: Int, rows: Int, col0: Int, t: F32P, bias: F32P,
           scale: F32P):
    """``_store_tile`` of the call's activation and scaling."""
    comptime for a in range(ACT_SILU + 1):
        if act == a:
            if scaled:
                _store_tile[MD, a, True](y, N, row0, rows, col0, t, bias, scale)
            else:
                _store_tile[MD, a, False](y, N, row0, rows, col0, t, bias, scale)


@register("srm_linear_packed")
struct SrmLinearPacked:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        mats: InputTensor[rank=1, ...],
        layer: InputTensor[dtype=DType.int64, rank=1, ...],
        b: InputTensor[dtype=DType.float32, rank=1, ...],
        scale: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime MD = mats.dtype
        comptime MP = Pointer[Scalar[MD], MutUntrackedOrigin]
        comptime if target != "cpu":
            raise Error("srm_linear_packed: CPU only")
        comptime if MD != F32 and MD != DType.bfloat16:
            raise Error("srm_linear_packed: float32 or bfloat16 matrices only")
        var R = x.dim_size(0)
        var K = x.dim_size(1)
        var N = y.dim_size(1)
        if y.dim_size(0) != R:
            raise Error("srm_linear_packed: y has ", y.dim_size(0), " rows for ", R, " rows of x")
        if b.dim_size(0) != N:
            raise Error("srm_linear_packed: b has ", b.dim_size(0), " entries for ", N, " outputs")
        if layer.dim_size(0) != 2:
            raise Error("srm_linear_packed: layer must hold an offset and an activation, got ",
                        layer.dim_size(0), " entries")
        var first = Int(layer[0])
        var act = Int(layer[1])
        if act < ACT_NONE or act > ACT_SILU:
            raise Error("srm_linear_packed: unknown activation ", act)
        var scaled = scale.dim_size(0) * scale.dim_size(1) != 0
        if scaled and (scale.dim_size(0) != R or scale.dim_size(1) != N):
            raise Error("srm_linear_packed: scale must be [", R, ", ", N, "] or empty, got [", scale.dim_size(0),
                        ", ", scale.dim_size(1), "]")
        var Np = _padded(N)
        if first < 0 or first + Np * K > mats.dim_size(0):
            raise Error("srm_linear_packed: a packed [", N, ", ", K, "] matrix at ", first,
                        " does not fit in mats of ", mats.dim_size(0))
        if R == 0 or N == 0:
            return
        var w = MP(unsafe_from_address=Int(mats.unsafe_ptr())).unsafe_offset(first)
        var panels = (Np + NB - 1) // NB
        var narrow_store = narrow_last_panel[MD](w, Np, K)
        var narrow = MP(unsafe_from_address=Int(narrow_store.unsafe_ptr()))

        var bias_store = List[Float32](length=panels * NB, fill=0)
        for n in range(N):
            bias_store[n] = b[n]
        var bias = F32P(unsafe_from_address=Int(bias_store.unsafe_ptr()))
        var x_in = F32P(unsafe_from_address=Int(x.unsafe_ptr()))
        var scale_in = F32P(unsafe_from_address=Int(scale.unsafe_ptr()))
        var y_out = F32P(unsafe_from_address=Int(y.unsafe_ptr()))
        var workers = min(num_physical_cores(), MAX_WORKERS)
        var plan = _work_plan(R, panels, workers)
        var block_rows = plan[0]
        var per_item = plan[1]
        var blocks = ceildiv(R, block_rows)
        var groups = ceildiv(panels, per_item)
        var items = blocks * groups
        workers = min(workers, items)
        var next_item = List[Int64](length=1, fill=0)
        var counter = I64P(unsafe_from_address=Int(next_item.unsafe_ptr()))

        def work(worker: Int) {
            var w, var narrow, var bias, var x_in, var y_out, var counter, var R, var K, var N, var Np, var panels,
            var items, var groups, var per_item, var act, var scaled, var scale_in, var block_rows
        }:
            # the last tile's rows of x, zero past R
            var tail_store = List[Float32](length=MR * K, fill=0)
            var tail = F32P(unsafe_from_address=Int(tail_store.unsafe_ptr()))
            var tail_block = -1
            var t = F32P(unsafe_from_address=Int(stack_allocation[MR * NB, Float32]()))
            while True:
                var item = Int(Atomic[Int64].fetch_add(counter, 1))
                if item >= items:
                    break
                var block = item // groups
                var group = item - block * groups
                var row_first = block * block_rows
                var n = min(block_rows, R - row_first)
                var tiles = (n + MR - 1) // MR
                var full = n // MR  # tiles with MR rows of x
                if full < tiles and tail_block != block:
                    var r0 = row_first + full * MR
                    for i in range(MR * K):
                        tail[unsafe_offset=i] = x_in[unsafe_offset=r0 * K + i] if i < (R - r0) * K else 0
                    tail_block = block
                for panel in range(group * per_item, min(panels, (group + 1) * per_item)):
                    var p = panel_at[MD](w, narrow, panel, Np, K)
                    for g in range(tiles):
                        var row0 = row_first + g * MR
                        var src = x_in.unsafe_offset(row0 * K) if g < full else tail
                        tile_product(t, NB, src, K, p[0], K, p[1])
                        _store[MD](act, scaled, y_out, N, row0, min(MR, R - row0), panel * NB, t,
                                   bias.unsafe_offset(panel * NB), scale_in)
            _ = tail_store^

        sync_parallelize(work, workers)
        _ = narrow_store^
        _ = bias_store^
        _ = next_item^
