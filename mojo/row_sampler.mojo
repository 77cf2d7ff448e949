"""One token from one row of logits, as graphs/sampler.py draws it (no op here: the
decode ops of decode_step.mojo call it per row).

    choose_token(row [V] f32 logits (overwritten), V, temperature, top_k, top_p, seed,
                 counter, filtered, buf [V] f32 scratch) -> token id

temperature 0 is greedy: the first index of the largest logit. Otherwise, on the
logits scaled by 1 / max(temperature, 1e-6): with ``filtered`` (the batch has a top-k
or top-p sample) the threshold that top-k then top-p keep (every token at least as
large as the last kept value), then the inverse CDF in token-id order at ONE uniform
from the Squares RNG keyed by the seed at ``counter`` (the new token's position).
Bit for bit the graph's arithmetic: float32 scaling and exp, cumulative sums
accumulated in float64 and rounded to float32 (as MAX's cumsum), the same compares.
"""
from std.math import exp
from std.sys import simd_width_of

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime NO_THRESHOLD: Float32 = -3.0e38  # graphs/sampler.py: no filter
# A top-k of at most min(SMALL_K, V / 8) keeps its values in a sorted buffer (a few
# insertions per row); a larger one, and top-p alone, sorts the row.
comptime SMALL_K = 64
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


@always_inline
def _divisor(temperature: Float32) -> Float32:
    """floor_at(temperature, 1e-6) by the graph's arithmetic: t + (t < lo) * (lo - t)."""
    comptime lo: Float32 = 1e-6
    return temperature + (lo - temperature) if temperature < lo else temperature


def _top_values(row: F32P, V: Int, t: Float32, k: Int, buf: F32P):
    """buf[0 .. k) = the k largest scaled logits, descending (k <= V)."""
    if k > min(SMALL_K, V // 8):
        for i in range(V):
            buf[unsafe_offset=i] = row[unsafe_offset=i] / t
        sort(Span[Float32, MutUntrackedOrigin](unsafe_ptr=buf, length=V))  # ascending
        for i in range(V // 2):  # descending
            var a = buf[unsafe_offset=i]
            buf[unsafe_offset=i] = buf[unsafe_offset=V - 1 - i]
            buf[unsafe_offset=V - 1 - i] = a
        return
    var n = 0
    for i in range(V):
        var s = row[unsafe_offset=i] / t
        if n == k and not s > buf[unsafe_offset=k - 1]:
            continue
        var j = n if n < k else k - 1  # insertion point from the end: smaller ones move down
        while j > 0 and buf[unsafe_offset=j - 1] < s:
            buf[unsafe_offset=j] = buf[unsafe_offset=j - 1]
            j -= 1
        buf[unsafe_offset=j] = s
        if n < k:
            n += 1


def _threshold(row: F32P, V: Int, t: Float32, top_k: Int, top_p: Float32, buf: F32P) -> Float32:
    """The smallest scaled logit that top-k then top-p keep (graphs/sampler.py ``_threshold``):
    over the values in descending order, w = exp(v - v0) for the first k, before = the
    exclusive cumulative sum, total = the inclusive one's last; keep those with
    before < top_p * total."""
    if top_k <= 0 and top_p >= 1:
        return NO_THRESHOLD
    var k = V if top_k <= 0 or top_k > V else top_k
    _top_values(row, V, t, k, buf)
    var v0 = buf[unsafe_offset=0]
    var total = Float64(0)
    for j in range(k):
        total += Float64(exp(buf[unsafe_offset=j] - v0))
    var limit = top_p * Float32(total)
    var before = Float64(0)
    var m = 0
    while m < k and Float32(before) < limit:
        before += Float64(exp(buf[unsafe_offset=m] - v0))
        m += 1
    return buf[unsafe_offset=m - 1]


def choose_token(
    row: F32P, V: Int, temperature: Float32, top_k: Int, top_p: Float32, seed: UInt64, counter: Int64,
    filtered: Bool, buf: F32P,
) -> Int:
    """See the module doc. ``row`` is overwritten with the draw's cumulative weights."""
    if temperature <= 0:
        return first_argmax(row, V)
    var t = _divisor(temperature)
    var thr = _threshold(row, V, t, top_k, top_p, buf) if filtered else NO_THRESHOLD
    var mv = SIMD[F32, W](-Float32.MAX)
    var i = 0
    while i + W <= V:
        mv = max(mv, row.unsafe_load[width=W](i) / t)
        i += W
    var mx = mv.reduce_max()
    for j in range(i, V):
        mx = max(mx, row[unsafe_offset=j] / t)
    # the weights, in place
    i = 0
    while i + W <= V:
        var s = row.unsafe_load[width=W](i) / t
        row.unsafe_store(i, s.ge(thr).select(exp(s - mx), SIMD[F32, W](0)))
        i += W
    for j in range(i, V):
        var s = row[unsafe_offset=j] / t
        row[unsafe_offset=j] = exp(s - mx) if s >= thr else Float32(0)
    var last = V - 1  # the last token with weight (where rounding may put the draw), else 0
    while last > 0 and not row[unsafe_offset=last] > 0:
        last -= 1
    # the cumulative weights, accumulated in float64 in token-id order
    var acc = Float64(0)
    for j in range(V):
        acc += Float64(row[unsafe_offset=j])
        row[unsafe_offset=j] = Float32(acc)
    var target = uniform(seed, counter) * row[unsafe_offset=V - 1]
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
