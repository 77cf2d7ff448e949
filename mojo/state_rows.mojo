"""Rows of a per-sample state written in place: what one PHA decode step changes in
its state (graphs/pha/decode.py), without copying the rest (the KV caches).

    srm_write_state_rows(states [L, B, X] f32, mutable; rows [L, B, R, w] f32;
                         index [B, R] int64; after [B, V] f32) -> written [L, B, R, w]

For every l, b, r: states[l, b, index[b, r] * w : (index[b, r] + 1) * w] = rows[l, b, r].
Each (b, r) names a row of w floats of the state seen as ``[L, B, X / w, w]``; the
same row index serves every layer. ``written`` repeats ``rows`` (the op's work items
are its elements). ``after`` is not read: it orders the op. The graph reads the
state through a view of the buffer (``ops.buffer_load``), and MAX schedules an op
once its inputs are ready, so the write must take a value computed from every
read of the state (the step's logits), or it may run while a read still goes on. A row that would fall outside ``[0, X)`` is not written: the
caller keeps every index in range, this only keeps a bad one from writing into
another sample. CPU and GPU (one ``foreach`` work item per vector of a row).
"""
from std.utils.index import IndexList

from extensibility import InputTensor, OutputTensor, foreach, register
from extensibility import _MutableInputTensor as MutableInputTensor
from layout import Coord
from max.gpu.host import DeviceContext


@register("srm_write_state_rows")
struct SrmWriteStateRows:
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
        var X = states.dim_size(2)
        if rows.dim_size(0) != states.dim_size(0) or rows.dim_size(1) != states.dim_size(1):
            raise Error("srm_write_state_rows: rows must be [L, B, R, w] for states [L, B, X]")
        if index.dim_size(0) != rows.dim_size(1) or index.dim_size(1) != rows.dim_size(2):
            raise Error("srm_write_state_rows: index must be [B, R] for rows [L, B, R, w]")

        def f[
            width: Int
        ](idx: Coord[...]) {var states, var rows, var index, var w, var X} -> SIMD[written.dtype, width]:
            var l = Int(idx[0].value())
            var b = Int(idx[1].value())
            var r = Int(idx[2].value())
            var j = Int(idx[3].value())
            var x = rows.load[width](IndexList[4](l, b, r, j))
            var row = Int(index[b, r])
            if row >= 0 and (row + 1) * w <= X:
                states.store[width](IndexList[3](l, b, row * w + j), x)
            return x

        foreach[target=target](f, written, ctx)
