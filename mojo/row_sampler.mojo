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
min(SMALL_K, V / 8) keeps its values in a sorted buffer. Otherwise the tokens are
binned by how far below the max they lie (``_bucket``); the bins' counts give the
k-th value and their float64 masses the bin where ``before`` reaches the limit, and
only that bin is sorted. There ``before`` is the bins' masses summed on in descending
order: rounded differently from the rule's sum in sorted order, so it decides a compare
with the limit only where an error bound on both sums keeps them on the same side;
otherwise (rarely) the row is sorted and the rule followed literally.
"""
from std.math import exp
from std.sys import simd_width_of

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime F64P = Pointer[Float64, MutUntrackedOrigin]
comptime I32P = Pointer[Int32, MutUntrackedOrigin]
comptime NO_THRESHOLD: Float32 = -3.0e38  # graphs/sampler.py: no filter
# A top-k of at most min(SMALL_K, V / 8) keeps its values in a sorted buffer (a few
# insertions per row); a larger one, and top-p alone, bins the row.
comptime SMALL_K = 64
# Bins 1/PER_UNIT of a scaled logit wide below the max; the last bin holds everything
# from (NB - 1) / PER_UNIT below (weights under e^-31), where a row's mass rarely matters.
comptime PER_UNIT: Float32 = 16.0
comptime NB = 512
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

    var values: List[Float32]  # [V] a sorted buffer, or a bin's values
    var count: List[Int32]  # [NB] tokens per bin
    var mass: List[Float64]  # [NB] the bin's weights summed in float64

    def __init__(out self, V: Int):
        self.values = List[Float32](length=V, fill=0)
        self.count = List[Int32](length=NB, fill=0)
        self.mass = List[Float64](length=NB, fill=0)


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


def _top_k_total(s: F32P, V: Int, v0: Float32, vk: Float32, ties: Int) -> Float64:
    """The sum of w over the top-k set in token-id order: every token above the k-th value
    ``vk`` and the first ``ties`` tokens equal to it. Weights are the whole vector's exp,
    as the graph computes them."""
    var total = Float64(0)
    var left = ties
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        if sv.ge(vk).reduce_or():
            var wv = exp(sv - v0)
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
            total += Float64(exp(x - v0))
    return total


def _sort_descending(vals: F32P, n: Int):
    sort(Span[Float32, MutUntrackedOrigin](unsafe_ptr=vals, length=n))  # ascending
    for i in range(n // 2):
        var a = vals[unsafe_offset=i]
        vals[unsafe_offset=i] = vals[unsafe_offset=n - 1 - i]
        vals[unsafe_offset=n - 1 - i] = a


def _top_values(s: F32P, V: Int, k: Int, buf: F32P):
    """buf[0 .. k) = the k largest values, descending, by insertion (k small)."""
    var n = 0
    for i in range(V):
        var x = s[unsafe_offset=i]
        if n == k and not x > buf[unsafe_offset=k - 1]:
            continue
        var j = n if n < k else k - 1  # insertion point from the end: smaller ones move down
        while j > 0 and buf[unsafe_offset=j - 1] < x:
            buf[unsafe_offset=j] = buf[unsafe_offset=j - 1]
            j -= 1
        buf[unsafe_offset=j] = x
        if n < k:
            n += 1


def _threshold_small_k(s: F32P, V: Int, v0: Float32, k: Int, top_p: Float32, buf: F32P) -> Float32:
    """The threshold for a small top-k: its values in a sorted buffer."""
    _top_values(s, V, k, buf)
    var vk = buf[unsafe_offset=k - 1]
    var above = 0  # tokens above the k-th value: all in the buffer
    while buf[unsafe_offset=above] > vk:
        above += 1
    var limit = top_p * Float32(_top_k_total(s, V, v0, vk, k - above))
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


def _fill_bins(s: F32P, V: Int, v0: Float32, count: I32P, mass: F64P) -> Float64:
    """Counts and float64 masses per bin; returns the sum of every w in token-id order
    (the total when top-k is off), the adds of which run beside the bins' own."""
    for b in range(NB):
        count[unsafe_offset=b] = 0
        mass[unsafe_offset=b] = 0
    var total = Float64(0)
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        var wv = exp(sv - v0)
        var bv = _bucket(sv, v0)
        for l in range(W):
            var w = Float64(wv[l])
            var b = Int(bv[l])
            count[unsafe_offset=b] += 1
            mass[unsafe_offset=b] += w
            total += w
        i += W
    for j in range(i, V):
        var x = s[unsafe_offset=j]
        var w = Float64(exp(x - v0))
        var b = Int(_bucket[1](x, v0)[0])
        count[unsafe_offset=b] += 1
        mass[unsafe_offset=b] += w
        total += w
    return total


def _collect(s: F32P, V: Int, v0: Float32, b: Int, buf: F32P) -> Int:
    """buf = the values in bin b, sorted descending; returns how many."""
    var n = 0
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        var bv = _bucket(sv, v0)
        if bv.eq(Int32(b)).reduce_or():
            for l in range(W):
                if Int(bv[l]) == b:
                    buf[unsafe_offset=n] = sv[l]
                    n += 1
        i += W
    for j in range(i, V):
        var x = s[unsafe_offset=j]
        if Int(_bucket[1](x, v0)[0]) == b:
            buf[unsafe_offset=n] = x
            n += 1
    _sort_descending(buf, n)
    return n


def _lowest_above(s: F32P, V: Int, v0: Float32, b: Int) -> Float32:
    """The smallest value in bins 0 .. b - 1 (b = NB: the smallest of the row)."""
    var lowest = Float32.MAX
    for j in range(V):
        var x = s[unsafe_offset=j]
        if Int(_bucket[1](x, v0)[0]) < b:
            lowest = min(lowest, x)
    return lowest


def _kth_value(s: F32P, V: Int, v0: Float32, k: Int, count: I32P, buf: F32P, mut above: Int) -> Float32:
    """The k-th largest value, from the bins' counts and a sort of its bin; ``above`` =
    how many tokens are larger."""
    var seen = 0
    var b = 0
    while seen + Int(count[unsafe_offset=b]) < k:
        seen += Int(count[unsafe_offset=b])
        b += 1
    _ = _collect(s, V, v0, b, buf)
    var vk = buf[unsafe_offset=k - seen - 1]
    above = seen
    while buf[unsafe_offset=above - seen] > vk:
        above += 1
    return vk


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
    var count = I32P(unsafe_from_address=Int(scratch.count.unsafe_ptr()))
    var mass = F64P(unsafe_from_address=Int(scratch.mass.unsafe_ptr()))
    var every = _fill_bins(s, V, v0, count, mass)
    var total = every
    var vk = Float32(0)  # the k-th value (k < V)
    if k < V:
        var above = 0
        vk = _kth_value(s, V, v0, k, count, buf, above)
        total = _top_k_total(s, V, v0, vk, k - above)
    var limit = top_p * Float32(total)
    # Sums of n nonnegative terms in float64 are within n * 2^-53 of their sum's exact
    # value per unit of it; the rule's (up to V terms) and ours (bins: up to V terms, then
    # NB bins, then up to V in the cut's bin) differ by less than (3V + NB) * 2^-53 * every.
    # Twice that covers the adds of the slack itself.
    var slack = Float64(3 * V + NB + 16) * Float64(2.220446049250313e-16) * every
    var before = Float64(0)  # ours for the next token in descending order
    var seen = 0  # tokens in the bins passed
    var lowest = Float32(0)  # the last value passed, when its bin was sorted
    var lowest_known = False
    for b in range(NB):
        var n = Int(count[unsafe_offset=b])
        if n == 0:
            continue
        var after = before + mass[unsafe_offset=b]
        if _side(after, slack, limit) > 0:  # the next bin's first token is kept: all of this bin
            if seen + n >= k:
                return vk if k < V else _lowest_above(s, V, v0, NB)
            before = after
            seen += n
            lowest_known = False
            continue
        _ = _collect(s, V, v0, b, buf)
        for i in range(n):
            if seen + i == k:
                return buf[unsafe_offset=i - 1]
            var side = _side(before, slack, limit)
            if side < 0:
                if i > 0:
                    return buf[unsafe_offset=i - 1]
                return lowest if lowest_known else _lowest_above(s, V, v0, b)
            if side == 0:
                return _threshold_sorted(s, V, v0, k, limit, buf)
            before += Float64(exp(buf[unsafe_offset=i] - v0))
        seen += n
        lowest = buf[unsafe_offset=n - 1]
        lowest_known = True
        if seen == k:
            return lowest
    return lowest if lowest_known else _lowest_above(s, V, v0, NB)


def _threshold(s: F32P, V: Int, v0: Float32, top_k: Int, top_p: Float32, mut scratch: RowScratch) -> Float32:
    """The smallest scaled value that top-k then top-p keep (the module doc's rule)."""
    if top_k <= 0 and top_p >= 1:
        return NO_THRESHOLD
    var k = V if top_k <= 0 or top_k > V else top_k
    if k <= min(SMALL_K, V // 8):
        return _threshold_small_k(s, V, v0, k, top_p, F32P(unsafe_from_address=Int(scratch.values.unsafe_ptr())))
    return _threshold_by_bins(s, V, v0, k, top_p, scratch)


# ------------------------------------------------------------------ the draw
def _draw_all(row: F32P, V: Int, mx: Float32, u: Float32) -> Int:
    """The inverse CDF over every token (row: the scaled logits, overwritten with the
    cumulative weights)."""
    var i = 0
    while i + W <= V:
        var s = row.unsafe_load[width=W](i)
        row.unsafe_store(i, s.ge(NO_THRESHOLD).select(exp(s - mx), SIMD[F32, W](0)))
        i += W
    for j in range(i, V):
        var s = row[unsafe_offset=j]
        row[unsafe_offset=j] = exp(s - mx) if s >= NO_THRESHOLD else Float32(0)
    var last = V - 1  # the last token with weight (where rounding may put the draw), else 0
    while last > 0 and not row[unsafe_offset=last] > 0:
        last -= 1
    # the cumulative weights, accumulated in float64 in token-id order
    var acc = Float64(0)
    for j in range(V):
        acc += Float64(row[unsafe_offset=j])
        row[unsafe_offset=j] = Float32(acc)
    var target = u * row[unsafe_offset=V - 1]
    # the number of cumulative weights <= target: they rise, so the first one above it
    var lo = 0
    var hi = V
    while lo < hi:
        var mid = (lo + hi) // 2
        if row[unsafe_offset=mid] <= target:
            lo = mid + 1
        else:
            hi = mid
    return min(lo, last)


def _kept_sum(s: F32P, V: Int, mx: Float32, thr: Float32, stop: Float32, mut last: Int) -> Float64:
    """The float64 sum in token-id order of the weights of the tokens with s >= thr, the
    others adding zero as in the dense draw. With ``stop`` >= 0 it stops at the first token
    where the sum, rounded to float32, exceeds stop, and ``last`` is that token; otherwise
    ``last`` is the last token with weight."""
    var acc = Float64(0)
    var i = 0
    while i + W <= V:
        var sv = s.unsafe_load[width=W](i)
        if sv.ge(thr).reduce_or():
            var wv = sv.ge(thr).select(exp(sv - mx), SIMD[F32, W](0))
            for l in range(W):
                if wv[l] > 0:
                    acc += Float64(wv[l])
                    last = i + l
                    if stop >= 0 and Float32(acc) > stop:
                        return acc
        i += W
    for j in range(i, V):
        var x = s[unsafe_offset=j]
        var w = exp(x - mx) if x >= thr else Float32(0)
        if w > 0:
            acc += Float64(w)
            last = j
            if stop >= 0 and Float32(acc) > stop:
                return acc
    return acc


def _draw_kept(s: F32P, V: Int, mx: Float32, thr: Float32, u: Float32) -> Int:
    """The dense draw's token when a threshold keeps a few: the same float64 sums, over
    the kept tokens only (zeros change no sum), twice: the total, then up to the target."""
    var last = 0
    var target = u * Float32(_kept_sum(s, V, mx, thr, -1, last))
    var drawn = last  # rounding may put the target at the total: the last token with weight
    _ = _kept_sum(s, V, mx, thr, target, drawn)
    return drawn


def choose_token(
    row: F32P, V: Int, temperature: Float32, top_k: Int, top_p: Float32, seed: UInt64, counter: Int64,
    filtered: Bool, mut scratch: RowScratch,
) -> Int:
    """See the module doc. ``row`` is overwritten."""
    if temperature <= 0:
        return first_argmax(row, V)
    var mx = _scale(row, V, _divisor(temperature))
    var u = uniform(seed, counter)
    var thr = _threshold(row, V, mx, top_k, top_p, scratch) if filtered else NO_THRESHOLD
    if thr == NO_THRESHOLD:
        return _draw_all(row, V, mx, u)
    return _draw_kept(row, V, mx, thr, u)
