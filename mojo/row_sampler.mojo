"""One token from one row of logits, as graphs/sampler.py draws it (no op here: the
decode ops of decode_step.mojo call it per row, sample_rows.mojo on given logits).

    choose_token(row [V] f32 logits (overwritten), V, temperature, top_k, top_p, seed,
                 counter, filtered, scratch: RowScratch(V)) -> token id

temperature 0 is greedy: the first index of the largest logit. Otherwise, on the
logits s scaled by 1 / max(temperature, 1e-6): with ``filtered`` (the batch has a top-k
or top-p sample) a threshold, then the inverse CDF in token-id order over the tokens
with s >= threshold at ONE uniform from the Squares RNG keyed by the seed at
``counter`` (the new token's position).

The threshold is graphs/sampler.py's ``_threshold``: with w = exp(s - max s), the top-k
set is the k largest (k = V when off; of the tokens tied with the k-th largest value,
the first in token-id order); total = the sum of w over the top-k set in TOKEN-ID
order; over the top-k values in descending order, before = the sum of w before each
one; top-p keeps those with before < top_p * total (the first always), and the
threshold is the last kept value: every token at least that large is drawn from.
Bit for bit the graph's arithmetic: float32 scaling and exp, sums accumulated in
float64 and rounded to float32 (as MAX's cumsum), the same compares.

Where few tokens can be drawn the rule runs on candidates alone: the tokens at or above
a bound that no kept token lies below, their values, ids and weights gathered in token-id
order (the other tokens only add zeros to the rule's sums). For a top-k of at most
MAX_CANDIDATES the bound is bisected by counting until a few more than k tokens are at or
above it; their values go into a sorted buffer (small k) or are sorted. For top-p alone
it is the first of a few distances below the max with surely more weight than the limit
above it and at most MAX_CANDIDATES tokens (a language model's peaked rows); the walk over
their sorted values must end among them.

Otherwise (a larger top-k, top-p over a flat row, NaN values) the last kept value is
found without sorting the row: the tokens are binned by how far below the max they lie
(``_bucket``); searches over the bins by count find the k-th value and by weight a bin
where ``before`` is surely still under the limit; only that bin is sorted (and the next
ones while the cut is not found). There ``before`` is the weight of the bins above, summed
in vectors, carried on in descending order: rounded differently from the rule's sum in
sorted order, so it decides a compare with the limit only where an error bound on both
sums (``_slack``) keeps them on the same side; otherwise (rarely) the row is sorted and
the rule followed literally.

The float64 sums over the whole row in token-id order (the total, the draw's cumulative
weights) run in vectors, in another order: where every partial sum is exact (``_weigh``)
any order gives the same bits; otherwise the error bound decides each float32 rounding
and compare, and only a sum too close to call (within about 1e-12 of a float32 rounding
boundary) is taken again one add at a time.
"""
from std.math import exp, iota
from std.sys import simd_width_of
from std.sys.intrinsics import compressed_store

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime F64 = DType.float64
comptime I32P = Pointer[Int32, MutUntrackedOrigin]
comptime NO_THRESHOLD: Float32 = -3.0e38  # graphs/sampler.py: no filter
# A top-k of at most SMALL_K keeps its values in a sorted buffer (a few insertions per
# candidate); a larger one sorts its candidates.
comptime SMALL_K = 64
# Bins 1/PER_UNIT of a scaled logit wide below the max; the last bin holds everything
# from (NB - 1) / PER_UNIT below (weights under e^-31), where a row's mass rarely matters.
comptime PER_UNIT: Float32 = 16.0
comptime NB = 512
# 2^-29: weights at least V times this make every float64 sum of them exact (below)
comptime EXACT_PER_TOKEN: Float32 = 1.862645149230957e-09
# graphs/sampler.py's Squares RNG keys
comptime K0: UInt64 = 0xC8E4FD154CE32F6D
comptime K1: UInt64 = 0x9B2D67A3E8F15C47


@always_inline
def _rot32(x: UInt64) -> UInt64:
    return (x >> 32) | (x << 32)


@always_inline
def _squares(ctr: UInt64, key: UInt64) -> UInt64:
    """32 random bits per (counter, key): Widynski's Squares, wrapping uint64 arithmetic."""
    var x = ctr * key
    var y = x
    var z = y + key
    x = _rot32(x * x + y)
    x = _rot32(x * x + z)
    x = _rot32(x * x + y)
    return (x * x + z) >> 32


def uniform(seed: UInt64, counter: Int64) -> Float32:
    """The sampler's one uniform in (0, 1) for (seed, counter): hash_uniform(.., n=1)."""
    var key = (_squares(seed, K0) << 32) + _squares(seed, K1)
    key = key | 1
    var bits = _squares(UInt64(counter), key)
    return (Float32(bits >> 8) + 0.5) * Float32(1.0 / Float64(1 << 24))


def first_argmax(row: F32P, V: Int) -> Int:
    """The first index of the largest value (as MAX's argmax)."""
    var m = SIMD[F32, W](-Float32.MAX)
    var i = 0
    while i + W <= V:
        m = max(m, row.unsafe_load[width=W](i))
        i += W
    var best = m.reduce_max()
    for t in range(i, V):
        best = max(best, row[unsafe_offset=t])
    var token = 0  # the first index holding best: a vector at a time, then in it
    while token + W <= V and not row.unsafe_load[width=W](token).eq(best).reduce_or():
        token += W
    while token < V - 1 and row[unsafe_offset=token] != best:
        token += 1
    return token



struct RowScratch(Movable):
    """What ``choose_token`` needs besides the row: one per worker, reused row after row."""

    # compressed_store writes a whole vector: a buffer it fills has W spare entries
    var values: List[Float32]  # [V + 16 W] a sorted buffer, or a bin's values
    var weights: List[Float32]  # [V + W] each token's w
    var bins: List[Int32]  # [V] each token's bin
    var candidate_values: List[Float32]  # [V + W] (``_gather``)
    var candidate_ids: List[Int32]  # [V + W]
    var candidate_weights: List[Float32]  # [V + W]
    var raw: List[Float32]  # [V] the row as given, for its log-probabilities (choose_token overwrites it)

    def __init__(out self, V: Int):
        self.values = List[Float32](length=V + 16 * W, fill=0)
        self.weights = List[Float32](length=V + W, fill=0)
        self.bins = List[Int32](length=V, fill=0)
        self.candidate_values = List[Float32](length=V + W, fill=0)
        self.candidate_ids = List[Int32](length=V + W, fill=0)
        self.candidate_weights = List[Float32](length=V + W, fill=0)
        self.raw = List[Float32](length=V, fill=0)


@always_inline
def _divisor(temperature: Float32) -> Float32:
    """floor_at(temperature, 1e-6) by the graph's arithmetic: t + (t < lo) * (lo - t)."""
    comptime lo: Float32 = 1e-6
    return temperature + (lo - temperature) if temperature < lo else temperature


def _scale(row: F32P, V: Int, t: Float32) -> Float32:
    """row /= t in place (the graph's float32 division); returns the largest value."""
    var mv = SIMD[F32, W](-Float32.MAX)
    var i = 0
    while i + W <= V:
        var s = row.unsafe_load[width=W](i) / t
        row.unsafe_store(i, s)
        mv = max(mv, s)
        i += W
    var mx = mv.reduce_max()
    for j in range(i, V):
        var s = row[unsafe_offset=j] / t
        row[unsafe_offset=j] = s
        mx = max(mx, s)
    return mx


def _weigh(s: F32P, V: Int, v0: Float32, thr: Float32, w: F32P) -> Bool:
    """w = exp(s - v0) where s >= thr, else 0 (the graph's weights, a vector at a time).
    Returns whether every float64 sum of them is exact: they are at most 1 and the nonzero
    ones at least V * 2^-29, so each is a multiple of a power of two g with V / g <= 2^53
    and so is every sum. Then sums in any order equal the graph's in token-id order."""
    var lo = SIMD[F32, W](1)
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        var inside = sv.ge(thr)
        var wv = inside.select(exp(sv - v0), SIMD[F32, W](0)) if inside.reduce_or() else SIMD[F32, W](0)
        w.unsafe_store(i, wv)
        lo = min(lo, wv.gt(0).select(wv, SIMD[F32, W](1)))
        i += W
    var least = lo.reduce_min()
    for j in range(i, V):
        var x = s[unsafe_offset=j]
        var wj = exp(x - v0) if x >= thr else Float32(0)
        w[unsafe_offset=j] = wj
        if wj > 0:
            least = min(least, wj)
    return least >= Float32(V) * EXACT_PER_TOKEN


def _mask(s: F32P, V: Int, thr: Float32, w: F32P) -> Bool:
    """w = 0 where s < thr, in place; returns ``_weigh``'s exactness of what is left."""
    var lo = SIMD[F32, W](1)
    var i = 0
    while i + W <= V:
        var wv = s.unsafe_load[width=W](i).ge(thr).select(w.unsafe_load[width=W](i), SIMD[F32, W](0))
        w.unsafe_store(i, wv)
        lo = min(lo, wv.gt(0).select(wv, SIMD[F32, W](1)))
        i += W
    var least = lo.reduce_min()
    for j in range(i, V):
        var wj = w[unsafe_offset=j] if s[unsafe_offset=j] >= thr else Float32(0)
        w[unsafe_offset=j] = wj
        if wj > 0:
            least = min(least, wj)
    return least >= Float32(V) * EXACT_PER_TOKEN


def _vector_sum(w: F32P, V: Int) -> Float64:
    """The float64 sum of w in vector lanes, then a tree: not token-id order."""
    var acc = SIMD[F64, W](0)
    var i = 0
    while i + W <= V:
        acc += w.unsafe_load[width=W](i).cast[F64]()
        i += W
    var total = acc.reduce_add()
    for j in range(i, V):
        total += Float64(w[unsafe_offset=j])
    return total


def _serial_sum(w: F32P, V: Int) -> Float64:
    """The float64 sum of w in token-id order, one add at a time (vectors of zeros passed
    over: adding 0 leaves a sum of nonnegative terms as it is)."""
    var acc = Float64(0)
    var i = 0
    while i + W <= V:
        var wv = w.unsafe_load[width=W](i)
        if wv.ne(0).reduce_or():
            for l in range(W):
                acc += Float64(wv[l])
        i += W
    for j in range(i, V):
        acc += Float64(w[unsafe_offset=j])
    return acc


@always_inline
def _slack(n: Int, total: Float64) -> Float64:
    """How far apart two float64 sums of the same n nonnegative terms (or prefixes of
    them) can lie, in any orders, with ``total`` one of their sums: each is within
    (n - 1) * 2^-53 of the exact sum per unit of it, so 3n ulps of 2^-52 cover both and the
    rounding of the bound itself (``_side``, ``_draw``)."""
    return Float64(3 * n + 16) * Float64(2.220446049250313e-16) * total


@always_inline
def _decided(approx: Float64, slack: Float64, mut rounded: Float32) -> Bool:
    """Whether every float64 within ``slack`` of ``approx`` rounds to the same float32
    (rounding is monotone: the two ends decide), then ``rounded``. NaN and infinity never
    are."""
    rounded = Float32(approx - slack)
    return rounded == Float32(approx + slack)


def _total32(w: F32P, V: Int, exact: Bool) -> Float32:
    """Float32 of the float64 sum of w in token-id order, as the graph rounds its cumsum's
    last entry: the vector sum where its error bound cannot change that rounding (always
    when ``exact``), else the sum in token-id order (rarely: within 1e-12 of a rounding
    boundary)."""
    var approx = _vector_sum(w, V)
    if exact:
        return Float32(approx)
    var total = Float32(0)
    if _decided(approx, _slack(V, approx), total):
        return total
    return Float32(_serial_sum(w, V))


# ------------------------------------------------------------------ the threshold
def _kept(vals: F32P, n: Int, v0: Float32, limit: Float32) -> Int:
    """How many of ``vals`` (descending, the first ones of the row) top-p keeps: those whose
    float64 sum of w before them, rounded to float32, is < limit."""
    var walked = Float64(0)
    return _kept(vals, n, v0, limit, walked)


def _kept(vals: F32P, n: Int, v0: Float32, limit: Float32, mut before: Float64) -> Int:
    """``_kept``, and ``before`` = the sum of w over the kept values (where the walk stopped)."""
    before = 0
    var m = 0
    while m < n and Float32(before) < limit:
        before += Float64(exp(vals[unsafe_offset=m] - v0))
        m += 1
    return m


@always_inline
def _in_top_k(x: Float32, vk: Float32, mut left: Int) -> Bool:
    """Whether a token of scaled value x is in the top-k set, in token-id order: above the
    k-th value ``vk``, or one of the first ``left`` tokens equal to it (counted down)."""
    if x > vk:
        return True
    if x == vk and left > 0:
        left -= 1
        return True
    return False


def _top_k_total(s: F32P, w: F32P, V: Int, vk: Float32, ties: Int, exact: Bool) -> Float32:
    """Float32 of the float64 sum of w over the top-k set in token-id order (every token
    above the k-th value ``vk`` and the first ``ties`` tokens equal to it), rounded as
    ``_total32``: from sums in vectors where the bound decides it, else in token-id order."""
    var above = SIMD[F64, W](0)  # the tokens above vk, in vectors
    var at = Float64(0)  # the tokens of vectors holding vk
    var left = ties
    var n = 0  # terms
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        var inside = sv.ge(vk)
        if inside.reduce_or():
            var wv = w.unsafe_load[width=W](i)
            n += Int(inside.cast[DType.int32]().reduce_add())
            if not sv.eq(vk).reduce_or():
                above += sv.gt(vk).select(wv, SIMD[F32, W](0)).cast[F64]()
            else:
                for l in range(W):
                    if _in_top_k(sv[l], vk, left):
                        at += Float64(wv[l])
        i += W
    for j in range(i, V):
        if _in_top_k(s[unsafe_offset=j], vk, left):
            at += Float64(w[unsafe_offset=j])
            n += 1
    var approx = above.reduce_add() + at
    if exact:
        return Float32(approx)
    var rounded = Float32(0)
    if _decided(approx, _slack(n, approx), rounded):
        return rounded
    var total = Float64(0)  # the rule's order
    left = ties
    for j in range(V):
        if _in_top_k(s[unsafe_offset=j], vk, left):
            total += Float64(w[unsafe_offset=j])
    return Float32(total)


def _sort_descending(vals: F32P, n: Int):
    sort(Span[Float32, MutUntrackedOrigin](unsafe_ptr=vals, length=n))  # ascending
    for i in range(n // 2):
        var a = vals[unsafe_offset=i]
        vals[unsafe_offset=i] = vals[unsafe_offset=n - 1 - i]
        vals[unsafe_offset=n - 1 - i] = a


@always_inline
def _insert(x: Float32, buf: F32P, k: Int, mut n: Int):
    """Puts x into buf[0 .. n) (descending, at most k kept) where it belongs."""
    if n == k and not x > buf[unsafe_offset=k - 1]:
        return
    var j = n if n < k else k - 1  # insertion point from the end: smaller ones move down
    while j > 0 and buf[unsafe_offset=j - 1] < x:
        buf[unsafe_offset=j] = buf[unsafe_offset=j - 1]
        j -= 1
    buf[unsafe_offset=j] = x
    if n < k:
        n += 1


def _top_values(s: F32P, V: Int, k: Int, buf: F32P):
    """buf[0 .. k) = the k largest values, descending, by insertion (k small); once full,
    a vector with nothing above the k-th so far is passed over whole."""
    var n = 0
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        if n < k or sv.gt(buf[unsafe_offset=k - 1]).reduce_or():
            for l in range(W):
                _insert(sv[l], buf, k, n)
        i += W
    for j in range(i, V):
        _insert(s[unsafe_offset=j], buf, k, n)


def _count_at_least(s: F32P, V: Int, x: Float32) -> Int:
    """How many tokens have s >= x."""
    var n = SIMD[DType.int32, W](0)
    var i = 0
    while i + W <= V:
        n += s.unsafe_load[width=W](i).ge(x).select(SIMD[DType.int32, W](1), SIMD[DType.int32, W](0))
        i += W
    var count = Int(n.reduce_add())
    for j in range(i, V):
        if s[unsafe_offset=j] >= x:
            count += 1
    return count


def _count_bound(s: F32P, V: Int, v0: Float32, k: Int) -> Float32:
    """A bound at most the k-th largest value with few more than k tokens at or above it:
    bisected by counting between the max ``v0`` and a value below the k-th. Where that
    fails (many ties, huge or NaN values) a bound with more or fewer tokens above it
    (``_gather`` tells)."""
    var hi = v0
    var lo = v0 - 16.0
    var count = _count_at_least(s, V, lo)
    var widenings = 0
    while count < k and widenings < 3:
        lo = v0 - (v0 - lo) * 8.0
        count = _count_at_least(s, V, lo)
        widenings += 1
    if count < k:
        return -Float32.MAX
    var enough = k + k // 4 + 8
    var rounds = 0
    while count > enough and rounds < 24:
        var mid = lo + (hi - lo) * 0.5
        if not (mid > lo and mid < hi):
            break
        var c = _count_at_least(s, V, mid)
        if c >= k:
            lo = mid
            count = c
        else:
            hi = mid
        rounds += 1
    return lo


def _threshold_small_k(
    s: F32P, V: Int, v0: Float32, k: Int, top_p: Float32, mut scratch: RowScratch
) -> Float32:
    """The threshold for a small top-k: its values in a sorted buffer filled from the row
    (where ``_choose_top_k`` finds too few candidates: NaN values)."""
    var buf = F32P(unsafe_from_address=Int(scratch.values.unsafe_ptr()))
    var w = F32P(unsafe_from_address=Int(scratch.weights.unsafe_ptr()))
    _top_values(s, V, k, buf)
    var vk = buf[unsafe_offset=k - 1]
    var above = 0  # tokens above the k-th value: all in the buffer
    while buf[unsafe_offset=above] > vk:
        above += 1
    var exact = _weigh(s, V, v0, vk, w)
    var limit = top_p * _top_k_total(s, w, V, vk, k - above, exact)
    return buf[unsafe_offset=max(_kept(buf, k, v0, limit), 1) - 1]


def _threshold_sorted(s: F32P, V: Int, v0: Float32, k: Int, limit: Float32, buf: F32P) -> Float32:
    """The rule literally, by a sort of the whole row: where the bins cannot decide."""
    for i in range(V):
        buf[unsafe_offset=i] = s[unsafe_offset=i]
    _sort_descending(buf, V)
    return buf[unsafe_offset=max(_kept(buf, k, v0, limit), 1) - 1]


@always_inline
def _bucket[w: Int](s: SIMD[F32, w], v0: Float32) -> SIMD[DType.int32, w]:
    """The bin of each value: (v0 - s) * PER_UNIT truncated, at most NB - 1 (NaN too).
    Never increasing in s (float rounding is monotone), so bins 0 .. b hold exactly the
    tokens at or above some value: a prefix of the row in descending order."""
    var x = (v0 - s) * PER_UNIT
    var inside = x.ge(0) & x.lt(Float32(NB - 1))
    return inside.select(x, SIMD[F32, w](Float32(NB - 1))).cast[DType.int32]()


def _bin(s: F32P, V: Int, v0: Float32, bins: I32P):
    var i = 0
    while i + W <= V:
        bins.unsafe_store(i, _bucket(s.unsafe_load[width=W](i), v0))
        i += W
    for j in range(i, V):
        bins[unsafe_offset=j] = _bucket[1](s[unsafe_offset=j], v0)[0]


def _below(bins: I32P, w: F32P, V: Int, b: Int, mut count: Int) -> Float64:
    """The float64 sum of w over the tokens in bins 0 .. b - 1 (vector lanes, then a
    tree: not the rule's order), and ``count`` = how many they are."""
    var acc = SIMD[F64, W](0)
    var n = SIMD[DType.int32, W](0)
    var i = 0
    while i + W <= V:
        var inside = bins.unsafe_load[width=W](i).lt(Int32(b))
        acc += inside.select(w.unsafe_load[width=W](i), SIMD[F32, W](0)).cast[F64]()
        n += inside.select(SIMD[DType.int32, W](1), SIMD[DType.int32, W](0))
        i += W
    var total = acc.reduce_add()
    count = Int(n.reduce_add())
    for j in range(i, V):
        if Int(bins[unsafe_offset=j]) < b:
            total += Float64(w[unsafe_offset=j])
            count += 1
    return total


def _below_roughly(bins: I32P, w: F32P, V: Int, b: Int) -> Float32:
    """``_below``'s sum in float32: to search with, never to decide."""
    var acc = SIMD[F32, W](0)
    var i = 0
    while i + W <= V:
        acc += bins.unsafe_load[width=W](i).lt(Int32(b)).select(w.unsafe_load[width=W](i), SIMD[F32, W](0))
        i += W
    var total = acc.reduce_add()
    for j in range(i, V):
        if Int(bins[unsafe_offset=j]) < b:
            total += w[unsafe_offset=j]
    return total


def _collect(s: F32P, bins: I32P, V: Int, b: Int, buf: F32P) -> Int:
    """buf = the values in bin b, sorted descending; returns how many."""
    var n = 0
    var i = 0
    while i + W <= V:
        var inside = bins.unsafe_load[width=W](i).eq(Int32(b))
        if inside.reduce_or():
            compressed_store(s.unsafe_load[width=W](i), buf.unsafe_offset(n), inside)
            n += Int(inside.cast[DType.int32]().reduce_add())
        i += W
    for j in range(i, V):
        if Int(bins[unsafe_offset=j]) == b:
            buf[unsafe_offset=n] = s[unsafe_offset=j]
            n += 1
    _sort_descending(buf, n)
    return n


def _kth_bin(bins: I32P, w: F32P, V: Int, k: Int) -> Int:
    """The bin holding the k-th largest value: the last b with fewer than k tokens before it."""
    var lo = 0
    var hi = NB - 1
    var n = 0
    while lo < hi:
        var mid = (lo + hi + 1) // 2
        _ = _below(bins, w, V, mid, n)
        if n < k:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _row_min(s: F32P, V: Int) -> Float32:
    var mv = SIMD[F32, W](Float32.MAX)
    var i = 0
    while i + W <= V:
        mv = min(mv, s.unsafe_load[width=W](i))
        i += W
    var least = mv.reduce_min()
    for j in range(i, V):
        least = min(least, s[unsafe_offset=j])
    return least


@always_inline
def _side(before: Float64, slack: Float64, limit: Float32) -> Int:
    """Where a token stands whose rule sum of w before it is within ``slack`` of ``before``:
    1 kept (Float32(x) < limit for every such x: rounding is monotone), -1 cut, 0 unknown."""
    if Float32(before + slack) < limit:
        return 1
    if not Float32(before - slack) < limit:
        return -1
    return 0


def _threshold_by_bins(
    s: F32P, V: Int, v0: Float32, k: Int, top_p: Float32, mut scratch: RowScratch
) -> Float32:
    """The threshold for top-p alone or a large top-k: the module doc's bins."""
    var buf = F32P(unsafe_from_address=Int(scratch.values.unsafe_ptr()))
    var w = F32P(unsafe_from_address=Int(scratch.weights.unsafe_ptr()))
    var bins = I32P(unsafe_from_address=Int(scratch.bins.unsafe_ptr()))
    var exact = _weigh(s, V, v0, NO_THRESHOLD, w)
    _bin(s, V, v0, bins)
    var every = _vector_sum(w, V)  # the bound's scale; the rule's total rounds it in order
    var total = _total32(w, V, exact) if k == V else Float32(0)
    var last_bin = NB - 1  # no kept token lies below it
    if k < V:
        last_bin = _kth_bin(bins, w, V, k)
        var seen = 0
        _ = _below(bins, w, V, last_bin, seen)
        _ = _collect(s, bins, V, last_bin, buf)
        var vk = buf[unsafe_offset=k - seen - 1]
        var above = seen
        while buf[unsafe_offset=above - seen] > vk:
            above += 1
        total = _top_k_total(s, w, V, vk, k - above, exact)
    var limit = top_p * total
    # ``before`` below is a float64 sum of the weights above a token, in another order than
    # the rule's: ``_slack`` bounds how far the two can differ.
    var slack = _slack(V, every)
    # A bin whose first token is surely kept (bin 0's: nothing is before it), as late as a
    # float32 search and then float64 sums find: the cut lies in it or after it.
    var lo = 0
    var hi = last_bin
    while lo < hi:
        var mid = (lo + hi + 1) // 2
        if _below_roughly(bins, w, V, mid) < limit * 0.999:
            lo = mid
        else:
            hi = mid - 1
    var seen = 0
    var before = _below(bins, w, V, lo, seen)  # ours for the next token in descending order
    while lo > 0 and _side(before, slack, limit) <= 0:
        lo -= 1
        before = _below(bins, w, V, lo, seen)
    var lowest = Float32(0)  # the last value walked
    var walked = False
    for b in range(lo, NB):
        var m = _collect(s, bins, V, b, buf)
        for i in range(m):
            if seen + i == k:
                return buf[unsafe_offset=i - 1]
            var side = _side(before, slack, limit)
            if side < 0 and (i > 0 or walked):
                return buf[unsafe_offset=i - 1] if i > 0 else lowest
            if side <= 0:  # too close to call, or the last kept value lies before the walk
                return _threshold_sorted(s, V, v0, k, limit, buf)
            before += Float64(exp(buf[unsafe_offset=i] - v0))
        if m > 0:
            seen += m
            lowest = buf[unsafe_offset=m - 1]
            walked = True
        if seen == k:
            return lowest
    return lowest if walked else _row_min(s, V)  # every token kept


def _threshold(s: F32P, V: Int, v0: Float32, top_k: Int, top_p: Float32, mut scratch: RowScratch) -> Float32:
    """The smallest scaled value that top-k then top-p keep (the module doc's rule)."""
    if top_k <= 0 and top_p >= 1:
        return NO_THRESHOLD
    var k = V if top_k <= 0 or top_k > V else top_k
    if k <= min(SMALL_K, V // 8):
        return _threshold_small_k(s, V, v0, k, top_p, scratch)
    return _threshold_by_bins(s, V, v0, k, top_p, scratch)


# ------------------------------------------------------------------ a few candidates
# Where few tokens can be drawn (a small top-k; top-p over a peaked row, as a language
# model's usually is) the rule runs on the candidates alone: the tokens at or above a
# bound that no kept token lies below, with their values, ids and weights in token-id
# order. Their sums in token-id order are the rule's own (the other tokens add zeros).

# most candidates top-p sorts, and the largest top-k on candidates; past it the row is binned
comptime MAX_CANDIDATES = 256
# top-p's bounds below the max, tried in turn: the first with enough weight above it
comptime MASS_BOUNDS = (2.0, 6.0, 16.0)


def _gather(s: F32P, V: Int, bound: Float32, vals: F32P, ids: I32P) -> Int:
    """vals, ids = the values and ids of the tokens with s >= bound, in token-id order;
    returns how many."""
    var n = 0
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        var inside = sv.ge(bound)
        if inside.reduce_or():
            compressed_store(sv, vals.unsafe_offset(n), inside)
            compressed_store(iota[DType.int32, W](Int32(i)), ids.unsafe_offset(n), inside)
            n += Int(inside.cast[DType.int32]().reduce_add())
        i += W
    for j in range(i, V):
        if s[unsafe_offset=j] >= bound:
            vals[unsafe_offset=n] = s[unsafe_offset=j]
            ids[unsafe_offset=n] = Int32(j)
            n += 1
    return n


def _draw_candidates(vals: F32P, ids: I32P, cw: F32P, n: Int, thr: Float32, u: Float32) -> Int:
    """``_draw_serial`` over the candidates with value >= thr (every token the draw can
    take): the same float64 sums in token-id order, the same first token above the target,
    at most the last weighted one."""
    var total = Float64(0)
    var last = 0
    for i in range(n):
        if vals[unsafe_offset=i] >= thr:
            total += Float64(cw[unsafe_offset=i])
            if cw[unsafe_offset=i] > 0:
                last = Int(ids[unsafe_offset=i])
    var target = u * Float32(total)
    var acc = Float64(0)
    for i in range(n):
        if vals[unsafe_offset=i] >= thr:
            acc += Float64(cw[unsafe_offset=i])
            if Float32(acc) > target:
                return min(Int(ids[unsafe_offset=i]), last)
    return last


def _choose_top_k(
    s: F32P, V: Int, v0: Float32, k: Int, top_p: Float32, u: Float32, mut scratch: RowScratch
) -> Int:
    """``choose_token`` for a top-k of at most MAX_CANDIDATES on its candidates
    (``_count_bound``), their values sorted (into a sorted buffer of k where k is small);
    -1 where fewer than k are found (NaN values)."""
    var vals = F32P(unsafe_from_address=Int(scratch.candidate_values.unsafe_ptr()))
    var ids = I32P(unsafe_from_address=Int(scratch.candidate_ids.unsafe_ptr()))
    var cw = F32P(unsafe_from_address=Int(scratch.candidate_weights.unsafe_ptr()))
    var buf = F32P(unsafe_from_address=Int(scratch.values.unsafe_ptr()))
    var n = _gather(s, V, _count_bound(s, V, v0, k), vals, ids)
    if n < k:
        return -1
    if k <= SMALL_K:  # a few insertions per candidate
        _top_values(vals, n, k, buf)
    else:
        for i in range(n):
            buf[unsafe_offset=i] = vals[unsafe_offset=i]
        _sort_descending(buf, n)
    var vk = buf[unsafe_offset=k - 1]
    var above = 0  # tokens above the k-th value: all in the buffer
    while buf[unsafe_offset=above] > vk:
        above += 1
    _ = _weigh(vals, n, v0, vk, cw)
    var total = Float64(0)  # over the top-k set in token-id order
    var left = k - above
    for i in range(n):
        if _in_top_k(vals[unsafe_offset=i], vk, left):
            total += Float64(cw[unsafe_offset=i])
    var limit = top_p * Float32(total)
    var thr = buf[unsafe_offset=max(_kept(buf, k, v0, limit), 1) - 1]
    return _draw_candidates(vals, ids, cw, n, thr, u)


def _mass_bound(s: F32P, w: F32P, V: Int, v0: Float32, limit: Float32) -> Float32:
    """The first of ``MASS_BOUNDS`` below the max with at most MAX_CANDIDATES tokens at or
    above it and, by a float32 sum, surely more weight than ``limit`` (top-p's cut lies
    above it); NO_THRESHOLD where none has."""
    comptime for b in range(len(MASS_BOUNDS)):
        var bound = v0 - Float32(MASS_BOUNDS[b])
        var mass = SIMD[F32, W](0)
        var count = SIMD[DType.int32, W](0)
        var i = 0
        while i + W <= V:
            var inside = s.unsafe_load[width=W](i).ge(bound)
            mass += inside.select(w.unsafe_load[width=W](i), SIMD[F32, W](0))
            count += inside.select(SIMD[DType.int32, W](1), SIMD[DType.int32, W](0))
            i += W
        var total = mass.reduce_add()
        var n = Int(count.reduce_add())
        for j in range(i, V):
            if s[unsafe_offset=j] >= bound:
                total += w[unsafe_offset=j]
                n += 1
        if n > MAX_CANDIDATES:
            return NO_THRESHOLD
        if total > limit * 1.001:  # a float32 sum of V terms is off by far less
            return bound
    return NO_THRESHOLD


def _choose_top_p(s: F32P, V: Int, v0: Float32, top_p: Float32, u: Float32, mut scratch: RowScratch) -> Int:
    """``choose_token`` for top-p alone on its candidates (``_mass_bound``): the rule's walk
    over their values in descending order; -1 where there are too many or the walk does
    not end among them."""
    var w = F32P(unsafe_from_address=Int(scratch.weights.unsafe_ptr()))
    var exact = _weigh(s, V, v0, NO_THRESHOLD, w)
    var limit = top_p * _total32(w, V, exact)
    var bound = _mass_bound(s, w, V, v0, limit)
    if bound == NO_THRESHOLD:
        return -1
    var vals = F32P(unsafe_from_address=Int(scratch.candidate_values.unsafe_ptr()))
    var ids = I32P(unsafe_from_address=Int(scratch.candidate_ids.unsafe_ptr()))
    var cw = F32P(unsafe_from_address=Int(scratch.candidate_weights.unsafe_ptr()))
    var buf = F32P(unsafe_from_address=Int(scratch.values.unsafe_ptr()))
    var n = _gather(s, V, bound, vals, ids)
    for i in range(n):
        buf[unsafe_offset=i] = vals[unsafe_offset=i]
        cw[unsafe_offset=i] = w[unsafe_offset=Int(ids[unsafe_offset=i])]
    _sort_descending(buf, n)
    var before = Float64(0)
    var m = _kept(buf, n, v0, limit, before)
    if m == n and Float32(before) < limit:  # the next token, below the bound, is kept too
        return -1
    return _draw_candidates(vals, ids, cw, n, buf[unsafe_offset=max(m, 1) - 1], u)


# ------------------------------------------------------------------ the draw
def _last_weighted(w: F32P, V: Int) -> Int:
    """The last token with weight (where rounding may put the draw), else 0."""
    var last = V - 1
    while last > 0 and not w[unsafe_offset=last] > 0:
        last -= 1
    return last


def _draw_serial(w: F32P, V: Int, u: Float32) -> Int:
    """The inverse CDF at u: w overwritten with its cumulative sums, accumulated in float64
    in token-id order and rounded to float32; the first above the target."""
    var last = _last_weighted(w, V)
    var acc = Float64(0)
    for j in range(V):
        acc += Float64(w[unsafe_offset=j])
        w[unsafe_offset=j] = Float32(acc)
    var target = u * w[unsafe_offset=V - 1]
    # the number of cumulative weights <= target: they rise, so the first one above it
    var lo = 0
    var hi = V
    while lo < hi:
        var mid = (lo + hi) // 2
        if w[unsafe_offset=mid] <= target:
            lo = mid + 1
        else:
            hi = mid
    return min(lo, last)


def _draw(w: F32P, V: Int, u: Float32, exact: Bool) -> Int:
    """``_draw_serial``'s token from sums in vectors: the total, then the sums up to each
    vector until one may cross the target, then that vector's tokens one by one. Each sum
    is within ``_slack`` of the rule's (equal when ``exact``), so where the slack cannot
    change a float32 rounding or compare, the token is the rule's; elsewhere (rarely)
    ``_draw_serial`` decides."""
    var approx = _vector_sum(w, V)
    var slack = Float64(0) if exact else _slack(V, approx)
    var total = Float32(0)
    if not _decided(approx, slack, total):
        return _draw_serial(w, V, u)
    var target = u * total
    var last = _last_weighted(w, V)
    var acc = Float64(0)
    var i = 0
    while i + W <= V:
        var block = w.unsafe_load[width=W](i).cast[F64]().reduce_add()
        if not Float32(acc + block + slack) <= target:  # the draw may be in this vector
            break
        acc += block
        i += W
    for j in range(i, V):
        acc += Float64(w[unsafe_offset=j])
        if Float32(acc - slack) > target:
            return min(j, last)
        if not Float32(acc + slack) <= target:  # too close to call
            return _draw_serial(w, V, u)
    return last


def choose_token(
    row: F32P, V: Int, temperature: Float32, top_k: Int, top_p: Float32, seed: UInt64, counter: Int64,
    filtered: Bool, mut scratch: RowScratch,
) -> Int:
    """See the module doc. ``row`` is overwritten."""
    if temperature <= 0:
        return first_argmax(row, V)
    var mx = _scale(row, V, _divisor(temperature))
    var u = uniform(seed, counter)
    if filtered and not (top_k <= 0 and top_p >= 1):
        var k = V if top_k <= 0 or top_k > V else top_k
        var token = -1
        if k <= min(MAX_CANDIDATES, V // 4):
            token = _choose_top_k(row, V, mx, k, top_p, u, scratch)
        elif k == V:
            token = _choose_top_p(row, V, mx, top_p, u, scratch)
        if token >= 0:
            return token
    var w = F32P(unsafe_from_address=Int(scratch.weights.unsafe_ptr()))
    var thr = _threshold(row, V, mx, top_k, top_p, scratch) if filtered else NO_THRESHOLD
    # the threshold's weights (when it found one) are the draw's where s >= thr
    var exact = _weigh(row, V, mx, thr, w) if thr == NO_THRESHOLD else _mask(row, V, thr, w)
    return _draw(w, V, u, exact)
