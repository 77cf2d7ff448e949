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

The last kept value is found without sorting the row. A top-k of at most
min(SMALL_K, V / 8) keeps its values in a sorted buffer, filled from the few tokens
at least the k-th largest of some lane-wise maxima. Otherwise the tokens are binned by
how far below the max they lie (``_bucket``); searches over the bins by count find the
k-th value and by weight a bin where ``before`` is surely still under the limit; only
that bin is sorted (and the next ones while the cut is not found). There ``before`` is the
weight of the bins above, summed in vectors, carried on in descending order: rounded
differently from the rule's sum in sorted order, so it decides a compare with the
limit only where an error bound on both sums keeps them on the same side; otherwise
(rarely) the row is sorted and the rule followed literally.

The float64 sums in token-id order (the total, the draw's cumulative weights) run in
vectors when every partial sum is exact (``_weigh``): then any order gives the same bits.
"""
from std.math import exp
from std.sys import simd_width_of
from std.sys.intrinsics import compressed_store

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime F64 = DType.float64
comptime I32P = Pointer[Int32, MutUntrackedOrigin]
comptime NO_THRESHOLD: Float32 = -3.0e38  # graphs/sampler.py: no filter
# A top-k of at most min(SMALL_K, V / 8) keeps its values in a sorted buffer (a few
# insertions per row); a larger one, and top-p alone, bins the row.
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
    var values: List[Float32]  # [V + 16 W] a sorted buffer, or a bin's values; group maxima
    var weights: List[Float32]  # [V + W] each token's w, or candidates
    var bins: List[Int32]  # [V] each token's bin

    def __init__(out self, V: Int):
        self.values = List[Float32](length=V + 16 * W, fill=0)
        self.weights = List[Float32](length=V + W, fill=0)
        self.bins = List[Int32](length=V, fill=0)


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


def _sum(w: F32P, V: Int, exact: Bool) -> Float64:
    """The float64 sum of w in token-id order (in vectors when that is exact)."""
    if not exact:
        var acc = Float64(0)
        for j in range(V):
            acc += Float64(w[unsafe_offset=j])
        return acc
    var acc = SIMD[F64, W](0)
    var i = 0
    while i + W <= V:
        acc += w.unsafe_load[width=W](i).cast[F64]()
        i += W
    var total = acc.reduce_add()
    for j in range(i, V):
        total += Float64(w[unsafe_offset=j])
    return total


# ------------------------------------------------------------------ the threshold
def _kept(vals: F32P, n: Int, v0: Float32, limit: Float32) -> Int:
    """How many of ``vals`` (descending, the first ones of the row) top-p keeps: those whose
    float64 sum of w before them, rounded to float32, is < limit."""
    var before = Float64(0)
    var m = 0
    while m < n and Float32(before) < limit:
        before += Float64(exp(vals[unsafe_offset=m] - v0))
        m += 1
    return m


def _top_k_total(s: F32P, w: F32P, V: Int, vk: Float32, ties: Int, exact: Bool) -> Float64:
    """The sum of w over the top-k set in token-id order: every token above the k-th value
    ``vk`` and the first ``ties`` tokens equal to it."""
    var total = Float64(0)
    var above = SIMD[F64, W](0)  # exact: the tokens above vk in vectors
    var left = ties
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        if sv.ge(vk).reduce_or():
            var wv = w.unsafe_load[width=W](i)
            if exact and not sv.eq(vk).reduce_or():
                above += sv.gt(vk).select(wv, SIMD[F32, W](0)).cast[F64]()
            else:
                for l in range(W):
                    if sv[l] > vk or (sv[l] == vk and left > 0):
                        if sv[l] == vk:
                            left -= 1
                        total += Float64(wv[l])
        i += W
    for j in range(i, V):
        var x = s[unsafe_offset=j]
        if x > vk or (x == vk and left > 0):
            if x == vk:
                left -= 1
            total += Float64(w[unsafe_offset=j])
    return total + above.reduce_add()


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


def _lower_bound(s: F32P, V: Int, k: Int, buf: F32P) -> Float32:
    """A value at most the k-th largest (k <= 16 * groups): the k-th largest of the lane-wise
    maxima of up to 16 groups of vectors, each the value of a different token."""
    var nv = V // W
    var groups = min(16, nv)
    var per = nv // groups
    for g in range(groups):
        var m = SIMD[F32, W](-Float32.MAX)
        var last = nv if g == groups - 1 else (g + 1) * per
        for v in range(g * per, last):
            m = max(m, s.unsafe_load[width=W](v * W))
        buf.unsafe_store(V + g * W, m)  # after the k values _top_values will fill
    _top_values(buf.unsafe_offset(V), groups * W, k, buf)
    return buf[unsafe_offset=k - 1]


def _top_candidates(s: F32P, V: Int, k: Int, values: F32P, buf: F32P) -> Int:
    """buf = every token at least ``_lower_bound`` (found in ``values``): a few more than k;
    returns how many."""
    var bound = _lower_bound(s, V, k, values)
    var n = 0
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        var inside = sv.ge(bound)
        if inside.reduce_or():
            compressed_store(sv, buf.unsafe_offset(n), inside)
            n += Int(inside.cast[DType.int32]().reduce_add())
        i += W
    for j in range(i, V):
        if s[unsafe_offset=j] >= bound:
            buf[unsafe_offset=n] = s[unsafe_offset=j]
            n += 1
    return n


def _threshold_small_k(
    s: F32P, V: Int, v0: Float32, k: Int, top_p: Float32, mut scratch: RowScratch
) -> Float32:
    """The threshold for a small top-k: its values in a sorted buffer."""
    var buf = F32P(unsafe_from_address=Int(scratch.values.unsafe_ptr()))
    var w = F32P(unsafe_from_address=Int(scratch.weights.unsafe_ptr()))
    if k <= 16 * min(16, V // W):  # the k largest are among a few candidates
        _top_values(w, _top_candidates(s, V, k, buf, w), k, buf)
    else:
        _top_values(s, V, k, buf)
    var vk = buf[unsafe_offset=k - 1]
    var above = 0  # tokens above the k-th value: all in the buffer
    while buf[unsafe_offset=above] > vk:
        above += 1
    var exact = _weigh(s, V, v0, vk, w)
    var limit = top_p * Float32(_top_k_total(s, w, V, vk, k - above, exact))
    return buf[unsafe_offset=_kept(buf, k, v0, limit) - 1]


def _threshold_sorted(s: F32P, V: Int, v0: Float32, k: Int, limit: Float32, buf: F32P) -> Float32:
    """The rule literally, by a sort of the whole row: where the bins cannot decide."""
    for i in range(V):
        buf[unsafe_offset=i] = s[unsafe_offset=i]
    _sort_descending(buf, V)
    return buf[unsafe_offset=_kept(buf, k, v0, limit) - 1]


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
    var every = _sum(w, V, exact)
    var total = every
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
    var limit = top_p * Float32(total)
    # A float64 sum of n nonnegative terms is within n * 2^-53 of the exact one per unit of
    # it: the rule's (up to V terms) and ours (up to V in vectors, then up to V in a bin)
    # differ by less than 3V * 2^-53 * every; twice that covers the adds of the slack itself.
    var slack = Float64(3 * V + 16) * Float64(2.220446049250313e-16) * every
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


def _draw_exact(w: F32P, V: Int, u: Float32) -> Int:
    """``_draw_serial``'s token when every sum of w is exact: the total and the sums up to
    each vector in vectors, then one vector's tokens one by one."""
    var last = _last_weighted(w, V)
    var target = u * Float32(_sum(w, V, True))
    var acc = Float64(0)
    var i = 0
    while i + W <= V:
        var block = w.unsafe_load[width=W](i).cast[F64]().reduce_add()
        if Float32(acc + block) > target:
            break
        acc += block
        i += W
    for j in range(i, V):
        acc += Float64(w[unsafe_offset=j])
        if Float32(acc) > target:
            return min(j, last)
    return last


def choose_token(
    row: F32P, V: Int, temperature: Float32, top_k: Int, top_p: Float32, seed: UInt64, counter: Int64,
    filtered: Bool, mut scratch: RowScratch,
) -> Int:
    """See the module doc. ``row`` is overwritten."""
    if temperature <= 0:
        return first_argmax(row, V)
    var mx = _scale(row, V, _divisor(temperature))
    var w = F32P(unsafe_from_address=Int(scratch.weights.unsafe_ptr()))
    var thr = _threshold(row, V, mx, top_k, top_p, scratch) if filtered else NO_THRESHOLD
    # the threshold's weights (when it found one) are the draw's where s >= thr
    var exact = _weigh(row, V, mx, thr, w) if thr == NO_THRESHOLD else _mask(row, V, thr, w)
    var u = uniform(seed, counter)
    return _draw_exact(w, V, u) if exact else _draw_serial(w, V, u)
