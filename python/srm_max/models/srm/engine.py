"""The SRM's MAX engine: compiled prefill, score and decode graphs for one config.

``Engine(config, weights, dtype, device)`` builds (or loads from the ``.mef``
cache, see ``compile_cache``) three graphs per (config shape, weight dtype,
device): ``srm_prefill_*``, ``srm_score_*`` and ``srm_decode_*``; batch size, prompt
length and the number of decode steps per call are symbolic, so these graphs serve
every request. Prefill and score take each sample's start: the tokens it has already
read and the state it reached there (zeros for a fresh prompt). With the Mojo ops on a CPU there is a third, ``srm_decode_steps_*``:
a decode runs all its steps inside one op, each token chosen greedily or drawn there
by the sampler's rules (see graphs/srm/decode.py); elsewhere decodes take the decode
graph's loop. Weights are bound at load time by name.

The rest (lazy loading, the decode call, threads) is ``runtime.compiled``.
"""

from __future__ import annotations

import numpy as np
from max.driver import CPU, Buffer

from ...runtime.compiled import CompiledGraphs, DecodeResult, PrefillResult, SamplingArrays, check_shapes, right_padded, \
    session_weights
from ...runtime.drawn import one_step_scores, scored_input
from ...graphs.srm import CHUNK
from . import build, packing, schema
from .config import SRMConfig


def weights_registry(config: SRMConfig, weights: dict[str, np.ndarray], dtype: str,
                     packed: bool = False) -> dict:
    """name -> array/Buffer for ``session.init``: every tensor the graphs read
    (``schema.graph_weights``), and with ``packed`` the whole-step decode op's packed
    copies (``packing``)."""
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
    supports_start_state = True  # its prefill and score graphs take each sample's start state

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
        self._open(weights_registry(config, weights, self.dtype,
                                    packed=self.steps_in_one_op))

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

    # -- the calls
    def prefill(self, prompts: list, sampling: SamplingArrays | None = None, start_states: Buffer | None = None,
                start_positions=None, logprobs: int | None = None) -> PrefillResult:
        """Right-pad ``prompts`` (non-empty lists of ids, each at most n long) and run them.
        ``start_states`` [L, B, H, hd] and ``start_positions`` [B]: continue each sample from
        the state it reached after that many tokens (default: fresh); the prompt's tokens
        then sit at start .. start + len - 1, and the first new token is drawn at start + len.
        ``logprobs`` (0 .. 20): the result's ``scores`` hold the first new tokens' raw
        log-probabilities and that many alternatives, from the same graph call."""
        B = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int64)
        start = self.check_start(lengths, start_states, start_positions)
        sampling = sampling or SamplingArrays.greedy(B)
        with self._lock:
            logits, nxt, states, *lp = self.prefill_model.execute(
                *self._prefix_inputs(prompts, lengths, start, start_states), *self.sampling_buffers(sampling),
                self.to_device(start + lengths), scored_input(logprobs))
        nxt = self.host(nxt)
        first = None if logprobs is None else DecodeResult(
            nxt[:, None], None, None, None, *one_step_scores(*(self.host(t) for t in lp), logprobs))
        return PrefillResult(logits, nxt, states, first)

    def _run_score(self, inputs, targets, lengths, start, start_states):
        prefix = self._prefix_inputs(inputs, lengths, start, start_states)
        padded = right_padded(targets, prefix[1].shape[0] * CHUNK).reshape(len(inputs), -1, CHUNK)
        return self.score_model.execute(*prefix, self.to_device(padded))


__all__ = ["Engine", "weights_registry"]
