"""Graph pieces every architecture's graphs share (plain MAX ops).

Weights are named ``max.graph.Weight`` objects bound at load time, so one compiled
graph serves every checkpoint of the same shape. Precision: activations and states
are float32; the big matrices take the weight dtype (float32 or bfloat16), and
``linear`` casts its input to it and its result back to float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops

from .op_names import OP_LINEAR, OP_LINEAR_PACKED

F32 = DType.float32
I64 = DType.int64
U64 = DType.uint64
# srm_linear_packed's activations (mojo/linear_packed.mojo ACT_*), and each as plain ops
ACT_NONE, ACT_GELU, ACT_SILU = 0, 1, 2
ACTIVATIONS = {None: ACT_NONE, "gelu": ACT_GELU, "silu": ACT_SILU}
_PLAIN_ACTIVATIONS = {"gelu": ops.gelu, "silu": ops.silu}


def cpu_ops_run(kernels: bool, device: DeviceRef) -> bool:
    """Whether a graph takes the Mojo ops that are CPU code only (the whole decode step in
    one op, and the loop of decode steps around it): the Mojo ops asked for, on a CPU."""
    return kernels and device.is_cpu()


class NamedWeights:
    """A graph's named weights for one config (created once per graph): each name
    becomes one ``Weight``; the big matrices take ``wdtype``."""

    def __init__(self, config, wdtype: DType, device: DeviceRef):
        self.config = config
        self.wdtype = wdtype
        self.device = device
        self._cache: dict[str, Weight] = {}

    def get(self, name: str, shape, dtype: DType = F32) -> Weight:
        if name not in self._cache:
            self._cache[name] = Weight(name, dtype, list(shape), self.device)
        return self._cache[name]

    def matrix(self, name: str, shape) -> Weight:
        return self.get(name, shape, self.wdtype)



@dataclass(frozen=True)
class PackedWeights:
    """Copies of a graph's matrices that an engine packed at load, in the weights' dtype
    (srm_max/models/srm/packing.py ``pack_matrix``'s layout), by the weight's name: the
    flat array that holds the copy (a graph input or a weight) and where in it the copy
    starts."""

    at: Mapping[str, tuple[TensorValue, int]]
    device: DeviceRef

    @classmethod
    def in_one_array(cls, mats: TensorValue, offsets: Mapping[str, int], device: DeviceRef) -> PackedWeights:
        """Every copy in the one flat array ``mats`` [S], at ``offsets`` by name."""
        return cls({name: (mats, offset) for name, offset in offsets.items()}, device)

    def copy_of(self, w: Weight | TensorValue) -> tuple[TensorValue, int] | None:
        """(the flat array, the offset) of the named weight w's packed copy in w's dtype,
        or None where there is none."""
        found = self.at.get(getattr(w, "name", None))
        return found if found is not None and found[0].dtype == w.dtype else None


# how ``linear`` runs a product: MAX's matmul (None), the linear op on a CPU device, or
# the packed-weight linear op on the engine's packed copies
Dense = DeviceRef | PackedWeights | None


def rows_at(x: TensorValue, at: TensorValue) -> TensorValue:
    """x [B, ..., d] (positions in order between the first and last axis) at the positions
    ``at`` [B, R] -> [B, R, d]."""
    return ops.gather_nd(ops.reshape(x, [x.shape[0], -1, x.shape[-1]]), ops.unsqueeze(at, -1), batch_dims=1)


@dataclass(frozen=True)
class KeptRows:
    """A prefill's last block: the R positions per sample whose output the graph uses (the
    last token's, the scored ones), ``at`` [B, R] int64; called on a tensor [B, ..., X] of
    every position, its rows there [B, R, X]."""

    at: TensorValue

    def __call__(self, x: TensorValue) -> TensorValue:
        return rows_at(x, self.at)


Rows = KeptRows | None  # None: every row


def linear(x: TensorValue, w: Weight | TensorValue, b: TensorValue | None = None,
           op_device: Dense = None, activation: str | None = None, times: TensorValue | None = None) -> TensorValue:
    """x [..., in] @ w[out, in]^T + b as float32; with ``activation`` ("gelu": the exact
    GELU, "silu"), that of it; with ``times`` (shaped as the result), that times ``times``.

    ``ops.matmul`` in w's dtype: the input cast to it, the result back to float32 (with
    bfloat16 weights both round to bfloat16). With ``op_device`` (a CPU device whose graph
    loads the kernel library), through the Mojo op srm_linear (mojo/linear.mojo) instead,
    which rounds where the matmul does: its register-tiled product does more of the FMA
    peak than ``ops.matmul`` at these models' shapes, and a graph whose products all take
    it compiles no matmul kernel, the dearest kind to compile (docs/testing.md). That op
    packs w on every call; with ``PackedWeights`` (w a named weight whose packed copy, in
    w's dtype, they hold) the op srm_linear_packed (mojo/linear_packed.mojo) reads the
    copy packed at load instead, rounding as the others do, and applies the activation
    and the product by ``times`` to its tiles in cache (one pass over the output less
    each)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}")
    if not isinstance(op_device, PackedWeights):
        y = _linear(x, w, b, op_device)
        y = _PLAIN_ACTIVATIONS[activation](y) if activation else y
        return y if times is None else y * times
    n_out = int(w.shape[0])
    copy = op_device.copy_of(w)
    if copy is None:
        raise ValueError(f"no packed {w.dtype} copy of the weight {getattr(w, 'name', None)!r}")
    device = op_device.device
    mats, offset = copy
    x = rounded_to_weights(x, w.dtype)
    layer = const(np.array([offset, ACTIVATIONS[activation]], np.int64), I64, device)
    scale = const(np.zeros((0, 0), np.float32), F32, device) if times is None else ops.reshape(times, [-1, n_out])
    return _rows_op(OP_LINEAR_PACKED, x, [mats, layer, _bias(b, n_out, device), scale], n_out, device)


def _linear(x: TensorValue, w: Weight | TensorValue, b: TensorValue | None, op_device: DeviceRef | None):
    """``linear`` by MAX's matmul or by srm_linear on ``op_device``."""
    if op_device is None:
        h = x if x.dtype == w.dtype else ops.cast(x, w.dtype)
        y = ops.matmul(h, ops.transpose(w, 0, 1))
        if y.dtype != F32:
            y = ops.cast(y, F32)
        return y if b is None else y + b
    n_out = int(w.shape[0])
    return _rows_op(OP_LINEAR, rounded_to_weights(x, w.dtype), [w, _bias(b, n_out, op_device)], n_out, op_device)


def rounded_to_weights(x: TensorValue, wdtype: DType) -> TensorValue:
    """x as the Mojo ops on the weights read it (float32), rounded to the weights' dtype as
    the matmul's cast of its input would."""
    return x if wdtype == F32 else ops.cast(ops.cast(x, wdtype), F32)


def _bias(b: TensorValue | None, n_out: int, device: DeviceRef) -> TensorValue:
    """The linear ops' bias: ``b``, or zeros where the layer has none."""
    return const(np.zeros(n_out, np.float32), F32, device) if b is None else b


def _rows_op(name: str, x: TensorValue, operands: list[TensorValue], n_out: int, device: DeviceRef) -> TensorValue:
    """The linear op ``name`` on x's rows (x [..., in] taken as [rows, in], then
    ``operands``), its float32 [rows, n_out] result shaped back to [..., n_out]."""
    rows = ops.reshape(x, [-1, x.shape[-1]])
    y = ops.custom(name, device=device, values=[rows, *operands],
                   out_types=[TensorType(F32, [rows.shape[0], n_out], device)])[0].tensor
    return ops.reshape(y, [*x.shape[:-1], n_out])


_KEEPALIVE: list[np.ndarray] = []


def const(array: np.ndarray, dtype: DType, device: DeviceRef) -> TensorValue:
    """A numpy array as a graph constant (kept referenced until the process ends, so
    its memory outlives every graph that embeds it)."""
    array = np.ascontiguousarray(array)
    _KEEPALIVE.append(array)
    return ops.constant(array, dtype, device=device)


def floor_div_nonnegative(x: TensorValue, divisor: int) -> TensorValue:
    """x // divisor for int64 x >= 0 and a positive int ``divisor``. ``ops.floor_div``'s
    correction for signed operands tests the divisor's sign, a test of a constant alone,
    which MAX computes at compile time in a compiled subgraph of its own (seconds of
    every compile); unsigned division needs no correction."""
    quotient = ops.floor_div(ops.cast(x, U64), ops.constant(divisor, U64, device=x.device))
    return ops.cast(quotient, I64)


def clamp_max(x: TensorValue, hi: int) -> TensorValue:
    """min(x, hi) for an int64 tensor, by arithmetic (see ``floor_at``)."""
    over = ops.cast(x > hi, x.dtype)
    return x - over * (x - hi)


def floor_at(x: TensorValue, lo: float) -> TensorValue:
    """max(x, lo) for a float tensor, by arithmetic (as ``clamp_max``)."""
    under = ops.cast(x < lo, x.dtype)
    return x + under * (lo - x)


def per_channel(x: TensorValue, n_groups: int, width: int, device: DeviceRef) -> TensorValue:
    """x [..., G] -> [..., G * width]: each group's value repeated over its channels (a gather
    along the last axis; no matmul, no broadcast of a size-1 axis)."""
    index = const(np.repeat(np.arange(n_groups, dtype=np.int64), width), I64, device)
    return ops.gather(x, index, axis=x.rank - 1)


class HeadKinds:
    """Per channel [d], a value on the column-repeat heads (the first half) and another on
    the row heads, by multiplication with two constant 0/1 masks (not ``ops.where``). Each
    mask is a constant of its own: one computed from the other (1 - mask) is arithmetic on
    constants alone, which MAX computes at compile time in a compiled subgraph of its own
    (seconds of every compile)."""

    def __init__(self, n_heads: int, head_dim: int, device: DeviceRef):
        m = np.repeat((np.arange(n_heads) < n_heads // 2).astype(np.float32), head_dim)
        self.column, self.row = const(m, F32, device), const(1.0 - m, F32, device)

    def one_on_columns(self, on_row: TensorValue) -> TensorValue:
        """1 on the column heads' channels, ``on_row`` on the row heads'."""
        return self.column + self.row * on_row

    def one_on_rows(self, on_column: TensorValue) -> TensorValue:
        """``on_column`` on the column heads' channels, 1 on the row heads'."""
        return self.column * on_column + self.row
