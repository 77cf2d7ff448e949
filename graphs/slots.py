"""Regrouping a batch's states on the device: the slot pool's refill.

When sequences finish and others start, the next batch is made of some rows of
the running batch (``pool``) and some rows of freshly prefilled states
(``fresh``: one row per distinct prompt; the samples of one prompt take the same
row, i.e. fork its state). One gather does it on the device, so no state goes
through the host: only the row index [B] crosses.
"""

from __future__ import annotations

from collections.abc import Sequence

from max.graph import DeviceRef, Graph, TensorType, ops

from .ops import F32, I64


def build_regroup_graph(name: str, n_layers: int, row_shape: Sequence[int], device: DeviceRef) -> Graph:
    """states [L, B, *row_shape] float32, batch on axis 1 (every architecture's layout).

    Inputs: pool [L, P, ...], fresh [L, F, ...] (P or F may be 0), index [B] int64
    (values in 0 .. P + F - 1: below P a pool row, else fresh row ``index - P``).
    Output: [L, B, ...], row b = ``concat(pool, fresh)[:, index[b]]``.
    """
    input_types = [TensorType(F32, [n_layers, "pool", *row_shape], device),
                   TensorType(F32, [n_layers, "fresh", *row_shape], device),
                   TensorType(I64, ["batch"], device)]
    with Graph(name, input_types=input_types) as g:
        pool, fresh, index = (v.tensor for v in g.inputs)
        g.output(ops.gather(ops.concat([pool, fresh], axis=1), index, axis=1))
    return g


__all__ = ["build_regroup_graph"]
