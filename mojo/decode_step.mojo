"""SRM decode on the CPU as one op: a whole step (every layer and the logits), or
S steps in one call, each token chosen greedily or drawn.

A decode step is a chain of small matrix products (five per layer, batch rows
against the weights) with norms, activations, residuals and the mixer update
between them. As separate graph ops each product pays a launch and its own
fork-join over the threads, and the small ones run single-threaded; here the
whole chain runs inside one fork-join. Each product is cut into units (a panel
of 64 output columns for a chunk of batch rows) that the workers claim from an
atomic counter; a worker that runs out of units waits until every unit of the
phase is done before the next phase reads its results. Nothing waits for a
worker that has not started: a late worker finds the finished phases empty, so a
busy thread pool only slows the step down.

    srm_decode_step(ids [B] int64, embedding [V, d], states [L, B, H, hd], positions [B] int64,
                    norms [L, 4, d], fc1_b [L, f], biases [L, 3, d],
                    w, beta [L, H, n], lam [L, H],
                    fc1 [L, F*d], fc2 [L, D*f], proj [L, D*d], out [L, D*d],
                    head [Vp*d], eps [1])
        -> logits [B, V], new_states [L, B, H, hd], scratch [B, f + 3d],
           clamped positions [B] int64

    srm_decode_steps(the same inputs, then steps [S] int64: only its length is read,
                      temperature [B] f32, top_k [B] int64, top_p [B] f32, seed [B] uint64,
                      mode [1] int64: graphs/sampler.py's MODE_*,
                      scored [1] int64: 1 to return the log-probabilities below, 0 not)
        -> tokens [B, S] int64, new_states, last [B] int64 (= tokens[:, S-1]),
           next positions [B] int64 (= positions + S), scratch [B, f + 3d + V],
           logprobs [B, S] f32, top_values [B, S, N] f32, top_ids [B, S, N] int64

With ``scored`` each step's chosen token gets its raw log-probability (log_softmax of
the logits as the head gave them: no temperature, no filters) and the N most likely
tokens there with theirs (row_logprobs.mojo), from the row before the draw overwrites
it; N (0 to V) is the outputs' width. Without it those outputs are left unwritten and
a step costs what it did before.

S steps, each step's token chosen inside the op and read back as the next step's
input, so S steps cost one call and one fork-join per 64 steps (a graph loop
around the one-step op pays both per step; each step's phases keep their own
counters, hence the 64). The choice is graphs/sampler.py's ``sample``: in
MODE_GREEDY the first argmax of the logits; otherwise row_sampler.mojo's draw per
sample (greedy for temperature 0), whose random counter is the new token's
position (positions + s + 1 at step s, not clamped). With S = 0 the states are
copied and last = ids.

x starts as the ids' rows of the embedding; positions past the context are clamped
to n - 1 (the host discards those tokens); norms holds LN_c weight, LN_c bias, LN_t weight, LN_t
bias; biases holds fc2, proj and out biases; lam is the decay per step. Per layer
(heads 0 .. H/2-1 column-repeat, the rest row-repeat):

    x += fc2 silu(fc1 LN_c(x) + b1) + b2
    u  = proj LN_t(x) + proj_b
    column:  s = u + lam*s;          y = w[h,t]*s + beta[h,t]
    row:     s = w[h,t]*u + lam*s;   y = s + beta[h,t]
    x += out y + out_b
then logits = head x (no bias). The same math as graphs/srm/decode.py's `step`.

The five matrices come packed (srm_max/models/srm/packing.py): a [N, K] matrix (out, in)
has its rows padded with zeros to a multiple of 16 and is stored as panels of 64
output columns (the last may be narrower), each panel [K, width] row-major, so
the product streams a panel once per chunk of rows with no transposes or
horizontal sums. F, D, Vp are f, d, V padded to multiples of 16. The matrices
are float32 or bfloat16 (widened in registers); with bfloat16 every product's
inputs and outputs are rounded to bfloat16, as the graph's matmul path does; the
embedding has the matrices' dtype. Norms, the mixer, the state and accumulation
are float32. CPU only.
"""
from std.memory import stack_allocation
from std.math import exp, sqrt
from std.atomic import Atomic
from std.sys import num_physical_cores, simd_width_of, size_of
from std.sys.intrinsics import prefetch, PrefetchOptions
from max.algorithm import sync_parallelize

from extensibility import InputTensor, OutputTensor, register
from max.gpu.host import DeviceContext

from .row_logprobs import score_token
from .row_sampler import RowScratch, choose_token, first_argmax
from .tiled_product import load_weights, store_sums

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
comptime U64P = Pointer[UInt64, MutUntrackedOrigin]
comptime PANEL = 64  # output columns per packed panel (srm_max/models/srm/packing.py)
comptime PAD = 16  # output rows of a packed matrix are padded to a multiple of this
# A register tile is MR batch rows x NV SIMD vectors of columns: MR * NV accumulators,
# NV weight vectors and one broadcast must fit in the vector registers. AVX and AVX2
# (8 floats a vector) have 16 registers: 5 x 2 (13 in use; at 6 x 2, 15 in use, the
# compiler kept one accumulator on the stack inside the loop, a store and a load on
# its chain of FMAs every step); AVX-512 and NEON have 32: 6 x 4 (29 in use).
comptime NV = 2 if W == 8 else 4
comptime MR = 5 if W == 8 else 6
# A unit of few batch rows (small batches) streams its panel from memory and needs
# few accumulators: it takes wider tiles (``_tile_vectors``), up to the whole panel.
comptime NV1 = PANEL // W


@always_inline
def _tile_vectors[WD: DType](rows: Int) -> Int:
    """Vectors of columns per register tile in a unit of ``rows`` batch rows on AVX2 (NV
    elsewhere). float32: the whole panel for 1-2 rows, 4 vectors for 3-4 rows, NV beyond:
    wider sub-panels read more of each cache line of the panel per pass, which at these
    row counts outweighs the accumulators that no longer fit in the 16 registers (the
    fastest choice in bench/cpu_decode.py at batch 2 and 4). bfloat16 panels are half the
    bytes, and there spilled accumulators bound the tile: the whole panel for 1 row, then
    tiles whose accumulators fit, 4 vectors for 2 rows and NV beyond (bench/decode_op_ab.py
    --dtype bfloat16)."""
    comptime if W != 8:
        return NV
    comptime half = WD == DType.bfloat16
    if rows <= (1 if half else 2):
        return NV1
    if rows <= (2 if half else 4):
        return 4
    return NV


@always_inline
def _tile_rows(left: Int) -> Int:
    """Rows of a unit's next register tile, ``left`` rows to go. With AVX2 the rows split
    evenly over the fewest tiles of at most MR (16 rows: 4 + 4 + 4 + 4, not 5 + 5 + 5 + 1):
    a one-row tile's NV accumulators are too few chains to cover the FMA's latency, so it
    takes most of a full tile's time. With AVX-512 even one row has NV = 4 chains."""
    comptime if W != 8:
        return min(MR, left)
    var tiles = (left + MR - 1) // MR
    return (left + tiles - 1) // tiles


comptime KU = 4  # k unrolled
comptime MAX_ROW_CHUNK = 8 * MR  # most batch rows per unit of work
comptime NORM_CHUNK = 8  # batch rows per unit of a norm phase
comptime MAX_WORKERS = 8
comptime STRIDE = 16  # int64 slots between phase counters (separate cache lines)
comptime STEPS_PER_FORK = 64  # steps per fork-join: bounds the counters' memory
comptime CLAIM_SHARE = 1  # a claim in runs takes 1 / (workers * CLAIM_SHARE) of the units left

# phases of a layer, then the logits
comptime LN_C = 0
comptime FC1 = 1
comptime FC2 = 2
comptime LN_T = 3
comptime PROJ = 4
comptime OUT = 5
comptime HEAD = 6
comptime ARGMAX = 7  # greedy: each row's token, and its embedding row as the next x
comptime DRAW = 8  # as ARGMAX, the token drawn by each sample's parameters
comptime MODE_GREEDY = 0  # graphs/sampler.py
comptime MODE_FILTERED = 2


def _padded(n: Int) -> Int:
    return (n + PAD - 1) // PAD * PAD


@always_inline
def _rnd[WD: DType, n: Int](v: SIMD[F32, n]) -> SIMD[F32, n]:
    """v rounded to the weights' dtype (a no-op for float32): what a bfloat16
    matmul takes and returns."""
    comptime if WD == F32:
        return v
    else:
        return v.cast[WD]().cast[F32]()


@fieldwise_init
struct Step(ImplicitlyCopyable, Movable):
    """Sizes and addresses of one call (packed matrices as raw addresses: their
    dtype is the kernel's parameter)."""

    var B: Int
    var d: Int
    var f: Int
    var V: Int
    var H: Int
    var hd: Int
    var n: Int
    var L: Int
    var eps: Float32
    var x: F32P  # the residual stream [B, d]
    var z: F32P  # a product's input [B, d]: normed x, or x rounded for the logits
    var y: F32P  # the mixer's output [B, d]
    var h: F32P  # the MLP's hidden activations [B, f]
    var logits: F32P
    var s_in: F32P
    var s_out: F32P
    var pos: I64P
    var norms: F32P
    var fc1_b: F32P
    var biases: F32P
    var w: F32P
    var beta: F32P
    var lam: F32P
    var fc1: Int
    var fc2: Int
    var proj: Int
    var out: Int
    var head: Int
    var workers: Int
    var emb: Int  # the embedding [V_in, d] (the matrices' dtype)
    var pos_in: I64P  # the positions given (later steps count on from them)
    var tokens: I64P  # S steps: [B, S]
    var S: Int  # steps this call
    var s: Int  # the step being computed
    # the draw's per-sample parameters (DRAW only)
    var temperature: F32P
    var top_k: I64P
    var top_p: F32P
    var seed: U64P
    var filtered: Bool  # some sample has top-k or top-p
    # the chosen tokens' raw log-probabilities (decode steps with ``scored`` only)
    var scored: Bool
    var logprobs: F32P  # [B, S]
    var top_n: Int  # alternatives per token
    var top_values: F32P  # [B, S, top_n]
    var top_ids: I64P  # [B, S, top_n]


# ------------------------------------------------------------------ products
@always_inline
def _tile[R: Int, NVT: Int, WD: DType, fetch: Bool, fetch_every: Int = 1](
    t: F32P, x: F32P, ldx: Int, p: Pointer[Scalar[WD], MutUntrackedOrigin], ps: Int, K: Int,
    ahead: Pointer[Scalar[WD], MutUntrackedOrigin], ahead_step: Int,
):
    """t[r, v*W ..] = sum_k x[r, k] * p[k, v*W ..] for R rows and NVT vectors of
    columns; p's rows are ps apart. Accumulators in registers (a fixed-size stack
    array with constant indices after unrolling); t's rows are PANEL apart. With
    fetch, every ``fetch_every``-th step k (a divisor of KU) also prefetches the cache line at
    ``ahead + (k / fetch_every) ahead_step``: parameters, so that no branch splits the
    loop's body (which costs registers)."""
    # allocated here, not in the loops: a stack array there would grow the stack at
    # every iteration
    var acc = stack_allocation[R * NVT * W, Float32]()
    var wv = stack_allocation[NVT * W, Float32]()
    comptime for a in range(R * NVT):
        acc.unsafe_store(a * W, SIMD[F32, W](0))
    var k = 0
    while k + KU <= K:
        comptime for kk in range(KU):
            var wp = p.unsafe_offset((k + kk) * ps)
            comptime if fetch and kk % fetch_every == 0:
                prefetch[PrefetchOptions().for_read().low_locality().to_data_cache()](
                    ahead.unsafe_offset((k + kk) // fetch_every * ahead_step)
                )
            load_weights[NVT, WD](wv, wp)
            comptime for r in range(R):
                var xb = SIMD[F32, W](x[unsafe_offset=r * ldx + k + kk])
                comptime for v in range(NVT):
                    comptime a = (r * NVT + v) * W
                    acc.unsafe_store(a, xb.fma(wv.unsafe_load[width=W](v * W), acc.unsafe_load[width=W](a)))
        k += KU
    while k < K:
        load_weights[NVT, WD](wv, p.unsafe_offset(k * ps))
        comptime for r in range(R):
            var xb = SIMD[F32, W](x[unsafe_offset=r * ldx + k])
            comptime for v in range(NVT):
                comptime a = (r * NVT + v) * W
                acc.unsafe_store(a, xb.fma(wv.unsafe_load[width=W](v * W), acc.unsafe_load[width=W](a)))
        k += 1
    store_sums[R, NVT, WD](t, PANEL, acc)


@no_inline
def _tile_apart[R: Int, NVT: Int, WD: DType, fetch: Bool, fetch_every: Int](
    t: F32P, x: F32P, ldx: Int, p: Pointer[Scalar[WD], MutUntrackedOrigin], ps: Int, K: Int,
    ahead: Pointer[Scalar[WD], MutUntrackedOrigin], ahead_step: Int,
):
    """``_tile`` as a function of its own."""
    _tile[R, NVT, WD, fetch, fetch_every](t, x, ldx, p, ps, K, ahead, ahead_step)


@always_inline
def _tile_here[R: Int, NVT: Int, WD: DType, fetch: Bool, fetch_every: Int = 1](
    t: F32P, x: F32P, ldx: Int, p: Pointer[Scalar[WD], MutUntrackedOrigin], ps: Int, K: Int,
    ahead: Pointer[Scalar[WD], MutUntrackedOrigin], ahead_step: Int,
):
    """A tile of a unit. With 32 vector registers it is called, not inlined: inlined into
    the unit's loop beside the other tile shapes, the 6 x 4 tile keeps an accumulator on
    the stack through the k loop, slower at every batch of bench/cpu_decode.py's model.
    AVX2's tiles are inlined: called, they are no faster, and slower at batch 16."""
    comptime if W > 8:
        _tile_apart[R, NVT, WD, fetch, fetch_every](t, x, ldx, p, ps, K, ahead, ahead_step)
    else:
        _tile[R, NVT, WD, fetch, fetch_every](t, x, ldx, p, ps, K, ahead, ahead_step)


@always_inline
def _unit_tile[WD: DType, fetch_every: Int = 1](
    rows: Int, nv: Int, fetch: Bool, t: F32P, x: F32P, ldx: Int, p: Pointer[Scalar[WD], MutUntrackedOrigin],
    ps: Int, K: Int, ahead: Pointer[Scalar[WD], MutUntrackedOrigin], ahead_step: Int,
):
    """A register tile of a unit (both decode ops' products): ``rows`` rows by ``nv``
    vectors, run as the compiled shape of that size. Only the tiles of the standard width
    NV prefetch (``fetch``, a line per ``fetch_every`` steps of k), and only where
    PREFETCH_NEXT_PANEL (elsewhere no prefetching shape is compiled). The shapes compiled are those a
    unit can ask for, no more (each grows the op's code): up to NV vectors at any rows,
    and the wider sub-panels ``_tile_vectors`` gives units of 1-2 rows (the whole panel)
    and 3-4 rows (4 vectors)."""
    comptime if PREFETCH_NEXT_PANEL:
        if fetch and nv == NV:
            comptime for R in range(1, MR + 1):
                if rows == R:
                    _tile_here[R, NV, WD, True, fetch_every](t, x, ldx, p, ps, K, ahead, ahead_step)
            return
    comptime for R in range(1, MR + 1):
        comptime for NVT in range(1, NV1 + 1):
            comptime if NVT <= NV or R <= 2 or (R <= 4 and NVT <= 4):
                if rows == R and nv == NVT:
                    _tile_here[R, NVT, WD, False](t, x, ldx, p, ps, K, ahead, ahead_step)


@always_inline
def _silu[n: Int](v: SIMD[F32, n]) -> SIMD[F32, n]:
    return v / (1 + exp(-v))


@always_inline
def _epilogue[kind: Int, WD: DType, n: Int](a: Step, l: Int, r: Int, c: Int, acc: SIMD[F32, n]):
    """Finish columns c .. c+n of row r of a product from its sums ``acc``."""
    var v = _rnd[WD](acc)  # the product's dtype, as MAX's matmul returns it
    comptime if kind == FC1:
        v += a.fc1_b.unsafe_load[width=n](l * a.f + c)
        a.h.unsafe_store(r * a.f + c, _rnd[WD](_silu(v)))
    elif kind == FC2 or kind == OUT:
        var which = 0 if kind == FC2 else 2
        v += a.biases.unsafe_load[width=n]((l * 3 + which) * a.d + c)
        var o = r * a.d + c
        var xn = a.x.unsafe_load[width=n](o) + v
        a.x.unsafe_store(o, xn)
        if kind == OUT and l == a.L - 1:
            a.z.unsafe_store(o, _rnd[WD](xn))  # the logits' input
    elif kind == PROJ:
        v += a.biases.unsafe_load[width=n]((l * 3 + 1) * a.d + c)
        _mixer[WD, n](a, l, r, c, v)
    else:
        a.logits.unsafe_store(r * a.V + c, v)


@always_inline
def _mixer[WD: DType, n: Int](a: Step, l: Int, r: Int, c: Int, u: SIMD[F32, n]):
    """The mixer update of channels c .. c+n of row r, given the projection u: at once
    when they lie in one head; across heads a vector, then a channel, at a time."""
    var h0 = c // a.hd
    if (c + n - 1) // a.hd == h0:  # one head: its scalars broadcast
        _mixer_head[WD, n](a, l, r, c, h0, u)
        return
    comptime if n > W:
        comptime for i in range(n // W):
            _mixer[WD, W](a, l, r, c + i * W, u.slice[W, offset=i * W]())
    else:
        comptime for i in range(n):
            _mixer_head[WD, 1](a, l, r, c + i, (c + i) // a.hd, SIMD[F32, 1](u[i]))


@always_inline
def _mixer_head[WD: DType, n: Int](a: Step, l: Int, r: Int, c: Int, h: Int, u: SIMD[F32, n]):
    """The mixer update of channels c .. c+n of row r, all in head h."""
    var t = Int(a.pos[unsafe_offset=r])
    var so = (l * a.B + r) * a.d + c
    var lam = a.lam[unsafe_offset=l * a.H + h]
    var wt = a.w[unsafe_offset=(l * a.H + h) * a.n + t]
    var bt = a.beta[unsafe_offset=(l * a.H + h) * a.n + t]
    var s = a.s_in.unsafe_load[width=n](so)
    var y: SIMD[F32, n]
    if h < a.H // 2:
        s = u + lam * s
        y = wt * s + bt
    else:
        s = wt * u + lam * s
        y = s + bt
    a.s_out.unsafe_store(so, s)
    a.y.unsafe_store(r * a.d + c, _rnd[WD](y))


@always_inline
def _fetch_line(tiles: Int, K: Int) -> Int:
    """The first cache line of the next unit's panel that a unit's tile prefetches after
    ``tiles`` tiles of the unit: a tile of K steps of k prefetches a line every KU steps."""
    return tiles * (K // KU)


# Whether a unit's tiles prefetch the next unit's panel: with AVX2, yes. AVX-512's batch-16
# unit is 3 tiles (6 + 6 + 4 rows by the whole panel), whose shares at a line every KU steps
# cover a fifth of the next panel; on the AVX-512 EPYC (Zen 4) the PHA op's products ran faster
# with no prefetch of it than with that fifth, and slower with more (bench/pha_op_ab.py,
# docs/pha_engine.md); the SRM op ran level. Our reading: the hardware prefetchers there
# follow the panels, which lie one after another in memory, and the software's lines add
# to the same queue.
comptime PREFETCH_NEXT_PANEL = W == 8


@always_inline
def _prefetches_next_panel(B: Int) -> Bool:
    """Whether a product unit at batch B prefetches the next unit's panel: not below a
    register tile's rows (such units' panels stream in order)."""
    return PREFETCH_NEXT_PANEL and B >= MR


@always_inline
def _next_panel_lines[WD: DType](B: Int, weights: Int, same_panel: Bool) -> Int:
    """The cache lines of the next unit's panel (``weights`` weights) that a unit's tiles
    prefetch: none where ``_prefetches_next_panel`` says so, nor when the next unit takes this
    unit's own panel (another chunk of its rows)."""
    if not _prefetches_next_panel(B) or same_panel:
        return 0
    return weights * size_of[WD]() // 64


def _product_unit[kind: Int, WD: DType](a: Step, l: Int, u: Int, next_u: Int):
    """One unit of a product: a panel of output columns for a chunk of rows. Where
    ``_prefetches_next_panel`` says so its tiles prefetch the panel of unit ``next_u`` (this
    worker's next unit of the phase, or none at ``_units``)."""
    var K: Int
    var x: F32P
    var base: Int
    var N = _width[kind](a)
    comptime if kind == FC1:
        K = a.d; x = a.z; base = a.fc1
    elif kind == FC2:
        K = a.f; x = a.h; base = a.fc2
    elif kind == PROJ:
        K = a.d; x = a.z; base = a.proj
    elif kind == OUT:
        K = a.d; x = a.y; base = a.out
    else:
        K = a.d; x = a.z; base = a.head
    var Np = _padded(N)
    var panels = _panels(N)
    var rows_per = _row_chunk(a.B)
    var chunks = _chunks(a.B)
    # consecutive units take the same panel: a worker's next unit mostly finds its
    # panel in its own cache instead of streaming it again
    var q = u // chunks
    var r0 = (u % chunks) * rows_per
    var r1 = min(a.B, r0 + rows_per)
    var width = min(PANEL, Np - q * PANEL)
    var layer = 0 if kind == HEAD else l
    var p = Pointer[Scalar[WD], MutUntrackedOrigin](unsafe_from_address=base).unsafe_offset(
        layer * Np * K + q * PANEL * K
    )
    # A tile reads its sub-panel's column of cache lines, one line a step of k, each a wait
    # on memory unless prefetched. So (with AVX2) every tile of the unit prefetches its share of the next
    # unit's panel, a line every KU steps of k (``_fetch_line``): spread over the whole unit,
    # the prefetches overlap its computing; crowded into a few tiles (the next panel from the
    # first sub-panel's tiles, a line a step), the units ran slower (bench/product_prefetch.py).
    comptime LINE = 64 // size_of[WD]()
    var next_q = next_u // chunks
    var next_lines = 0  # none beyond the phase's last unit
    if next_u < panels * chunks:
        next_lines = _next_panel_lines[WD](a.B, K * min(PANEL, Np - next_q * PANEL), next_q == q)
    var ahead = p.unsafe_offset((next_q - q) * PANEL * K)
    var t = stack_allocation[MR * PANEL, Float32]()
    var unit_rows = r1 - r0
    var nv_max = _tile_vectors[WD](unit_rows) if unit_rows <= MR else NV
    var tiles = 0  # this unit's tiles so far
    var c0 = 0
    while c0 < width:  # sub-panels of up to nv_max vectors
        var nv = min(nv_max, (width - c0) // W)
        var r = r0
        while r < r1:
            var rows = _tile_rows(r1 - r)
            var xr = x.unsafe_offset(r * K)
            var pc = p.unsafe_offset(c0)
            var line = _fetch_line(tiles, K)
            comptime if kind == PROJ:
                # The mixer's epilogue reads these rows' states, which a whole step has
                # pushed out of the caches: asked for now, they arrive while the tile runs.
                comptime FLOATS_PER_LINE = 64 // size_of[F32]()
                for i in range(rows):
                    var sp = a.s_in.unsafe_offset((l * a.B + r + i) * a.d + q * PANEL + c0)
                    for j in range(0, nv * W, FLOATS_PER_LINE):
                        prefetch[PrefetchOptions().for_read().high_locality().to_data_cache()](sp.unsafe_offset(j))
                    prefetch[PrefetchOptions().for_read().high_locality().to_data_cache()](
                        sp.unsafe_offset(nv * W - 1)
                    )
            var ahead_here = ahead.unsafe_offset(line * LINE)
            _unit_tile[WD, KU](rows, nv, line < next_lines, t, xr, K, pc, width, K, ahead_here, LINE)
            var cs = q * PANEL + c0
            if nv == NV and cs + NV * W <= N:
                # The usual tile: a row's columns in one wide epilogue, whose independent
                # vectors overlap (the SiLU's exp and division are long chains).
                for i in range(rows):
                    _epilogue[kind, WD, NV * W](a, l, r + i, cs, t.unsafe_load[width=NV * W](i * PANEL))
                r += rows
                tiles += 1
                continue
            for i in range(rows):
                for v in range(nv):
                    var c = cs + v * W
                    if c + W <= N:
                        _epilogue[kind, WD, W](a, l, r + i, c, t.unsafe_load[width=W](i * PANEL + v * W))
                    else:
                        for j in range(N - c):
                            _epilogue[kind, WD, 1](a, l, r + i, c + j, t.unsafe_load[width=1](i * PANEL + v * W + j))
            r += rows
            tiles += 1
        c0 += nv * W


# ------------------------------------------------------------------ norms
def _layer_norm[WD: DType](y: F32P, x: F32P, g: F32P, b: F32P, eps: Float32, d: Int):
    """LayerNorm (biased variance, as torch) of one row x [d] into y, rounded to WD."""
    var s = SIMD[F32, W](0)
    var i = 0
    while i + W <= d:
        s += x.unsafe_load[width=W](i)
        i += W
    var mean = s.reduce_add()
    for t in range(i, d):
        mean += x[unsafe_offset=t]
    mean /= Float32(d)
    var q = SIMD[F32, W](0)
    i = 0
    while i + W <= d:
        var c = x.unsafe_load[width=W](i) - mean
        q += c * c
        i += W
    var var_ = q.reduce_add()
    for t in range(i, d):
        var c = x[unsafe_offset=t] - mean
        var_ += c * c
    var inv = 1 / sqrt(var_ / Float32(d) + eps)
    i = 0
    while i + W <= d:
        var v = (x.unsafe_load[width=W](i) - mean) * inv
        y.unsafe_store(i, _rnd[WD](v * g.unsafe_load[width=W](i) + b.unsafe_load[width=W](i)))
        i += W
    for t in range(i, d):
        var v = (x[unsafe_offset=t] - mean) * inv * g[unsafe_offset=t] + b[unsafe_offset=t]
        y[unsafe_offset=t] = _rnd[WD, 1](v)


def _norm_unit[kind: Int, WD: DType](a: Step, l: Int, u: Int):
    var which = 0 if kind == LN_C else 2
    var g = a.norms.unsafe_offset((l * 4 + which) * a.d)
    var b = g.unsafe_offset(a.d)
    for r in range(u * NORM_CHUNK, min(a.B, (u + 1) * NORM_CHUNK)):
        _layer_norm[WD](a.z.unsafe_offset(r * a.d), a.x.unsafe_offset(r * a.d), g, b, a.eps, a.d)


# ------------------------------------------------------------------ choosing the tokens
def _embed_row[WD: DType](a: Step, r: Int, token: Int):
    """x[r] = the embedding's row ``token``, widened to float32."""
    var e = Pointer[Scalar[WD], MutUntrackedOrigin](unsafe_from_address=a.emb).unsafe_offset(token * a.d)
    var c = 0
    while c + W <= a.d:
        a.x.unsafe_store(r * a.d + c, e.unsafe_load[width=W](c).cast[F32]())
        c += W
    for j in range(c, a.d):
        a.x[unsafe_offset=r * a.d + j] = e[unsafe_offset=j].cast[F32]()


@always_inline
def _take[WD: DType](a: Step, r: Int, token: Int):
    """Row r's token of this step and, for the next step, its embedding row as x and
    its clamped position."""
    a.tokens[unsafe_offset=r * a.S + a.s] = Int64(token)
    if a.s + 1 < a.S:
        _embed_row[WD](a, r, token)
        a.pos[unsafe_offset=r] = Int64(min(Int(a.pos_in[unsafe_offset=r]) + a.s + 1, a.n - 1))


def _score_token(a: Step, r: Int, raw: F32P, token: Int):
    """Row r's chosen token's raw log-probability at this step and its top_n alternatives
    (row_logprobs.mojo) from its logits as the head gave them (``raw``)."""
    var at = r * a.S + a.s
    score_token(
        raw, a.V, token, a.top_n, a.logprobs.unsafe_offset(at), a.top_values.unsafe_offset(at * a.top_n),
        a.top_ids.unsafe_offset(at * a.top_n),
    )


def _argmax_unit[WD: DType](a: Step, u: Int):
    """Rows of one unit: the first index of the largest logit (as MAX's argmax)."""
    for r in range(u * NORM_CHUNK, min(a.B, (u + 1) * NORM_CHUNK)):
        var row = a.logits.unsafe_offset(r * a.V)
        var token = first_argmax(row, a.V)
        if a.scored:
            _score_token(a, r, row, token)
        _take[WD](a, r, token)


def _draw_unit[WD: DType](a: Step, u: Int, mut scratch: RowScratch):
    """Rows of one unit: each sample's token drawn from its logits (row_sampler.mojo),
    at the random counter of the new token's position."""
    var raw = F32P(unsafe_from_address=Int(scratch.raw.unsafe_ptr()))
    for r in range(u * NORM_CHUNK, min(a.B, (u + 1) * NORM_CHUNK)):
        var row = a.logits.unsafe_offset(r * a.V)
        if a.scored:  # choose_token overwrites the row
            for i in range(a.V):
                raw[unsafe_offset=i] = row[unsafe_offset=i]
        var token = choose_token(
            row, a.V, a.temperature[unsafe_offset=r], Int(a.top_k[unsafe_offset=r]),
            a.top_p[unsafe_offset=r], a.seed[unsafe_offset=r], a.pos_in[unsafe_offset=r] + Int64(a.s + 1),
            a.filtered, scratch,
        )
        if a.scored:
            _score_token(a, r, raw, token)
        _take[WD](a, r, token)


# ------------------------------------------------------------------ scheduling
def _row_chunk(B: Int) -> Int:
    """Batch rows per unit: B split evenly into chunks of at most MAX_ROW_CHUNK,
    rounded up to whole register tiles. Each unit streams its panel from memory
    once, so a chunk should hold as many tiles as the work allows."""
    var chunks = (B + MAX_ROW_CHUNK - 1) // MAX_ROW_CHUNK
    var rows = (B + chunks - 1) // chunks
    return (rows + MR - 1) // MR * MR


def _chunks(B: Int) -> Int:
    var rows_per = _row_chunk(B)
    return (B + rows_per - 1) // rows_per


def _width[kind: Int](a: Step) -> Int:
    """A product's output width."""
    return a.f if kind == FC1 else (a.V if kind == HEAD else a.d)


def _panels(N: Int) -> Int:
    return (_padded(N) + PANEL - 1) // PANEL


def _units[kind: Int](a: Step) -> Int:
    comptime if kind == LN_C or kind == LN_T or kind == ARGMAX or kind == DRAW:
        return (a.B + NORM_CHUNK - 1) // NORM_CHUNK
    else:
        return _panels(_width[kind](a)) * _chunks(a.B)


@always_inline
def _claim(counter: I64P, n: Int, share: Int) -> Tuple[Int, Int]:
    """The next run of consecutive units [first, end) of n for this worker (first >= n:
    none left): one unit, or with ``share`` > 0 1 / share of the units left (guided
    self-scheduling; the runs shrink to one unit towards the end, so the workers still
    finish together)."""
    if share == 0:
        var first = Int(Atomic[Int64].fetch_add(counter, 1))
        return (first, first + 1)
    var seen = Int(Atomic[Int64].load(counter))  # may be stale: it only sizes the run
    var run = max(1, (n - seen) // share)
    var first = Int(Atomic[Int64].fetch_add(counter, Int64(run)))
    return (first, min(n, first + run))


def _phase[kind: Int, WD: DType](a: Step, l: Int, counter: I64P, mut scratch: RowScratch):
    """Claim and run units of one phase until none is left, then wait for the
    units other workers claimed (counter: claimed; counter + 8: done). ``scratch``: the
    worker's for drawing tokens. Product phases are claimed in runs (``_claim`` with a
    share): with fewer batch rows than a register tile a unit is one panel read in a fraction
    of a microsecond, and a claim per unit would make the counter's cache line travel
    between the cores for each and give the workers alternate panels, which breaks the
    streams the prefetchers follow (bench/product_read_rate.py); with more, a worker knows
    its next unit (the next of its run, after the run's last the one the counter has
    reached) and its tiles prefetch that unit's panel (``_product_unit``)."""
    comptime products = kind == FC1 or kind == FC2 or kind == PROJ or kind == OUT or kind == HEAD
    var n = _units[kind](a)
    var share = 0
    comptime if products:
        share = a.workers * CLAIM_SHARE
    var done = counter.unsafe_offset(8)
    while True:
        var first, end = _claim(counter, n, share)
        if first >= n:
            break
        for u in range(first, end):
            comptime if kind == LN_C or kind == LN_T:
                _norm_unit[kind, WD](a, l, u)
            elif kind == ARGMAX:
                _argmax_unit[WD](a, u)
            elif kind == DRAW:
                _draw_unit[WD](a, u, scratch)
            else:
                var next_u = u + 1 if u + 1 < end else Int(Atomic[Int64].load(counter))
                _product_unit[kind, WD](a, l, u, next_u)
        _ = Atomic[Int64].fetch_add(done, Int64(end - first))
    while Int(Atomic[Int64].load(done)) < n:
        pass


def _phases_per_step(choose: Int, L: Int) -> Int:
    return L * HEAD + 1 + (0 if choose == HEAD else 1)


def _worker[WD: DType, choose: Int](step: Step, counters: I64P, first: Int, last: Int):
    """Every phase of steps first .. last-1 in order (each phase has its own counters);
    ``choose``: the phase that picks each step's tokens (ARGMAX or DRAW), HEAD for none."""
    var a = step
    var c = counters
    var scratch = RowScratch(a.V if choose == DRAW else 0)
    for s in range(first, last):
        a.s = s
        for l in range(a.L):
            comptime for kind in range(HEAD):
                _phase[kind, WD](a, l, c, scratch)
                c = c.unsafe_offset(STRIDE)
        _phase[HEAD, WD](a, a.L - 1, c, scratch)
        c = c.unsafe_offset(STRIDE)
        comptime if choose != HEAD:
            _phase[choose, WD](a, 0, c, scratch)
            c = c.unsafe_offset(STRIDE)
        a.s_in = a.s_out  # later steps update the new states in place


def _in[dt: DType](t: InputTensor[dtype=dt, ...]) -> Pointer[Scalar[dt], MutUntrackedOrigin]:
    return Pointer[Scalar[dt], MutUntrackedOrigin](unsafe_from_address=Int(t.unsafe_ptr()))


def _out[dt: DType](t: OutputTensor[dtype=dt, ...]) -> Pointer[Scalar[dt], MutUntrackedOrigin]:
    return Pointer[Scalar[dt], MutUntrackedOrigin](unsafe_from_address=Int(t.unsafe_ptr()))


def _prepare[WD: DType](
    op: StaticString, V: Int, S: Int, logits: F32P, tokens: I64P, pos: I64P,
    scratch: OutputTensor[dtype=F32, rank=2, ...],
    new_states: OutputTensor[dtype=F32, rank=4, ...],
    ids: InputTensor[dtype=DType.int64, rank=1, ...],
    embedding: InputTensor[dtype=WD, rank=2, ...],
    states: InputTensor[dtype=F32, rank=4, ...],
    positions: InputTensor[dtype=DType.int64, rank=1, ...],
    norms: InputTensor[dtype=F32, rank=3, ...],
    fc1_b: InputTensor[dtype=F32, rank=2, ...],
    biases: InputTensor[dtype=F32, rank=3, ...],
    w: InputTensor[dtype=F32, rank=3, ...],
    beta: InputTensor[dtype=F32, rank=3, ...],
    lam: InputTensor[dtype=F32, rank=2, ...],
    fc1: InputTensor[dtype=WD, rank=2, ...],
    fc2: InputTensor[dtype=WD, rank=2, ...],
    proj: InputTensor[dtype=WD, rank=2, ...],
    out_w: InputTensor[dtype=WD, rank=2, ...],
    head: InputTensor[dtype=WD, rank=1, ...],
    eps: InputTensor[dtype=F32, rank=1, ...],
) raises -> Step:
    """Check the sizes and the ids and positions (naming the op), clamp the positions
    into pos, gather x from the embedding: the call's Step, ready to run."""
    var B = ids.dim_size(0)
    var d = embedding.dim_size(1)
    var L = states.dim_size(0)
    var H = states.dim_size(2)
    var hd = states.dim_size(3)
    var f = fc1_b.dim_size(1)
    var n = w.dim_size(2)
    var D = _padded(d)
    if states.dim_size(1) != B or H * hd != d or new_states.dim_size(1) != B:
        raise Error(op, ": ids, embedding and states disagree on B or d")
    if norms.dim_size(0) != L or norms.dim_size(1) != 4 or norms.dim_size(2) != d:
        raise Error(op, ": norms must be [L, 4, d]")
    if biases.dim_size(0) != L or biases.dim_size(1) != 3 or biases.dim_size(2) != d:
        raise Error(op, ": biases must be [L, 3, d]")
    if w.dim_size(0) != L or w.dim_size(1) != H or beta.dim_size(0) != L or beta.dim_size(1) != H or (
        beta.dim_size(2) != n or lam.dim_size(0) != L or lam.dim_size(1) != H
    ):
        raise Error(op, ": w, beta must be [L, H, n] and lam [L, H]")
    if fc1.dim_size(0) != L or fc1.dim_size(1) != _padded(f) * d or fc2.dim_size(1) != D * f or (
        proj.dim_size(1) != D * d or out_w.dim_size(1) != D * d or head.dim_size(0) != _padded(V) * d
    ):
        raise Error(op, ": packed matrices have the wrong sizes")
    if scratch.dim_size(0) != B or scratch.dim_size(1) < f + 3 * d:
        raise Error(op, ": scratch too small")
    var pin = _in(positions)
    var ids_in = _in(ids)
    var V_in = embedding.dim_size(0)
    for b in range(B):
        var t = Int(pin[unsafe_offset=b])
        if t < 0:
            raise Error(op, ": position ", t, " is negative")
        pos[unsafe_offset=b] = Int64(min(t, n - 1))
        var token = Int(ids_in[unsafe_offset=b])
        if token < 0 or token >= V_in:
            raise Error(op, ": token id ", token, " outside [0, ", V_in, ")")
    var x = _out(scratch)
    var a = Step(
        B, d, f, V, H, hd, n, L, eps[0],
        x, x.unsafe_offset(B * d), x.unsafe_offset(2 * B * d), x.unsafe_offset(3 * B * d),
        logits, _in(states), _out(new_states), pos, _in(norms), _in(fc1_b), _in(biases),
        _in(w), _in(beta), _in(lam),
        Int(fc1.unsafe_ptr()), Int(fc2.unsafe_ptr()), Int(proj.unsafe_ptr()), Int(out_w.unsafe_ptr()),
        Int(head.unsafe_ptr()), _workers(), Int(embedding.unsafe_ptr()), pin, tokens, S, 0,
        # the draw's parameters: set by the op that draws; until then valid addresses unread
        logits, pos, logits, U64P(unsafe_from_address=Int(pos)), False,
        # the log-probabilities' outputs: set by the op that returns them
        False, logits, 0, logits, pos,
    )
    for b in range(B):
        _embed_row[WD](a, b, Int(ids_in[unsafe_offset=b]))
    return a


def _workers() -> Int:
    return min(num_physical_cores(), MAX_WORKERS)


def _run[WD: DType, choose: Int](step: Step):
    """All of the call's phases, STEPS_PER_FORK steps per fork-join."""
    var a = step
    var per_fork = min(a.S, STEPS_PER_FORK)
    var counters = List[Int64](length=per_fork * _phases_per_step(choose, a.L) * STRIDE, fill=0)
    var cp = I64P(unsafe_from_address=Int(counters.unsafe_ptr()))
    var workers = a.workers
    var first = 0
    while first < a.S:
        var last = min(a.S, first + per_fork)
        if first > 0:  # every worker has joined the previous fork: safe to reset
            for i in range(len(counters)):
                counters[i] = 0

        def work(i: Int) {var a, var cp, var first, var last}:
            _worker[WD, choose](a, cp, first, last)

        sync_parallelize(work, workers)
        a.s_in = a.s_out
        first = last
    _ = counters^


@register("srm_decode_step")
struct SrmDecodeStep:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        logits: OutputTensor[dtype=F32, rank=2, ...],
        new_states: OutputTensor[dtype=F32, rank=4, ...],
        scratch: OutputTensor[dtype=F32, rank=2, ...],
        clamped: OutputTensor[dtype=DType.int64, rank=1, ...],
        ids: InputTensor[dtype=DType.int64, rank=1, ...],
        embedding: InputTensor[rank=2, ...],
        states: InputTensor[dtype=F32, rank=4, ...],
        positions: InputTensor[dtype=DType.int64, rank=1, ...],
        norms: InputTensor[dtype=F32, rank=3, ...],
        fc1_b: InputTensor[dtype=F32, rank=2, ...],
        biases: InputTensor[dtype=F32, rank=3, ...],
        w: InputTensor[dtype=F32, rank=3, ...],
        beta: InputTensor[dtype=F32, rank=3, ...],
        lam: InputTensor[dtype=F32, rank=2, ...],
        fc1: InputTensor[dtype=embedding.dtype, rank=2, ...],
        fc2: InputTensor[dtype=fc1.dtype, rank=2, ...],
        proj: InputTensor[dtype=fc1.dtype, rank=2, ...],
        out_w: InputTensor[dtype=fc1.dtype, rank=2, ...],
        head: InputTensor[dtype=fc1.dtype, rank=1, ...],
        eps: InputTensor[dtype=F32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("srm_decode_step: CPU only")
        var B = ids.dim_size(0)
        if logits.dim_size(0) != B or clamped.dim_size(0) != B:
            raise Error("srm_decode_step: logits and clamped positions must have B rows")
        var a = _prepare[fc1.dtype](
            "srm_decode_step", logits.dim_size(1), 1, _out(logits), _out(clamped), _out(clamped),
            scratch, new_states, ids, embedding, states, positions, norms, fc1_b, biases, w, beta, lam,
            fc1, fc2, proj, out_w, head, eps,
        )
        _run[fc1.dtype, HEAD](a)


@register("srm_decode_steps")
struct SrmDecodeSteps:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        tokens: OutputTensor[dtype=DType.int64, rank=2, ...],
        new_states: OutputTensor[dtype=F32, rank=4, ...],
        last: OutputTensor[dtype=DType.int64, rank=1, ...],
        next_positions: OutputTensor[dtype=DType.int64, rank=1, ...],
        scratch: OutputTensor[dtype=F32, rank=2, ...],
        logprobs: OutputTensor[dtype=F32, rank=2, ...],
        top_values: OutputTensor[dtype=F32, rank=3, ...],
        top_ids: OutputTensor[dtype=DType.int64, rank=3, ...],
        ids: InputTensor[dtype=DType.int64, rank=1, ...],
        embedding: InputTensor[rank=2, ...],
        states: InputTensor[dtype=F32, rank=4, ...],
        positions: InputTensor[dtype=DType.int64, rank=1, ...],
        norms: InputTensor[dtype=F32, rank=3, ...],
        fc1_b: InputTensor[dtype=F32, rank=2, ...],
        biases: InputTensor[dtype=F32, rank=3, ...],
        w: InputTensor[dtype=F32, rank=3, ...],
        beta: InputTensor[dtype=F32, rank=3, ...],
        lam: InputTensor[dtype=F32, rank=2, ...],
        fc1: InputTensor[dtype=embedding.dtype, rank=2, ...],
        fc2: InputTensor[dtype=fc1.dtype, rank=2, ...],
        proj: InputTensor[dtype=fc1.dtype, rank=2, ...],
        out_w: InputTensor[dtype=fc1.dtype, rank=2, ...],
        head: InputTensor[dtype=fc1.dtype, rank=1, ...],
        eps: InputTensor[dtype=F32, rank=1, ...],
        steps: InputTensor[dtype=DType.int64, rank=1, ...],
        temperature: InputTensor[dtype=F32, rank=1, ...],
        top_k: InputTensor[dtype=DType.int64, rank=1, ...],
        top_p: InputTensor[dtype=F32, rank=1, ...],
        seed: InputTensor[dtype=DType.uint64, rank=1, ...],
        mode: InputTensor[dtype=DType.int64, rank=1, ...],
        scored: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("srm_decode_steps: CPU only")
        var B = ids.dim_size(0)
        var S = steps.dim_size(0)
        var d = embedding.dim_size(1)
        var f = fc1_b.dim_size(1)
        # the logits live after the activations in scratch: its width names V
        var V = scratch.dim_size(1) - f - 3 * d
        if V < 1 or V > embedding.dim_size(0):
            raise Error("srm_decode_steps: scratch must be [B, f + 3d + V] with V <= the embedding's rows")
        if tokens.dim_size(0) != B or tokens.dim_size(1) != S or last.dim_size(0) != B or (
            next_positions.dim_size(0) != B
        ):
            raise Error("srm_decode_steps: tokens must be [B, S], last and next positions [B]")
        if temperature.dim_size(0) != B or top_k.dim_size(0) != B or top_p.dim_size(0) != B or (
            seed.dim_size(0) != B or mode.dim_size(0) != 1
        ):
            raise Error("srm_decode_steps: temperature, top_k, top_p and seed must be [B], mode [1]")
        var N = top_values.dim_size(2)
        if scored.dim_size(0) != 1 or logprobs.dim_size(0) != B or logprobs.dim_size(1) != S or (
            top_values.dim_size(0) != B or top_values.dim_size(1) != S or top_ids.dim_size(0) != B
            or top_ids.dim_size(1) != S or top_ids.dim_size(2) != N or N > V
        ):
            raise Error(
                "srm_decode_steps: scored must be [1], logprobs [B, S], top values and ids [B, S, N] with N <= V"
            )
        var pos = List[Int64](length=B, fill=0)
        var a = _prepare[fc1.dtype](
            "srm_decode_steps", V, S, _out(scratch).unsafe_offset(B * (f + 3 * d)), _out(tokens),
            I64P(unsafe_from_address=Int(pos.unsafe_ptr())),
            scratch, new_states, ids, embedding, states, positions, norms, fc1_b, biases, w, beta, lam,
            fc1, fc2, proj, out_w, head, eps,
        )
        a.scored = scored[0] != 0
        a.logprobs = _out(logprobs)
        a.top_n = N
        a.top_values = _out(top_values)
        a.top_ids = _out(top_ids)
        var m = Int(mode[0])
        if S == 0:
            for i in range(states.size()):
                a.s_out[unsafe_offset=i] = a.s_in[unsafe_offset=i]
        elif m == MODE_GREEDY:
            _run[fc1.dtype, ARGMAX](a)
        else:
            a.temperature = _in(temperature)
            a.top_k = _in(top_k)
            a.top_p = _in(top_p)
            a.seed = _in(seed)
            a.filtered = m == MODE_FILTERED
            _run[fc1.dtype, DRAW](a)
        var ids_in = _in(ids)
        for b in range(B):
            last[b] = tokens[b, S - 1] if S > 0 else ids_in[unsafe_offset=b]
            next_positions[b] = a.pos_in[unsafe_offset=b] + Int64(S)
        _ = pos^
