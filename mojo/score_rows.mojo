"""The per-position reduction of logits to log-probabilities and the top n, CPU (graphs/scoring.py).

    srm_score_rows(logits [R, V] f32, targets [R] int64)
        -> logprobs [R] f32, top_values [R, K] f32, top_ids [R, K] int64

For each row r, with m its max and lse = log(sum(exp(logits[r] - m))) (shifted by the
max, so nothing overflows):
    logprobs[r]     = (logits[r, targets[r]] - m) - lse
    top_values[r]   = (the K largest of logits[r]) - m - lse, descending
    top_ids[r]      = their ids; of equal values the lower id first, and the lower ids
                      are the ones kept when ties straddle the K-th place
K is the outputs' width (1 <= K <= V). A target outside [0, V) raises.

The logits must be row-major (the reshaped output of the graph's matmul is).
``score_row`` is the reduction of one row, shared with srm_score_head
(mojo/score_head.mojo), which reduces logits it computes itself.

Two passes over a row, a vector at a time. The first keeps each lane's DEPTH largest
values with a branch-free min/max network; the K-th largest of those W * DEPTH values
is a floor under the row's K-th largest, and their largest is the row's max. The
second sums exp(x - max) and, for the few vectors holding a value at or above the
floor, inserts those values into a sorted list of K; in id order, so of equal values
the lower id stays. MAX's ``ops.top_k`` sorts whole rows instead, which at V = 4,096
cost more than the rest of a prefill of the same tokens. A row (16 KiB at V = 4,096) stays in the
first-level cache between the passes. Rows are split between the cores in blocks of
ROWS_PER_ITEM.
"""
from std.math import exp, log
from std.memory import stack_allocation
from std.sys import simd_width_of

from extensibility import InputTensor, OutputTensor, register
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]
# Pass 1 keeps each lane's DEPTH largest values, W * DEPTH >= 20 of them (the score
# graph's K, graphs/scoring.py TOP_N): for K up to W * DEPTH the K-th largest of them
# bounds the row's K-th largest from below.
comptime DEPTH = (20 + W - 1) // W
# rows per work item: enough that an item's start-up (its list) is noise, few enough
# that the items balance between the cores
comptime ROWS_PER_ITEM = 32


struct TopList(Movable):
    """The K largest values seen so far and their ids, descending (earlier ids first
    among equal values)."""

    var values: List[Float32]
    var ids: List[Int]
    var count: Int
    var K: Int

    def __init__(out self, K: Int):
        self.values = List[Float32](length=K, fill=0)
        self.ids = List[Int](length=K, fill=0)
        self.count = 0
        self.K = K

    @always_inline
    def clear(mut self):
        self.count = 0

    @always_inline
    def takes(self, x: Float32) -> Bool:
        """Whether x enters the list: it is not full, or x beats its last value (an
        equal value comes later in id order and loses the tie)."""
        return self.count < self.K or x > self.values[self.K - 1]

    @always_inline
    def insert(mut self, x: Float32, id: Int):
        """Puts x (which ``takes``) after every value >= x, dropping the last when full."""
        var j = self.count
        if self.count < self.K:
            self.count += 1
        else:
            j = self.K - 1
        while j > 0 and self.values[j - 1] < x:
            self.values[j] = self.values[j - 1]
            self.ids[j] = self.ids[j - 1]
            j -= 1
        self.values[j] = x
        self.ids[j] = id

    @always_inline
    def floor(self) -> Float32:
        """The value a vector must beat somewhere to matter: the K-th when full."""
        return self.values[self.K - 1] if self.count == self.K else -Float32.MAX


def _kth_largest(lanes: F32P, K: Int) -> Float32:
    """The K-th largest of the W * DEPTH values at ``lanes`` (distinct tokens of the row,
    so at least K tokens are >= it), sorting them in place; -Float32.MAX when
    K > W * DEPTH (no bound)."""
    comptime N = W * DEPTH
    if K > N:
        return -Float32.MAX
    for j in range(1, N):  # insertion sort, descending: N is a few dozen
        var x = lanes[unsafe_offset=j]
        var i = j
        while i > 0 and lanes[unsafe_offset=i - 1] < x:
            lanes[unsafe_offset=i] = lanes[unsafe_offset=i - 1]
            i -= 1
        lanes[unsafe_offset=i] = x
    return lanes[unsafe_offset=K - 1]


@always_inline
def score_row(row: F32P, V: Int, target: Int, mut top: TopList, lanes: F32P,
              logprob: F32P, values: F32P, ids: I64P):
    """One row of V logits at ``row`` reduced: logprob[0] = the target's log-probability,
    values[0 .. K) and ids[0 .. K) the K = ``top.K`` largest log-probabilities and their
    ids (the op's docstring). ``lanes``: room for W * DEPTH floats. The target must be in
    [0, V)."""
    var K = top.K
    # pass 1: each lane's DEPTH largest values (a sorting network per vector)
    comptime for d in range(DEPTH):
        lanes.unsafe_store(d * W, SIMD[F32, W](-Float32.MAX))
    var i = 0
    while i + W <= V:
        var v = row.unsafe_load[width=W](i)
        comptime for d in range(DEPTH):
            var kept = lanes.unsafe_load[width=W](d * W)
            lanes.unsafe_store(d * W, max(kept, v))
            v = min(kept, v)
        i += W
    var mx = lanes.unsafe_load[width=W](0).reduce_max()
    for j in range(i, V):
        mx = max(mx, row[unsafe_offset=j])
    var floor = _kth_largest(lanes, K)
    # pass 2: the sum of exp(x - max); the K largest are among the values >= floor
    top.clear()
    var m = SIMD[F32, W](mx)
    var s = SIMD[F32, W](0)
    i = 0
    while i + W <= V:
        var v = row.unsafe_load[width=W](i)
        s += exp(v - m)
        if v.ge(floor).reduce_or():
            for lane in range(W):
                if v[lane] >= floor and top.takes(v[lane]):
                    top.insert(v[lane], i + lane)
        i += W
    var total = s.reduce_add()
    for j in range(i, V):
        var x = row[unsafe_offset=j]
        total += exp(x - mx)
        if x >= floor and top.takes(x):
            top.insert(x, j)
    if top.count < K:  # NaN in the row: no floor held; the outputs are NaN anyway
        for j in range(V):
            if top.takes(row[unsafe_offset=j]):
                top.insert(row[unsafe_offset=j], j)
    # (x - max) - log(total), not x - (max + log(total)): the difference to the max is
    # exact for the values that matter, so large logits keep their digits
    var log_total = log(total)
    logprob[unsafe_offset=0] = (row[unsafe_offset=target] - mx) - log_total
    for k in range(K):
        values[unsafe_offset=k] = (top.values[k] - mx) - log_total
        ids[unsafe_offset=k] = Int64(top.ids[k])


@register("srm_score_rows")
struct SrmScoreRows:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        logprobs: OutputTensor[dtype=DType.float32, rank=1, ...],
        top_values: OutputTensor[dtype=DType.float32, rank=2, ...],
        top_ids: OutputTensor[dtype=DType.int64, rank=2, ...],
        logits: InputTensor[dtype=DType.float32, rank=2, ...],
        targets: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("srm_score_rows: CPU only")
        var R = logits.dim_size(0)
        var V = logits.dim_size(1)
        var K = top_values.dim_size(1)
        if targets.dim_size(0) != R or logprobs.dim_size(0) != R:
            raise Error("srm_score_rows: targets and logprobs need one entry per row of logits")
        if top_values.dim_size(0) != R or top_ids.dim_size(0) != R or top_ids.dim_size(1) != K:
            raise Error("srm_score_rows: top_values and top_ids must both be [R, K]")
        if K < 1 or K > V:
            raise Error("srm_score_rows: K=", K, " must be 1 to the vocabulary size ", V)
        for r in range(R):
            var t = Int(targets[r])
            if t < 0 or t >= V:
                raise Error("srm_score_rows: row ", r, " has target ", t, " outside [0, ", V, ")")
        if R == 0:
            return
        var items = (R + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
        var lp_out = F32P(unsafe_from_address=Int(logprobs.unsafe_ptr()))
        var values_out = F32P(unsafe_from_address=Int(top_values.unsafe_ptr()))
        var ids_out = I64P(unsafe_from_address=Int(top_ids.unsafe_ptr()))
        var rows = F32P(unsafe_from_address=Int(logits.unsafe_ptr()))

        def work(item: Int) {var lp_out, var values_out, var ids_out, var rows, var targets, var R, var V, var K}:
            var top = TopList(K)
            var lanes = F32P(unsafe_from_address=Int(stack_allocation[W * DEPTH, Float32]()))
            var first = item * ROWS_PER_ITEM
            for r in range(first, min(first + ROWS_PER_ITEM, R)):
                score_row(rows.unsafe_offset(r * V), V, Int(targets[r]), top, lanes,
                          lp_out.unsafe_offset(r), values_out.unsafe_offset(r * K), ids_out.unsafe_offset(r * K))

        sync_parallelize(work, items)
