"""The CPU decode op (mojo/decode_step.mojo) alone: greedy calls of 32 steps on
bench/cpu_decode.py's model (d 256, 8 layers, 4 heads, n 1024, vocab 4096, ffn 1024),
random weights (float32, or bfloat16 matrices and embedding), no MAX graph around it.

    decode_op BATCH CALLS [WORKERS [DTYPE]]
    -> batch BATCH median_tok_s ... best_tok_s ...

Built by bench/decode_op_ab.py against two versions of mojo/ (imported as the package
``ops``), so that a change to the op is timed by itself, in interleaved rounds. The
matrices are random rather than packed from a model: a product's speed does not depend
on the values.
"""
from std.sys import argv
from std.time import perf_counter_ns

from ops.decode_step import ARGMAX, F32P, I64P, U64P, Step, _run, _workers

comptime STEPS = 32
comptime D = 256
comptime FFN = 1024
comptime VOCAB = 4096
comptime HEADS = 4
comptime CONTEXT = 1024
comptime LAYERS = 8
comptime POSITION = 100  # decode from a mid-context position, as bench/cpu_decode.py


def _random(n: Int, scale: Float32) -> List[Float32]:
    """n values in [-scale/2, scale/2) from a fixed linear congruential sequence."""
    var v = List[Float32](length=n, fill=0)
    var s: UInt64 = 12345
    for i in range(n):
        s = s * 6364136223846793005 + 1442695040888963407
        v[i] = (Float32(Int((s >> 40) & 0xFFFF)) / 65536.0 - 0.5) * scale
    return v^


def _f32(v: List[Float32]) -> F32P:
    return F32P(unsafe_from_address=Int(v.unsafe_ptr()))


def _i64(v: List[Int64]) -> I64P:
    return I64P(unsafe_from_address=Int(v.unsafe_ptr()))


def _as[WD: DType](v: List[Float32]) -> List[Scalar[WD]]:
    """v in the matrices' dtype (rounded to the nearest for bfloat16)."""
    var out = List[Scalar[WD]](length=len(v), fill=0)
    for i in range(len(v)):
        out[i] = v[i].cast[WD]()
    return out^


def main() raises:
    var args = argv()
    if len(args) < 3:
        raise Error("usage: decode_op BATCH CALLS [WORKERS [DTYPE]]")
    var B = Int(args[1])
    var calls = Int(args[2])
    var workers = Int(args[3]) if len(args) > 3 else _workers()
    var dtype = String(args[4]) if len(args) > 4 else String("float32")
    var times: List[Int]
    if dtype == "float32":
        times = _timed_calls[DType.float32](B, calls, workers)
    elif dtype == "bfloat16":
        times = _timed_calls[DType.bfloat16](B, calls, workers)
    else:
        raise Error("unknown dtype: " + dtype)
    sort(times)
    var tokens_per_call = Float64(B * STEPS)
    print(
        "batch", B,
        "median_tok_s", tokens_per_call / (Float64(times[len(times) // 2]) / 1e9),
        "best_tok_s", tokens_per_call / (Float64(times[0]) / 1e9),
    )


def _timed_calls[WD: DType](B: Int, calls: Int, workers: Int) -> List[Int]:
    """The wall time in ns of each of ``calls`` greedy calls of STEPS steps."""
    comptime d = D
    comptime f = FFN
    comptime V = VOCAB
    comptime L = LAYERS
    var scratch = List[Float32](length=B * (f + 3 * d + V), fill=0)  # x, z, y, h, logits
    var x = _f32(scratch)
    var states_in = _random(L * B * d, 0.1)
    var states_out = List[Float32](length=L * B * d, fill=0)
    var positions = List[Int64](length=B, fill=POSITION)
    var clamped = List[Int64](length=B, fill=POSITION)
    var tokens = List[Int64](length=B * STEPS, fill=0)
    var norms = _random(L * 4 * d, 1.0)
    var fc1_b = _random(L * f, 0.1)
    var biases = _random(L * 3 * d, 0.1)
    var w = _random(L * HEADS * CONTEXT, 1.0)
    var beta = _random(L * HEADS * CONTEXT, 0.1)
    var lam = _random(L * HEADS, 1.0)
    var fc1 = _as[WD](_random(L * f * d, 0.1))
    var fc2 = _as[WD](_random(L * d * f, 0.05))
    var proj = _as[WD](_random(L * d * d, 0.1))
    var out = _as[WD](_random(L * d * d, 0.1))
    var head = _as[WD](_random(V * d, 0.1))
    var embedding = _as[WD](_random(V * d, 1.0))
    var step = Step(
        B, d, f, V, HEADS, d // HEADS, CONTEXT, L, 1e-5,
        x, x.unsafe_offset(B * d), x.unsafe_offset(2 * B * d), x.unsafe_offset(3 * B * d),
        x.unsafe_offset(B * (f + 3 * d)),
        _f32(states_in), _f32(states_out), _i64(clamped),
        _f32(norms), _f32(fc1_b), _f32(biases), _f32(w), _f32(beta), _f32(lam),
        Int(fc1.unsafe_ptr()), Int(fc2.unsafe_ptr()), Int(proj.unsafe_ptr()), Int(out.unsafe_ptr()),
        Int(head.unsafe_ptr()), workers, Int(embedding.unsafe_ptr()),
        _i64(positions), _i64(tokens), STEPS, 0,
        # the draw's parameters, unread by a greedy call
        x, _i64(clamped), x, U64P(unsafe_from_address=Int(clamped.unsafe_ptr())), False,
        # no log-probabilities: their outputs are unwritten
        False, x, 0, x, _i64(clamped),
    )
    var times = List[Int]()
    for _ in range(calls):
        var t0 = perf_counter_ns()
        _run[WD, ARGMAX](step)
        times.append(Int(perf_counter_ns() - t0))
    # the op reads these through raw addresses: keep them alive until it has run
    _ = scratch^
    _ = states_in^
    _ = states_out^
    _ = positions^
    _ = clamped^
    _ = tokens^
    _ = norms^
    _ = fc1_b^
    _ = biases^
    _ = w^
    _ = beta^
    _ = lam^
    _ = fc1^
    _ = fc2^
    _ = proj^
    _ = out^
    _ = head^
    _ = embedding^
    return times^
