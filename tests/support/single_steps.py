"""The bit-for-bit reference of the SRM's decode in one op (``srm_decode_steps``, every step
and its token choice inside one op) on a CPU: one step at a time, the whole-step op alone
(``srm_decode_step`` on the engine's own packed weights: the same op, so the same logits
and states), then the engine's sample graph (MAX's sampler, graphs/sampler.py, whose draws
the op's row sampler must match at the same counters)."""

from __future__ import annotations

import numpy as np
from max.driver import Buffer

from srm_max.graphs.op_names import OP_DECODE_STEP
from srm_max.models.srm import packing, schema
from srm_max.runtime.call_types import SamplingArrays
from tests.support.graphs import op_graphs
from tests.support.op_graphs import model as op_graph_model


def single_step_graphs(dtype: str):
    """The marker of the op graph ``decode_in_single_steps`` runs for an engine of ``dtype``
    (its sample graph is among the engine's own)."""
    return op_graphs(OP_DECODE_STEP, dtype=dtype)


def decode_in_single_steps(engine, ids, positions, states: Buffer, sampling: SamplingArrays, steps: int):
    """``steps`` single steps of a CPU SRM engine with the Mojo ops from ``ids`` at
    ``positions`` and ``states``; the token drawn after reading position p has position
    p + 1, its random counter (as in the decode op). -> (tokens [B, S], the states after
    the last token but one, the last tokens [B], the positions + S), on the host."""
    c = engine.config
    step = op_graph_model(OP_DECODE_STEP, dtype=engine.dtype)
    weights = [_buffer(engine.weights[name]) for name in
               (schema.EMBEDDING, *(packing.PREFIX + k for k in packing.INPUTS))]
    embedding, packed = weights[0], weights[1:]
    eps, vocab = np.array([c.layer_norm_eps], np.float32), np.zeros(c.vocab_size, np.float32)
    ids, positions = np.asarray(ids, np.int64), np.asarray(positions, np.int64)
    rows, tokens = np.arange(len(ids)), []
    for _ in range(steps):
        logits, states = step.execute(_buffer(ids), embedding, states, _buffer(positions), *packed,
                                      _buffer(eps), _buffer(vocab))
        ids = engine.draw(logits, rows, sampling, positions + 1)
        positions = positions + 1
        tokens.append(ids)
    tokens = np.stack(tokens, 1) if tokens else np.zeros((len(ids), 0), np.int64)
    return tokens, engine.host(states), ids, positions


def _buffer(a) -> Buffer:
    return a if isinstance(a, Buffer) else Buffer.from_numpy(np.ascontiguousarray(a))
