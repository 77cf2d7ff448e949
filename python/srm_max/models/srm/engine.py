"""The SRM's MAX engine: compiled graphs for one config.

``Engine(config, weights, dtype, device)`` builds (or loads from the ``.mef``
cache, see ``compile_cache``) per (config shape, weight dtype, device) the graphs of
``runtime.compiled``'s kinds: the prefill (which also scores), the sample graph (the
first token after a prefill), the regroup of the slot pool's states, and the decode:
with the Mojo ops on a CPU ``srm_decode_steps_*``, all of a call's steps inside one op,
each token chosen greedily or drawn there by the sampler's rules (see
graphs/srm/decode.py); elsewhere the decode graph's loop. Batch size, prompt length and
the number of decode steps per call are symbolic, so these graphs serve every request.
Prefill and score take each sample's start: the tokens it has already read and the
state it reached there (zeros for a fresh prompt). Weights are bound at load time by name.

The rest (lazy loading, the decode call, threads) is ``runtime.compiled``.
"""

from __future__ import annotations

import numpy as np
from max.driver import CPU, Buffer

from ...graphs.ops import cpu_ops_run
from ...graphs.srm import CHUNK
from ...runtime.compiled import CompiledGraphs, check_shapes, right_padded, session_weights
from . import build, packing, schema
from .config import SRMConfig


def weights_registry(config: SRMConfig, weights: dict[str, np.ndarray], dtype: str,
                     packed: bool = False) -> dict:
    """name -> array/Buffer for ``session.init``: every tensor the graphs read
    (``schema.graph_weights``), and with ``packed`` the matrices' packed copies
    (``packing``) that the decode op and the prefill with the Mojo ops read."""
    full = schema.graph_weights(config, weights)
    matrices = schema.matrix_names(config)
    if packed:
        full |= packing.decode_step_weights(config, full)
        matrices |= packing.matrix_names()
    return session_weights(full, matrices, dtype)


class Engine(CompiledGraphs):
    """Compiled SRM graphs for one config, weight dtype and device."""

    build_graph = staticmethod(build.build_graph)
    graph_salt = build.GRAPH_SALT
    supports_start_state = True  # its prefill (which also scores) takes each sample's start state

    def __init__(self, config: SRMConfig, weights: dict[str, np.ndarray], dtype: str = "float32",
                 device: str = "cpu", kernels: bool | None = None):
        """``kernels``: the Mojo custom ops (``mojo/``) instead of plain MAX ops: the
        mixer scan in prefill, and in decode the whole step as one op on the CPU
        (mojo/decode_step.mojo, on copies of the matrices packed at load: they
        take as much memory again) or the mixer update on a GPU. Default: on the
        CPU, where bench/mixer_kernels.py and bench/cpu_decode.py measured them
        faster; off on a GPU, where they have not run."""
        self.config = config
        self._start(dtype, device)
        self.kernels = isinstance(self.device, CPU) if kernels is None else bool(kernels)
        check_shapes(schema.checkpoint_shapes(config), weights)
        # the packed copies wherever the Mojo ops run on a CPU: the whole-step op reads them
        # in the decode graphs and the prefill's dense layers do (build.py), whichever
        # decode graph a caller takes (steps_in_one_op)
        self._open(weights_registry(config, weights, self.dtype, packed=cpu_ops_run(self.kernels, self.device_ref)))

    def empty_states(self, batch: int) -> Buffer:
        c = self.config
        return self.to_device(np.zeros((c.n_layers, batch, c.n_heads, c.head_dim), np.float32))

    def _prefix_inputs(self, rows: list, lengths: np.ndarray, start: np.ndarray,
                       start_states: Buffer | None) -> list[Buffer]:
        """The graphs' shared inputs (graphs/srm/prefill.py): ids, pos, last, start, init."""
        B, C = len(rows), CHUNK
        nc = -(-int(lengths.max()) // C)
        ids = right_padded(rows, nc * C).reshape(B, nc, C)
        pos = np.arange(nc * C, dtype=np.int64).reshape(nc, C)
        last = np.stack([(lengths - 1) // C, (lengths - 1) % C], 1).astype(np.int64)
        init = self.empty_states(B) if start_states is None else start_states
        return [self.to_device(ids), self.to_device(pos), self.to_device(last), self.to_device(start), init]

    def _run_prefill(self, rows, lengths, start, start_states, scoring) -> list[Buffer]:
        return self.prefill_model.execute(*self._prefix_inputs(rows, lengths, start, start_states), *scoring)


__all__ = ["Engine", "weights_registry"]
