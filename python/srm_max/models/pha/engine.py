"""The PHA's MAX engine: the same interface as the SRM's (``runtime.compiled``).

Two compiled graphs per (config shape, weight dtype, device), ``pha_prefill_*`` (which
also scores) and ``pha_decode_*`` (``graphs/pha``), batch size and prompt length symbolic;
weights bound at load time by name; compiled models cached as ``.mef`` files
(``compile_cache``). ``decode`` copies the caller's states once per call and steps
that copy. On a CPU (the default, ``kernels``) the graph ``pha_decode_steps_*`` runs
every step of a decode call in one Mojo op (mojo/pha_decode_step.mojo); elsewhere, and
where the op cannot run the model (``op_refusal``), the decode graph ``pha_decode_*`` runs
one step per ``execute`` and writes the state in place.

States: one float32 Buffer ``[L, B, X]`` on the device per batch, holding every
per-sample state (the GSS state as real pairs, the preallocated KV caches); see
``graphs.pha.StateLayout``. A sample is the column block ``[:, b]``, so the
Generator and the slot pool copy, compact and refill slots exactly as for the
SRM. ``split_states`` unpacks a host copy into the reference's ``PHACache``
layout.

Prefill and score start fresh only: continuing from a state (``start_states``) is
refused (docs/scoring.md says what it would take).
"""

from __future__ import annotations

import numpy as np
from max.driver import CPU, Buffer

from ...errors import GenerationError
from ...graphs import pha as pha_graphs
from ...runtime.call_types import DecodeResult
from ...runtime.compiled import CompiledGraphs, check_shapes, right_padded, session_weights
from ...graphs.scoring import top_width
from ...runtime.drawn import steps_scores
from . import build, packing
from .config import PHAConfig
from .schema import checkpoint_shapes


def check_weights(config: PHAConfig, weights: dict[str, np.ndarray]) -> None:
    """Every key the graphs read (directly or derived) is present with the right shape."""
    check_shapes(checkpoint_shapes(config), weights)


def weights_registry(config: PHAConfig, weights: dict[str, np.ndarray], dtype: str, packed: bool = False) -> dict:
    """name -> array/Buffer for ``session.init``: checkpoint keys + derived tensors, and
    with ``packed`` the whole-step decode op's packed copies (``packing``).

    With ``dtype="bfloat16"`` the big matrices are stored as bfloat16; vectors, the
    DSS parameters and everything derived stay float32.
    """
    matrices = set(pha_graphs.matrix_names(config))
    full = {k: np.asarray(weights[k]) for k in pha_graphs.graph_weight_names(config)}
    full |= pha_graphs.derived_weights(config, weights)
    if packed:
        full |= packing.decode_step_weights(config, full)
        matrices |= packing.matrix_names()
    return session_weights(full, matrices, dtype)


def op_refusal(config: PHAConfig, dtype: str, device) -> str | None:
    """Why the decode op (mojo/pha_decode_step.mojo) cannot run ``config`` with ``dtype``
    weights on ``device`` (None: it can). Every weight dtype the engines take runs: with
    bfloat16 the op rounds each product's input and output as the plain graph does."""
    if not isinstance(device, CPU):
        return "the PHA decode op runs on a CPU only"
    return packing.supported(config)


class PHAEngine(CompiledGraphs):
    """Compiled PHA graphs for one config, weight dtype and device."""

    preload_under_virtual_target = True
    build_graph = staticmethod(build.build_graph)
    graph_salt = build.GRAPH_SALT

    def __init__(self, config: PHAConfig, weights: dict[str, np.ndarray], dtype: str = "float32",
                 device: str = "cpu", kernels: bool | None = None):
        """``kernels``: run the prefill's and score's attention and GSS scan as the tiled Mojo
        ops (mojo/pha_prefill_attention.mojo, its queries and keys prepared by
        mojo/pha_qk_rope.mojo; mojo/pha_gss_scan.mojo) instead of plain ops, with float32
        weights its dense layers on the decode op's packed matrices (mojo/linear_packed.mojo),
        and decode every step of a call in one Mojo op (mojo/pha_decode_step.mojo, on
        copies of the matrices packed at load: they take as much memory again) instead of
        one decode-graph call per step. Default (None): on a CPU, as bench/pha_long_context.py
        measured them several times faster; the decode op where it can run the model
        (``op_refusal``: the parallel block), the decode graph elsewhere. False: the plain
        graphs, the GPU path and the ops' reference; True where the decode op cannot run
        raises ``GenerationError`` naming why."""
        if not isinstance(config, PHAConfig):
            raise GenerationError(f"PHAEngine needs a PHAConfig, got {type(config).__name__}")
        self.config = config
        self._start(dtype, device)
        check_weights(config, weights)
        self.layout = pha_graphs.StateLayout.of(config)
        refusal = op_refusal(config, self.dtype, self.device)
        if kernels and refusal:
            raise GenerationError(f"PHAEngine(kernels=True): {refusal}; pass kernels=None or False for the plain graph")
        # the prefill's ops run any block; the decode op only the models it can (op_refusal)
        self.kernels = kernels is not False and isinstance(self.device, CPU)
        self.decode_op = self.kernels and refusal is None
        self._open(weights_registry(config, weights, self.dtype, packed=self.decode_op))
        # the decode op's graph holds no model (one graph serves every config): it takes
        # the model's arrays as inputs, these buffers over the registry's arrays
        self._op_arrays = [a if isinstance(a, Buffer) else self.to_device(np.asarray(a))
                           for a in packing.op_arrays(config, self.weights)] if self.decode_op else []
        # the prefill's dense layers read the same packed matrices (its last input)
        reads_packed = build.prefill_reads_packed(config, self.kernels)
        self._prefill_arrays = [self._op_arrays[packing.MATS_ARRAY]] if reads_packed else []

    @property
    def steps_in_one_op(self) -> bool:
        """Whether a decode runs the op's ``decode_steps`` graph: the Mojo ops on a CPU, for
        a model the op can run (``decode_op``)."""
        return self.decode_op

    def empty_states(self, batch: int) -> Buffer:
        return self.to_device(np.zeros((self.config.n_layers, batch, self.layout.width), np.float32))

    def split_states(self, states) -> dict[str, np.ndarray | None]:
        """A host copy of ``states`` [L, B, X] in the reference's ``PHACache`` layout:
        gss_state [L, B, H, N] complex64, keys and values [L, B, Hkv, n, dh] (None where off)."""
        c, lay = self.config, self.layout
        s = self.host(states) if isinstance(states, Buffer) else np.asarray(states)
        L, B = s.shape[:2]
        out: dict[str, np.ndarray | None] = {"gss_state": None, "keys": None, "values": None}
        if lay.gss:
            pairs = s[:, :, : lay.gss].reshape(L, B, 2, c.gss_hidden_dim, c.dss_state_size)
            out["gss_state"] = (pairs[:, :, 0] + 1j * pairs[:, :, 1]).astype(np.complex64)
        if lay.kv:
            shape = (L, B, c.n_kv_heads, c.context_length, c.head_dim)
            out["keys"] = s[:, :, lay.keys].reshape(shape)
            out["values"] = s[:, :, lay.values].reshape(shape)
        return out

    def check_start(self, lengths: np.ndarray, start_states, start_positions) -> np.ndarray:
        """Prefill and score start from token 0 only: the attention would have to read each
        sample's cached KV rows of its earlier tokens (docs/scoring.md)."""
        if start_states is not None or (start_positions is not None and np.any(start_positions)):
            raise GenerationError("the PHA engine cannot continue from a state (start_states/start_positions): "
                                  "it prefills and scores from the first token only")
        return super().check_start(lengths, None, None)

    def _chunked(self, rows: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-padded ids [B, M, C], positions [M, C] and lengths [B] of non-empty rows of
        at most n tokens."""
        n = self.config.context_length
        for i, p in enumerate(rows):
            if not 0 < len(p) <= n:
                raise GenerationError(f"prompt {i} has {len(p)} tokens: expected 1 to the context length {n}")
        lengths = np.array([len(p) for p in rows], np.int64)
        C = pha_graphs.CHUNK
        M = -(-int(lengths.max()) // C)  # chunks: the graph runs T = M C tokens
        ids = right_padded(rows, M * C).reshape(len(rows), M, C)
        return ids, np.arange(M * C, dtype=np.int64).reshape(M, C), lengths

    def _run_prefill(self, rows, lengths, start, start_states, scoring) -> list[Buffer]:
        ids, pos, lengths = self._chunked(rows)
        return self.prefill_model.execute(self.to_device(ids), self.to_device(pos), self.to_device(pos.copy()),
                                          self.to_device(lengths), *scoring, *self._prefill_arrays)

    def decode(self, ids, positions, states: Buffer, sampling, steps: int = 1,
               logprobs: int | None = None, donate_states: bool = False) -> DecodeResult:
        """``steps`` tokens per sample, every step writing its rows into the states in
        place: into a copy of ``states`` made once per call (the caller's stay as they
        were, e.g. prefill states it forks again), or with ``donate_states`` into
        ``states`` themselves, which saves copying every KV cache whole on each call.
        ``logprobs``: as ``CompiledGraphs.decode``, from the op or the one-step graph."""
        scored, top = self.logprob_inputs(logprobs)
        ids, positions, sampling = self.decode_inputs(ids, positions, sampling)
        with self._lock:
            if not donate_states:
                # Buffer.copy is asynchronous and an execute does not wait for it
                states = states.copy()
                self.device.synchronize()
            if self.steps_in_one_op:
                # one op: every step's writes into the copy, the tokens chosen inside
                toks, ids, positions, *lp = self.decode_steps_model.execute(
                    ids, positions, states, *sampling, self.to_device(np.arange(steps, dtype=np.int64)), scored, top,
                    *self._op_arrays)
                self.device.synchronize()
                return DecodeResult(self.host(toks), states, ids, positions, *self.logprob_results(logprobs, lp))
            tokens, scores = [], []
            for _ in range(steps):
                ids, positions, *lp = self.decode_model.execute(ids, positions, states, *sampling, scored)
                tokens.append(ids)
                scores.append(lp)
            # execute returns when its outputs are ready; the in-place write of the
            # states is not one of them: wait for it before anyone reads them
            self.device.synchronize()
        B = len(self.host(ids))
        toks = np.stack([self.host(t) for t in tokens], axis=1) if tokens else np.zeros((B, 0), np.int64)
        return DecodeResult(toks, states, ids, positions, *self._stepwise_scores(logprobs, scores, B))

    def _stepwise_scores(self, logprobs: int | None, scores: list, batch: int) -> list:
        """``logprob_results`` of the one-step graph's calls: each call's log-probabilities
        [B] and top values and ids [B, K], stacked along the steps."""
        if logprobs is None:
            return []
        if not scores:
            K = top_width(self.config.vocab_size)
            lp, values, ids = np.zeros((batch, 0), np.float32), np.zeros((batch, 0, K), np.float32), \
                np.zeros((batch, 0, K), np.int64)
        else:
            lp, values, ids = (np.stack([self.host(s[i]) for s in scores], axis=1) for i in range(3))
        return list(steps_scores(lp, values, ids, logprobs))


__all__ = ["PHAEngine", "check_weights", "op_refusal", "weights_registry"]
