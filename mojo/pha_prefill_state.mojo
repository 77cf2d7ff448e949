"""Every layer's decode state from what a PHA prefill found, on the CPU, in one pass.

    pha_prefill_state(parts: L groups of rank-4 f32 tensors, one group per layer:
                        its GSS state as [B, 1, 1, G] (with the GSS branch), then its keys
                        and its values [B, T, Hkv, dh] (with the attention))
        -> states [L, B, X] f32

The state's layout (graphs/pha/model.py ``StateLayout``): the GSS state (G floats, none
without the branch), then the keys' cache and the values' cache, each [Hkv, n, dh]
(head-major), n = (X - G) / (2 Hkv dh) the context. Cache row i of a head holds the
prompt's row i for i < min(T, n) and zeros after (padding rows past a prompt's length are
copied as they are: no decode step reads them). The group's size (parts / L: 1, 2 or 3)
says which of the three a layer has. That is what ``PrefillStates`` builds with plain ops
(the GPU path, and this op's reference): per layer the keys' and values' heads transposed,
concatenated with the GSS state and gathered into place, then the layers stacked, each
a copy (MAX's CPU concatenation is the slowest of them), where this op reads every input
once and writes the states once.

Work: a unit is one (layer, sample, cache, head): its rows copied, the rest of its cache
zeroed; the first unit of each layer and sample also copies its GSS state (a unit per layer
and sample without the attention). Units are split evenly over one worker per core. The
tensors must be contiguous and row-major.
"""
from std.sys import num_physical_cores, simd_width_of

from extensibility import InputVariadicTensors, OutputTensor, register
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext

comptime F32 = DType.float32
comptime W = simd_width_of[F32]()
comptime F32P = Pointer[Float32, MutUntrackedOrigin]
comptime MAX_WORKERS = 8


@fieldwise_init
struct Placement(ImplicitlyCopyable, Movable):
    """Sizes and addresses of one call: ``parts`` holds the parts' addresses, ``per_layer`` a layer's."""

    var L: Int
    var B: Int
    var T: Int
    var Hkv: Int  # 0 without the attention
    var dh: Int
    var n: Int
    var G: Int
    var X: Int
    var per_layer: Int
    var parts: Pointer[Int, MutUntrackedOrigin]
    var states: F32P


def _copy(dst: F32P, src: F32P, count: Int):
    var i = 0
    while i + W <= count:
        dst.unsafe_store(i, src.unsafe_load[width=W](i))
        i += W
    while i < count:
        dst[unsafe_offset=i] = src[unsafe_offset=i]
        i += 1


def _zero(dst: F32P, count: Int):
    var i = 0
    while i + W <= count:
        dst.unsafe_store(i, SIMD[F32, W](0))
        i += W
    while i < count:
        dst[unsafe_offset=i] = 0
        i += 1


def _part(a: Placement, l: Int, j: Int) -> F32P:
    return F32P(unsafe_from_address=a.parts[unsafe_offset=l * a.per_layer + j])


def _unit(a: Placement, u: Int):
    """u = ((l * B + b) * 2 + c) * Hkv + h: layer l's sample b, cache c (0: keys, 1: values)
    of head h; without the attention u = l * B + b, its GSS state alone."""
    var per_sample = 2 * a.Hkv if a.Hkv > 0 else 1
    var s = u // per_sample
    var l = s // a.B
    var b = s % a.B
    var row = a.states.unsafe_offset(s * a.X)
    var first = u % per_sample == 0
    if first and a.G > 0:
        _copy(row, _part(a, l, 0).unsafe_offset(b * a.G), a.G)
    if a.Hkv == 0:
        return
    var h = u % a.Hkv
    var c = (u // a.Hkv) % 2
    var cache = row.unsafe_offset(a.G + (c * a.Hkv + h) * a.n * a.dh)
    var src = _part(a, l, a.per_layer - 2 + c).unsafe_offset((b * a.T * a.Hkv + h) * a.dh)
    var rows = min(a.T, a.n)
    for i in range(rows):
        _copy(cache.unsafe_offset(i * a.dh), src.unsafe_offset(i * a.Hkv * a.dh), a.dh)
    if rows < a.n:
        _zero(cache.unsafe_offset(rows * a.dh), (a.n - rows) * a.dh)


@register("pha_prefill_state")
struct PhaPrefillState:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        states: OutputTensor[dtype=DType.float32, rank=3, ...],
        parts: InputVariadicTensors[dtype=DType.float32, rank=4, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if target != "cpu":
            raise Error("pha_prefill_state: CPU only")
        var L = states.dim_size(0)
        var B = states.dim_size(1)
        var X = states.dim_size(2)
        if L < 1 or parts.size % L != 0 or parts.size // L > 3:
            raise Error("pha_prefill_state: ", parts.size, " parts for ", L, " layers: expected 1 to 3 per layer")
        var per_layer = parts.size // L
        var addresses = List[Int](capacity=parts.size)
        comptime for i in range(parts.size):
            addresses.append(Int(parts[i].unsafe_ptr()))
        # a layer's parts: [gss as [B, 1, 1, G]] then [keys, values [B, T, Hkv, dh]]
        var G = 0
        var T = 0
        var Hkv = 0
        var dh = 1
        comptime for i in range(parts.size):
            var rows = parts[i].dim_size(1)
            var heads = parts[i].dim_size(2)
            var width = parts[i].dim_size(3)
            if parts[i].dim_size(0) != B:
                raise Error("pha_prefill_state: every part must have the states' ", B, " samples")
            if per_layer != 2 and i % per_layer == 0:  # the GSS state
                if rows != 1 or heads != 1 or (i > 0 and width != G):
                    raise Error("pha_prefill_state: a GSS state must be [B, 1, 1, G], the same G in every layer")
                G = width
            elif i == per_layer - 2:  # the first layer's keys set T, Hkv and dh
                T, Hkv, dh = rows, heads, width
            elif rows != T or heads != Hkv or width != dh:
                raise Error("pha_prefill_state: every layer's keys and values must have the same [B, T, Hkv, dh]")
        if per_layer == 1:
            if X != G:
                raise Error("pha_prefill_state: states' width ", X, " must be the GSS state's ", G)
        elif Hkv < 1 or dh < 1 or X < G or (X - G) % (2 * Hkv * dh) != 0:
            raise Error("pha_prefill_state: states' width ", X, " must be the GSS state's ", G,
                        " plus two caches of Hkv x n x dh = ", Hkv, " x n x ", dh)
        var n = (X - G) // (2 * Hkv * dh) if per_layer > 1 else 0
        var a = Placement(L, B, T, Hkv if per_layer > 1 else 0, dh, n, G, X, per_layer,
                          Pointer[Int, MutUntrackedOrigin](unsafe_from_address=Int(addresses.unsafe_ptr())),
                          F32P(unsafe_from_address=Int(states.unsafe_ptr())))
        var units = L * B * (2 * a.Hkv if a.Hkv > 0 else 1)
        if units == 0:
            return
        var workers = max(1, min(num_physical_cores(), MAX_WORKERS, units))
        var per = (units + workers - 1) // workers

        def work(i: Int) {var a, var per, var units}:
            for u in range(i * per, min(units, (i + 1) * per)):
                _unit(a, u)

        sync_parallelize(work, workers)
        _ = addresses^
