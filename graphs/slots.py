"""Regrouping a batch's states on the device: the slot pool's refill.

When sequences finish and others start, the next batch is made of some rows of
the running batch (``pool``) and some rows of freshly prefilled states
(``fresh``: one row per distinct prompt; the samples of one prompt take the same
row, i.e. fork its state). Gathers do it on the device, so no state goes through
the host: only the row choices [B] cross. A refill whose fresh rows take the slots of
finished rows, every other row staying in its own, needs no gather (``slots_taken``):
an engine can write the fresh rows into the pool's states where they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, ops

from .ops import F32, I64


def build_regroup_graph(name: str, n_layers: int, row_shape: Sequence[int], device: DeviceRef) -> Graph:
    """states [L, B, *row_shape] float32, batch on axis 1 (every architecture's layout).

    Inputs: pool [L, P, ...], fresh [L, F, ...] (P, F >= 1), and per output row b:
    from_pool [B] bool, pool_rows [B] and fresh_rows [B] int64 (the row it takes from its
    source; any row of the other). Output: [L, B, ...], row b = ``pool[:, pool_rows[b]]``
    where ``from_pool[b]``, else ``fresh[:, fresh_rows[b]]``.

    A gather from each and a choice per row: gathering from the two concatenated along the
    batch axis would first copy both whole, and MAX's CPU concat of an inner axis is far
    slower than a gather.
    """
    input_types = [TensorType(F32, [n_layers, "pool", *row_shape], device),
                   TensorType(F32, [n_layers, "fresh", *row_shape], device),
                   TensorType(DType.bool, ["batch"], device),
                   TensorType(I64, ["batch"], device), TensorType(I64, ["batch"], device)]
    with Graph(name, input_types=input_types) as g:
        pool, fresh, from_pool, pool_rows, fresh_rows = (v.tensor for v in g.inputs)
        choose = ops.reshape(from_pool, [1, -1] + [1] * len(row_shape))
        g.output(ops.where(choose, ops.gather(pool, pool_rows, axis=1), ops.gather(fresh, fresh_rows, axis=1)))
    return g


def slots_taken(index: np.ndarray, pool_rows: int) -> np.ndarray | None:
    """The slots that fresh rows take (rows >= ``pool_rows`` of ``index``) when a regroup
    keeps the batch's size and every other row in its own slot, else None. Such a refill
    needs no gather: the fresh rows can be written into the pool's states where they are."""
    fresh = index >= pool_rows
    if len(index) != pool_rows or (index[~fresh] != np.flatnonzero(~fresh)).any():
        return None
    return np.flatnonzero(fresh)


__all__ = ["build_regroup_graph", "slots_taken"]
