"""The raw log-probabilities of one row of logits, for the decode ops (no op here:
decode_step.mojo calls it per row before the row's token is chosen).

    log_normalizer(row [V] f32, V, n, top_values [n], top_ids [n]) -> (m, lse)
    score_token(row, V, token, n, logprob [1], top_values [n], top_ids [n])

with m the row's max and lse = log(sum(exp(row - m))): a token's log-probability is
``(row[t] - m) - lse``, log_softmax of the raw logits (no temperature, no filters), as
a prefill's scored rows compute it (graphs/scoring.py); ``score_token`` writes it for ``token``. With n >= 1 it also writes the n
largest log-probabilities, descending, and their ids: of equal values the lower id
first, and the lower ids are the ones kept when ties straddle the n-th place.

Two passes over the row, a vector at a time: the max, then the sum of exp(x - m) while a
sorted list of n takes the values of the few vectors holding one above its n-th (in id
order, an equal value never displaces an earlier one). A row (16 KiB at V = 4,096)
stays in the first-level cache between the passes.
"""
from std.math import exp, log
from std.sys import simd_width_of

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime I64P = Pointer[Int64, MutUntrackedOrigin]


@always_inline
def _insert(x: Float32, id: Int, values: F32P, ids: I64P, n: Int, mut count: Int):
    """Puts (x, id) into the descending list values/ids [0 .. count) of at most n, after
    the values equal to x (ids arrive in increasing order)."""
    if count == n and not x > values[unsafe_offset=n - 1]:
        return
    var j = count if count < n else n - 1
    while j > 0 and values[unsafe_offset=j - 1] < x:
        values[unsafe_offset=j] = values[unsafe_offset=j - 1]
        ids[unsafe_offset=j] = ids[unsafe_offset=j - 1]
        j -= 1
    values[unsafe_offset=j] = x
    ids[unsafe_offset=j] = Int64(id)
    if count < n:
        count += 1


def log_normalizer(row: F32P, V: Int, n: Int, top_values: F32P, top_ids: I64P) -> SIMD[F32, 2]:
    """See the module doc: (m, lse). ``row`` is read only; n <= V."""
    var mv = SIMD[F32, W](-Float32.MAX)
    var i = 0
    while i + W <= V:
        mv = max(mv, row.unsafe_load[width=W](i))
        i += W
    var m = mv.reduce_max()
    for j in range(i, V):
        m = max(m, row[unsafe_offset=j])
    var acc = SIMD[F32, W](0)
    var count = 0
    var floor = -Float32.MAX  # the list's n-th value once it is full: below it nothing enters
    i = 0
    while i + W <= V:
        var x = row.unsafe_load[width=W](i)
        acc += exp(x - m)
        if n > 0 and (count < n or x.gt(floor).reduce_or()):
            for l in range(W):
                _insert(x[l], i + l, top_values, top_ids, n, count)
            if count == n:
                floor = top_values[unsafe_offset=n - 1]
        i += W
    var total = acc.reduce_add()
    for j in range(i, V):
        var x = row[unsafe_offset=j]
        total += exp(x - m)
        if n > 0:
            _insert(x, j, top_values, top_ids, n, count)
    var lse = log(total)
    for k in range(n):
        top_values[unsafe_offset=k] = (top_values[unsafe_offset=k] - m) - lse
    return SIMD[F32, 2](m, lse)


def score_token(row: F32P, V: Int, token: Int, n: Int, logprob: F32P, top_values: F32P, top_ids: I64P):
    """logprob[0] = the raw log-probability of ``token`` in ``row``, and the top n (see the
    module doc)."""
    var m_lse = log_normalizer(row, V, n, top_values, top_ids)
    logprob[unsafe_offset=0] = (row[unsafe_offset=token] - m_lse[0]) - m_lse[1]
