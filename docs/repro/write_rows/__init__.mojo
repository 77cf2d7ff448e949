"""One op for docs/repro/virtual_target_runtime_fault.py: rows of a state buffer written in place.

    repro_write_rows(states [L, B, X] f32, mutable; rows [L, B, R, w] f32;
                     index [B, R] int64; after [B, V] f32) -> written [L, B, R, w]

states[l, b, index[b, r] * w + j] = rows[l, b, r, j]; ``after`` is not read, it only
orders the op after the graph's reads of the state.
"""
from std.utils.index import IndexList

from extensibility import InputTensor, OutputTensor, foreach, register
from extensibility import _MutableInputTensor as MutableInputTensor
from layout import Coord
from max.gpu.host import DeviceContext


@register("repro_write_rows")
struct ReproWriteRows:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        written: OutputTensor[dtype=DType.float32, rank=4, ...],
        states: MutableInputTensor[dtype=written.dtype, rank=3, ...],
        rows: InputTensor[dtype=written.dtype, rank=4, ...],
        index: InputTensor[dtype=DType.int64, rank=2, ...],
        after: InputTensor[dtype=written.dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var w = rows.dim_size(3)

        def f[
            width: Int
        ](idx: Coord[...]) {var states, var rows, var index, var w} -> SIMD[written.dtype, width]:
            var l = Int(idx[0].value())
            var b = Int(idx[1].value())
            var r = Int(idx[2].value())
            var j = Int(idx[3].value())
            var x = rows.load[width](IndexList[4](l, b, r, j))
            states.store[width](IndexList[3](l, b, Int(index[b, r]) * w + j), x)
            return x

        foreach[target=target](f, written, ctx)
