"""What every engine shares: compiled prefill and decode graphs for one config, weight
dtype and device, loaded lazily (from the ``.mef`` cache when possible) under the
engine's lock; host/device transfers; the decode call, whose inputs and outputs are
the same for every architecture (``graphs/loop.py``); the prefill and score calls'
checks and results on the host, through one prefill graph per architecture, which
scores the positions it is given (each architecture passes its inputs, ``_run_prefill``).

States stay on the device: ``prefill`` and ``decode`` return ``Buffer``s that are fed
straight back; per decode call only the new token ids [B, S] come back to the host.

Threads: an engine may be shared. Each call runs under the engine's lock (MAX does
not promise concurrent ``execute`` on one model), and a call keeps no state between
calls, so concurrent requests interleave call by call and each gets the result it
would get alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from max.driver import CPU, Buffer, get_virtual_cpu_target
from max.dtype import DType
from max.engine import InferenceSession, Model

from ..bfloat16 import to_bfloat16_bits
from ..errors import GenerationError
from ..graphs.ops import cpu_ops_run
from ..graphs.scoring import TOP_N
from ..graphs.slots import slots_taken
from ..weight_shapes import shape_problem
from .call_types import DecodeResult, PrefillResult, SamplingArrays, ScoreResult
from .compile_cache import graph_name, load_unit
from .drawn import check_logprobs, one_step_scores, scored_input, steps_scores
from .device import cache_aligned, resolve_device, resolve_dtype
from .precompile import GraphJob, precompile


# The graphs every engine runs besides its decode graph: a decode takes the ``decode_steps``
# op where every step runs in one op, else the ``decode`` graph's loop (never both).
NON_DECODE_KINDS = ("prefill", "sample", "regroup")


def graph_kinds(steps_in_one_op: bool) -> tuple[str, ...]:
    """The graph kinds an engine runs, for a decode in one op or in the graph loop."""
    return NON_DECODE_KINDS + (("decode_steps",) if steps_in_one_op else ("decode",))


def check_shapes(expected: dict[str, tuple], weights: dict[str, np.ndarray]) -> None:
    """Every expected key is present with its shape (else GenerationError naming it)."""
    given = {key: np.shape(weights[key]) for key in expected if key in weights}
    problem = shape_problem(expected, given, allow_unexpected=True)
    if problem:
        raise GenerationError(f"weights: {problem}")


def session_weights(full: dict[str, np.ndarray], matrices: set[str], dtype: str) -> dict:
    """name -> array/Buffer for ``session.init``: float32, except that with
    ``dtype="bfloat16"`` the names in ``matrices`` are stored as bfloat16; each starts on
    a cache line (``cache_aligned``: MAX reads them in place). Empties ``full`` as it goes,
    so that each array it had to copy is released before the next copy is made."""
    reg: dict = {}
    for name in list(full):
        arr = np.ascontiguousarray(full.pop(name), dtype=np.float32)
        if dtype == "bfloat16" and name in matrices:
            reg[name] = Buffer.from_numpy(cache_aligned(to_bfloat16_bits(arr))).view(DType.bfloat16)
        else:
            reg[name] = cache_aligned(arr)
    return reg


def _file_identity(path) -> tuple | None:
    """What tells one file from another, links to it included (a replaced file differs);
    None if there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def right_padded(prompts: list, width: int) -> np.ndarray:
    """[B, width] int64: each prompt's ids, then zeros."""
    ids = np.zeros((len(prompts), width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    return ids


class CompiledGraphs:
    """The base of every engine (see the module docs). Subclasses set ``config``,
    ``kernels``, and as class attributes ``build_graph`` and ``graph_salt`` (their
    architecture's, ``models/<arch>/build.py``); they call ``_start``, then ``_open`` with
    their ``session_weights``."""

    def _start(self, dtype: str, device: str) -> None:
        self.dtype = resolve_dtype(dtype)
        self.device, self.device_ref = resolve_device(device)

    def _open(self, weights: dict) -> None:
        self.weights = weights  # name -> array/Buffer: what the compiled graphs bind
        self.session = InferenceSession(devices=[self.device])
        self._models: dict[str, Model] = {}
        self._unit_files: dict[tuple, dict[str, Model]] = {}  # ``_load``'s
        self.compile_seconds: dict[str, float] = {}
        self._lock = threading.RLock()

    # -- compiled models
    # the architecture's graph builder and the salt of its graphs' cache keys (set by each engine class)
    build_graph: Callable
    graph_salt: bytes

    def graph_job(self, kind: str) -> GraphJob:
        device = "cpu" if isinstance(self.device, CPU) else "gpu"
        return GraphJob(kind, self.config, self.dtype, device, self.kernels, type(self).build_graph, self.graph_salt)

    def graph_jobs(self) -> list[GraphJob]:
        """Every graph this engine may load."""
        return [self.graph_job(kind) for kind in self.graph_kinds()]

    def _load(self, kind: str) -> Model:
        """The graph ``kind``, from the cache (a miss compiles in a child process, saying what
        and for how long). Its file may hold other graphs of this engine compiled with it as
        one unit: initialized with it, they are kept, and a later load of one of them from the
        same file takes it instead of initializing the file again (on a GPU, weights again)."""
        t0 = time.perf_counter()
        job = self.graph_job(kind)
        precompile([job])
        mef = job.mef_path()
        name = graph_name(mef)
        models = self._unit_files.get(_file_identity(mef), {})
        if name not in models:
            models = load_unit(self.session, job.graph, self.weights, job.salt, mef)
            self._unit_files[_file_identity(mef)] = models
        self.compile_seconds[kind] = time.perf_counter() - t0
        return models[name]

    # Under a virtual CPU target, MAX 26.7's runtime faults now and then when a model is
    # loaded into a process after another model has run (docs/avx2_crash.md): an engine
    # class that sets this loads every graph at its first use there (unless ``load`` named
    # the ones to run). Only the PHA's graphs have faulted so; the SRM engine tests load a
    # few of many graph kinds per config, and loading them all would compile the rest for nothing.
    preload_under_virtual_target = False

    # Whether prefill and score continue from given states (start_states, start_positions):
    # the prefix cache (serve/prefix_cache.py) and scoring ask this before passing them.
    supports_start_state = False

    def model(self, kind: str) -> Model:
        """The compiled graph ``kind`` (one of ``graph_kinds()``), loaded on first use."""
        with self._lock:
            if kind not in self._models:
                if not self._models and self.preload_under_virtual_target and get_virtual_cpu_target():
                    self.warmup()
                else:
                    self._models[kind] = self._load(kind)
            return self._models[kind]

    @property
    def prefill_model(self) -> Model:
        return self.model("prefill")

    @property
    def decode_model(self) -> Model:
        return self.model("decode")

    @property
    def decode_steps_model(self) -> Model:
        return self.model("decode_steps")

    @property
    def steps_in_one_op(self) -> bool:
        """Whether a decode runs the ``decode_steps`` graph (every step in one op, greedy
        or sampled) instead of the decode graph's loop: the Mojo ops on a CPU."""
        return cpu_ops_run(self.kernels, self.device_ref)

    def graph_kinds(self) -> list[str]:
        """The graphs this engine runs (``graph_kinds``)."""
        return list(graph_kinds(self.steps_in_one_op))

    def warmup(self):
        """Load every graph; cold ones compile side by side, one process each."""
        return self.load(self.graph_kinds())

    def load(self, kinds):
        """Load the graphs ``kinds`` now (cold ones compile side by side): a caller that runs
        only these loads no other (the rest still load at their first use)."""
        if unknown := [kind for kind in kinds if kind not in self.graph_kinds()]:
            raise ValueError(f"this engine has no {', '.join(unknown)} graph; it runs {', '.join(self.graph_kinds())}")
        with self._lock:
            t0 = time.perf_counter()
            if precompile([self.graph_job(kind) for kind in kinds]):
                self.compile_seconds["parallel_compile"] = time.perf_counter() - t0
            for kind in (kind for kind in kinds if kind not in self._models):
                self._models[kind] = self._load(kind)
        return self

    # -- helpers
    def to_device(self, a: np.ndarray) -> Buffer:
        buf = Buffer.from_numpy(cache_aligned(a))
        return buf if isinstance(self.device, CPU) else buf.to(self.device)

    @staticmethod
    def host(buf: Buffer) -> np.ndarray:
        return buf.to_numpy() if buf.is_host else buf.to(CPU()).to_numpy()

    def sampling_buffers(self, s: SamplingArrays) -> list[Buffer]:
        """The graphs' sampling inputs: four per-sample arrays on the device, the mode on the host."""
        arrays = (s.temperature.astype(np.float32), s.top_k.astype(np.int64), s.top_p.astype(np.float32),
                  s.seed.astype(np.uint64))
        return [*(self.to_device(a) for a in arrays), Buffer.from_numpy(np.array(s.mode(), np.int64))]

    def draw(self, logits: Buffer, rows, sampling: SamplingArrays, counters) -> np.ndarray:
        """Tokens for samples that share prefill logits (``logits`` [P, V] on the device,
        ``rows`` [N] the row of each sample): each sample draws what a prefill of its prompt
        alone draws, from its own parameters and seed (``counters``: the position of the
        token, i.e. its prompt's length)."""
        return self._draw(logits, rows, sampling, counters, None)[0]

    def draw_scored(self, logits: Buffer, rows, sampling: SamplingArrays, counters, top_n: int) -> DecodeResult:
        """``draw``, with each token's raw log-probability and the ``top_n`` (0 .. TOP_N)
        likeliest tokens (graphs/sampler.py): a one-step ``DecodeResult`` without states."""
        ids, *scores = self._draw(logits, rows, sampling, counters, top_n)
        return DecodeResult(ids[:, None], None, None, None, *one_step_scores(*scores, top_n))

    def _draw(self, logits: Buffer, rows, sampling: SamplingArrays, counters, logprobs: int | None) -> list[np.ndarray]:
        """The sample graph's outputs on the host: the ids, then with ``logprobs`` (not
        None) the drawn tokens' log-probabilities and the likeliest tokens'."""
        scored = scored_input(logprobs)
        with self._lock:
            out = self.model("sample").execute(
                logits, self.to_device(np.asarray(rows, np.int64)), *self.sampling_buffers(sampling),
                self.to_device(np.asarray(counters, np.int64)), scored)
        return [self.host(t) for t in out] if logprobs is not None else [self.host(out[0])]

    def regroup(self, pool: Buffer | None, fresh: Buffer | None, index, donate_pool: bool = False) -> Buffer:
        """States made on the device (``graphs/slots.py``): row b is row ``index[b]`` of ``pool``
        then ``fresh`` side by side (either may be None: no rows). Only row choices cross.
        ``donate_pool``: the caller gives ``pool`` up; on the host, fresh rows taking slots of
        a batch otherwise kept in place (``slots_taken``) are written into it, one row each."""
        if pool is None and fresh is None:
            raise ValueError("regroup needs pool or fresh states")
        index, P = np.asarray(index, np.int64), 0 if pool is None else pool.shape[1]
        on_host = pool is not None and fresh is not None and pool.is_host and fresh.is_host
        taken = slots_taken(index, P) if donate_pool and on_host else None
        with self._lock:
            if taken is not None:  # the rest of the batch stays where it is
                pool.to_numpy()[:, taken] = fresh.to_numpy()[:, index[taken] - P]
                return pool
            from_pool = index < P
            choices = (from_pool, np.where(from_pool, index, 0), np.where(from_pool, 0, index - P))
            (states,) = self.model("regroup").execute(pool if pool is not None else fresh,
                                                     fresh if fresh is not None else pool,
                                                     *(self.to_device(c) for c in choices))
        return states

    # -- starting from a state, and scoring
    def check_start(self, lengths: np.ndarray, start_states: Buffer | None, start_positions) -> np.ndarray:
        """[B] int64 start positions of a prefill or score call that reads ``lengths``
        tokens per sample: ``start_positions`` (default zeros) checked against the context
        and against ``start_states`` (None: every sample starts fresh, at 0)."""
        n, B = self.config.context_length, len(lengths)
        start = np.zeros(B, np.int64) if start_positions is None else np.asarray(start_positions, np.int64).reshape(-1)
        if start.shape != (B,):
            raise GenerationError(f"start_positions has {start.size} entries for {B} samples")
        if (start < 0).any():
            raise GenerationError(f"start_positions must be >= 0, got {start.tolist()}")
        if start_states is None and start.any():
            raise GenerationError("start_positions > 0 need the start_states the samples reached there")
        if start_states is not None and (start_states.shape[1] != B or start_states.shape[0] != self.config.n_layers):
            raise GenerationError(f"start_states has shape {tuple(start_states.shape)}: expected "
                                  f"[{self.config.n_layers}, {B}, ...] (layers, samples)")
        over = np.flatnonzero(start + lengths > n)
        if (start_positions is not None or start_states is not None) and over.size:
            b = int(over[0])
            raise GenerationError(f"sample {b}: {int(start[b])} tokens read and {int(lengths[b])} more pass "
                                  f"the context length {n}")
        return start

    def prefill(self, prompts: list, sampling: SamplingArrays | None = None, start_states: Buffer | None = None,
                start_positions=None, logprobs: int | None = None) -> PrefillResult:
        """Right-pad ``prompts`` (non-empty lists of ids, each at most n long) and run them.
        ``start_states`` [L, B, ...] and ``start_positions`` [B] (``supports_start_state``):
        continue each sample from the state it reached after that many tokens (default:
        fresh); the prompt's tokens then sit at start .. start + len - 1, and the first new
        token is drawn at start + len. ``logprobs`` (0 .. 20): the result's ``scores`` hold
        the first new tokens' raw log-probabilities and that many alternatives.

        The first new tokens are drawn from the prefill graph's logits by the sample graph
        (``draw``), which every engine loads anyway, so that no prefill graph compiles the
        sampler's kernels (once per model shape, weight dtype and device)."""
        B, lengths = len(prompts), np.array([len(p) for p in prompts], np.int64)
        start = self.check_start(lengths, start_states, start_positions)
        check_logprobs(logprobs)  # before the prefill's work
        no_rows = self.to_device(np.zeros((B, 1), np.int64))
        sampling = sampling or SamplingArrays.greedy(B)
        with self._lock:
            logits, states = self._run_prefill(prompts, lengths, start, start_states, [no_rows] * 2)[:2]
        rows, counters = np.arange(B), start + lengths
        if logprobs is None:
            return PrefillResult(logits, self.draw(logits, rows, sampling, counters), states, None)
        first = self.draw_scored(logits, rows, sampling, counters, logprobs)
        return PrefillResult(logits, first.tokens[:, 0], states, first)

    def score(self, inputs: list, targets: list, top_n: int = 0, start_states: Buffer | None = None,
              start_positions=None) -> ScoreResult:
        """Per-position log-probabilities (``ScoreResult``) of ``targets`` after ``inputs``:
        inputs[b] and targets[b] are equally long (1 to the context length less the start
        position), usually targets[b] = the text and inputs[b] = the token before each; the
        model's raw distribution (log_softmax of the logits, no temperature or filters).
        ``top_n`` (0 .. 20): alternatives per position. ``start_states`` [L, B, ...] and
        ``start_positions`` [B] continue samples from states returned by prefill, score or
        regroup (default: fresh). One call of the prefill graph, scoring every position;
        only [B, T] log-probabilities and [B, T, 20] alternatives come to the host."""
        if not 0 <= top_n <= TOP_N:
            raise GenerationError(f"top_n must be 0 to {TOP_N}, got {top_n}")
        if not inputs or len(inputs) != len(targets):
            raise GenerationError(f"score needs as many targets as inputs (>= 1), got {len(inputs)} and "
                                  f"{len(targets)}")
        V = self.config.vocab_size
        for b, (x, y) in enumerate(zip(inputs, targets)):
            if not 0 < len(x) == len(y):
                raise GenerationError(f"sample {b}: {len(x)} inputs and {len(y)} targets (need equal, >= 1)")
            for what, ids in (("inputs", x), ("targets", y)):
                if (a := np.asarray(ids)).min() < 0 or a.max() >= V:
                    raise GenerationError(f"sample {b}: {what} hold ids outside the vocabulary 0..{V - 1}")
        lengths = np.array([len(x) for x in inputs], np.int64)
        if lengths.max() > self.config.context_length:
            raise GenerationError(f"sample {int(lengths.argmax())} has {int(lengths.max())} tokens: more than the "
                                  f"context length {self.config.context_length}")
        start = self.check_start(lengths, start_states, start_positions)
        B, R = len(inputs), int(lengths.max())
        scoring = [self.to_device(np.tile(np.arange(R, dtype=np.int64), (B, 1))),
                   self.to_device(right_padded(targets, R))]
        with self._lock:
            states, lp, values, ids = self._run_prefill(inputs, lengths, start, start_states, scoring)[1:]
        lp = self.host(lp).reshape(B, -1)
        values = self.host(values).reshape(B, -1, values.shape[-1])
        ids = self.host(ids).reshape(values.shape)
        result = ScoreResult([], [], [], states)
        for b, T in enumerate(lengths):
            v, i = values[b, :T], ids[b, :T]
            order = np.lexsort((i, -v), axis=-1)[:, :top_n]  # descending, ties by lower id
            result.logprobs.append(lp[b, :T].astype(np.float32))
            result.top_ids.append(np.take_along_axis(i, order, -1).astype(np.int64))
            result.top_logprobs.append(np.take_along_axis(v, order, -1).astype(np.float32))
        return result

    def _run_prefill(self, rows: list, lengths: np.ndarray, start: np.ndarray, start_states: Buffer | None,
                     scoring: list[Buffer]) -> list[Buffer]:
        """The architecture's prefill graph on checked rows -> its outputs on the device
        (logits, states, then the scored positions' log-probabilities, top values and top
        ids); ``scoring`` its score_at and targets inputs (``graphs/scoring.py``)."""
        raise NotImplementedError

    # -- the decode call (every engine's decode graph has the same inputs and outputs)
    def decode_inputs(self, ids, positions, sampling) -> tuple[Buffer, Buffer, list[Buffer]]:
        """ids and positions as device Buffers, sampling as ``sampling_buffers`` (each taken as is)."""
        ids, positions = (a if isinstance(a, Buffer) else self.to_device(np.asarray(a, np.int64))
                          for a in (ids, positions))
        if isinstance(sampling, SamplingArrays):
            sampling = self.sampling_buffers(sampling)
        return ids, positions, sampling

    def logprob_inputs(self, logprobs: int | None) -> list[Buffer]:
        """The decode graphs' log-probability inputs: scored [] (host; every decode graph) and
        top [n] (the decode-steps graphs: its length is the alternatives their op returns),
        from ``decode``'s ``logprobs`` (None, or 0 .. TOP_N: checked by ``scored_input``)."""
        return [scored_input(logprobs), self.to_device(np.arange(logprobs or 0, dtype=np.int64))]

    def logprob_results(self, logprobs: int | None, outputs) -> list:
        """``DecodeResult``'s logprobs, top_ids, top_logprobs from the graph's outputs (log-
        probabilities [B, S], top values, top ids), or nothing without ``logprobs``. A decode op
        returns the ``logprobs`` alternatives asked for, in order; a plain decode graph the K =
        ``scoring.top_width(V)`` likeliest, cut here."""
        if logprobs is None:
            return []
        lp, values, ids = (self.host(t) for t in outputs)
        return list(steps_scores(lp, values, ids, logprobs))

    def decode(self, ids, positions, states: Buffer, sampling, steps: int = 1,
               logprobs: int | None = None, donate_states: bool = False) -> DecodeResult:
        """``steps`` tokens per sample; ``ids``/``positions`` are arrays or device Buffers,
        ``sampling`` a SamplingArrays or the list from ``sampling_buffers``. ``logprobs`` (0 ..
        TOP_N): the result also carries each new token's raw log-probability (log_softmax of
        the logits, no temperature or filters) and that many alternatives per step, computed in
        the decode op or graph. ``donate_states``: the caller will not read ``states`` again, so
        an engine that updates its states in place may write into them instead of into a copy
        (the SRM's graphs return new states either way)."""
        scored, top = self.logprob_inputs(logprobs)
        ids, positions, sampling = self.decode_inputs(ids, positions, sampling)
        with self._lock:
            if self.steps_in_one_op:
                toks, states, last, pos, *lp = self.decode_steps_model.execute(
                    ids, positions, states, *sampling, self.to_device(np.arange(steps, dtype=np.int64)), scored, top)
            else:
                toks, states, last, pos, *lp = self.decode_model.execute(
                    ids, positions, states, *sampling, self.to_device(np.arange(steps, dtype=np.int64)),
                    Buffer.from_numpy(np.array(steps, np.int64)), scored)
        return DecodeResult(self.host(toks), states, last, pos, *self.logprob_results(logprobs, lp))


__all__ = ["CompiledGraphs", "NON_DECODE_KINDS", "check_shapes", "graph_kinds", "right_padded", "session_weights"]
