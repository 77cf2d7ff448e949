"""The MAX inference engine: compiled prefill + decode graphs for one config.

``Engine(config, weights, dtype, device)`` builds (or loads from the ``.mef``
cache, see ``compile_cache``) two graphs per (config shape, weight dtype,
device): ``srm_prefill_*`` and ``srm_decode_*``; batch size, prompt length and
the number of decode steps per call are symbolic, so these two graphs serve
every request. With the Mojo ops on a CPU there is a third, ``srm_decode_greedy_*``:
a decode where every sample is greedy runs all its steps inside one op (see
graphs/decode.py); other decodes take the decode graph's loop. Weights are bound
at load time by name.

States stay on the device: ``prefill`` and ``decode`` return ``Buffer``s that
are fed straight back; per decode call only the new token ids [B, S] come back
to the host.

Threads: an Engine may be shared. Each call runs under the engine's lock (MAX
does not promise concurrent ``execute`` on one model), and a call keeps no state
between calls, so concurrent requests interleave call by call and each gets the
result it would get alone.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef

from . import packing, shipped_graphs
from .compile_cache import load_compiled
from .precompile import GraphJob, precompile
from .config import SRMConfig
from .errors import GenerationError
from .graphs import layers

DTYPES = {"float32": DType.float32, "bfloat16": DType.bfloat16}
DEVICES = ("auto", "cpu", "gpu")


def resolve_device(device: str) -> tuple[Device, DeviceRef]:
    if not isinstance(device, str) or device.lower() not in DEVICES:
        raise GenerationError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
    device = device.lower()
    if device == "auto":
        device = "gpu" if accelerator_count() > 0 else "cpu"
    if device == "gpu":
        if accelerator_count() == 0:
            raise GenerationError("device 'gpu' requested but no accelerator is available")
        return Accelerator(), DeviceRef.GPU()
    return CPU(), DeviceRef.CPU()


def resolve_dtype(dtype: str | None, default: str = "float32") -> str:
    dtype = default if dtype is None else dtype
    if dtype not in DTYPES:
        raise GenerationError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def to_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bfloat16_round(a: np.ndarray) -> np.ndarray:
    """What a float32 array looks like after a trip through bfloat16."""
    return (to_bfloat16_bits(a).astype(np.uint32) << 16).view(np.float32)


def check_weights(config: SRMConfig, weights: dict[str, np.ndarray]) -> None:
    """Every key the graphs read is present with the right shape (else GenerationError)."""
    c = config
    expected = {
        "input_layer.weight": (c.vocab_size, c.d_model),
        "output_layer.weight": (c.vocab_size, c.d_model),
    }
    for l in range(c.n_layers):
        p = f"mixer_blocks.{l}."
        d, f, n, hd = c.d_model, c.ffn_dim, c.context_length, c.head_dim
        expected |= {
            p + "channel_norm.weight": (d,), p + "channel_norm.bias": (d,),
            p + "channel_mixing_layer.0.weight": (f, d), p + "channel_mixing_layer.0.bias": (f,),
            p + "channel_mixing_layer.2.weight": (d, f), p + "channel_mixing_layer.2.bias": (d,),
            p + "token_norm.weight": (d,), p + "token_norm.bias": (d,),
            p + "token_mixing_layer.out_proj.weight": (d, d), p + "token_mixing_layer.out_proj.bias": (d,),
        }
        for h in range(c.n_heads):
            q = f"{p}token_mixing_layer."
            expected[f"{q}proj_head.{h}.weight"] = (hd, d)
            expected[f"{q}proj_head.{h}.bias"] = (hd,)
            expected[f"{q}mixer_heads.{h}.weight"] = (1, n)
            expected[f"{q}mixer_heads.{h}.bias"] = (n,)
            if c.decay:
                expected[f"{q}mixer_heads.{h}.decay_value"] = (1,)
    check_shapes(expected, weights)


def check_shapes(expected: dict[str, tuple], weights: dict[str, np.ndarray]) -> None:
    """Every expected key is present with its shape (else GenerationError naming it)."""
    for key, shape in expected.items():
        if key not in weights:
            raise GenerationError(f"weights: missing key {key!r}")
        got = tuple(np.shape(weights[key]))
        if got != shape:
            raise GenerationError(f"weights: {key!r} has shape {got}, expected {shape}")


def registry_of(full: dict[str, np.ndarray], matrices: set[str], dtype: str) -> dict:
    """name -> array/Buffer for ``session.init``: float32, except that with
    ``dtype="bfloat16"`` the names in ``matrices`` are stored as bfloat16."""
    reg: dict = {}
    for name, arr in full.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if dtype == "bfloat16" and name in matrices:
            reg[name] = Buffer.from_numpy(to_bfloat16_bits(arr)).view(DType.bfloat16)
        else:
            reg[name] = arr
    return reg


def weights_registry(config: SRMConfig, weights: dict[str, np.ndarray], dtype: str,
                     packed: bool = False) -> dict:
    """name -> array/Buffer for ``session.init``: checkpoint keys + derived tensors, and
    with ``packed`` the whole-step decode op's packed copies (srm_max/packing.py)."""
    matrices = {"input_layer.weight", "output_layer.weight"} | packing.matrix_names()
    for l in range(config.n_layers):
        p = f"mixer_blocks.{l}."
        matrices |= {p + "channel_mixing_layer.0.weight", p + "channel_mixing_layer.2.weight",
                     p + "token_mixing_layer.out_proj.weight", layers.derived_name(l, "proj.weight")}
    full = {k: np.asarray(weights[k]) for k in layers.graph_weight_names(config)}
    full |= layers.derived_weights(config, weights)
    if packed:
        full |= packing.decode_step_weights(config, weights, full)
    return registry_of(full, matrices, dtype)


def right_padded(prompts: list, width: int) -> np.ndarray:
    """[B, width] int64: each prompt's ids, then zeros."""
    ids = np.zeros((len(prompts), width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    return ids


@dataclass
class SamplingArrays:
    """Per-sample sampling parameters, as the graphs take them."""

    temperature: np.ndarray  # [B] float32, 0 = greedy
    top_k: np.ndarray  # [B] int64, 0 = off
    top_p: np.ndarray  # [B] float32, 1 = off
    seed: np.ndarray  # [B] uint64

    @classmethod
    def greedy(cls, batch: int) -> "SamplingArrays":
        return cls(np.zeros(batch, np.float32), np.zeros(batch, np.int64),
                   np.ones(batch, np.float32), np.zeros(batch, np.uint64))

    def take(self, index) -> "SamplingArrays":
        return SamplingArrays(self.temperature[index], self.top_k[index], self.top_p[index], self.seed[index])

    def mode(self) -> int:
        """The cheapest in-graph sampler that serves every sample (``layers.MODE_*``)."""
        drawn = self.temperature > 0
        if not drawn.any():
            return layers.MODE_GREEDY
        filtered = (self.top_k[drawn] > 0) | (self.top_p[drawn] < 1)
        return layers.MODE_FILTERED if filtered.any() else layers.MODE_PLAIN


@dataclass
class PrefillResult:
    logits: Buffer  # [B, V] float32 at each prompt's last token (on the device)
    next_ids: np.ndarray  # [B] int64 the first new token
    states: Buffer  # [L, B, H, hd] float32 (on the device)


@dataclass
class DecodeResult:
    tokens: np.ndarray  # [B, S] int64
    states: Buffer  # ready to take ids
    ids: Buffer  # [B] = tokens[:, -1]
    positions: Buffer  # [B] = their positions


class CompiledGraphs:
    """What every engine shares: a prefill and a decode graph for one config, weight
    dtype and device, loaded lazily (from the ``.mef`` cache when possible) under
    the engine's lock, plus host/device transfers. Subclasses set ``config``,
    ``kernels`` and ``_registry`` and call ``_start``."""

    def _start(self, dtype: str, device: str) -> None:
        self.dtype = resolve_dtype(dtype)
        self.device, self.device_ref = resolve_device(device)

    def _open(self, registry: dict) -> None:
        self._registry = registry
        self.session = InferenceSession(devices=[self.device])
        self._models: dict[str, Model] = {}
        self.compile_seconds: dict[str, float] = {}
        self._lock = threading.RLock()

    # -- compiled models
    def graph_job(self, kind: str) -> GraphJob:
        device = "cpu" if isinstance(self.device, CPU) else "gpu"
        return GraphJob.of(kind, self.config, self.dtype, device, self.kernels)

    def _load(self, kind: str) -> Model:
        t0 = time.perf_counter()
        job = self.graph_job(kind)
        # a miss: a shipped graph if one matches (checked once, then cached), else compile
        # in a child process, saying what it compiles and for how long
        if not job.cached() and not shipped_graphs.install([job]):
            precompile([job])
        model = load_compiled(self.session, job.graph, self._registry, extra_key=job.extra_key,
                              mef=job.mef_path())
        self.compile_seconds[kind] = time.perf_counter() - t0
        return model

    def model(self, kind: str) -> Model:
        """The compiled graph ``kind`` (one of ``graph_kinds()``), loaded on first use."""
        with self._lock:
            if kind not in self._models:
                self._models[kind] = self._load(kind)
            return self._models[kind]

    @property
    def prefill_model(self) -> Model:
        return self.model("prefill")

    @property
    def decode_model(self) -> Model:
        return self.model("decode")

    @property
    def decode_greedy_model(self) -> Model:
        return self.model("decode_greedy")

    @property
    def greedy_steps_in_one_op(self) -> bool:
        """Whether an all-greedy decode runs the ``decode_greedy`` graph (every step
        in one op) instead of the decode graph's loop: the Mojo ops on a CPU."""
        return self.kernels and isinstance(self.device, CPU)

    def graph_kinds(self) -> list[str]:
        return ["prefill", "decode"] + (["decode_greedy"] if self.greedy_steps_in_one_op else [])

    def warmup(self):
        """Load every graph; cold ones compile side by side, one process each."""
        with self._lock:
            t0 = time.perf_counter()
            jobs = [self.graph_job(kind) for kind in self.graph_kinds()]
            shipped_graphs.install(jobs)  # checked together, once: then they are cache hits
            compiled = precompile(jobs)
            if compiled:
                self.compile_seconds["parallel_compile"] = time.perf_counter() - t0
            for kind in self.graph_kinds():
                self.model(kind)
        return self

    # -- helpers
    def _dev(self, a: np.ndarray) -> Buffer:
        buf = Buffer.from_numpy(np.ascontiguousarray(a))
        return buf if isinstance(self.device, CPU) else buf.to(self.device)

    @staticmethod
    def host(buf: Buffer) -> np.ndarray:
        return buf.to_numpy() if buf.is_host else buf.to(CPU()).to_numpy()

    def sampling_buffers(self, s: SamplingArrays) -> list[Buffer]:
        """The graphs' sampling inputs: four per-sample arrays on the device, the mode on the host."""
        return [self._dev(s.temperature.astype(np.float32)), self._dev(s.top_k.astype(np.int64)),
                self._dev(s.top_p.astype(np.float32)), self._dev(s.seed.astype(np.uint64)),
                Buffer.from_numpy(np.array(s.mode(), np.int64))]

    # -- the decode call (every engine's decode graph has the same inputs and outputs)
    def decode(self, ids, positions, states: Buffer, sampling, steps: int = 1) -> DecodeResult:
        """``steps`` tokens per sample; ``ids``/``positions`` are arrays or device Buffers,
        ``sampling`` a SamplingArrays or the list from ``sampling_buffers``."""
        if not isinstance(ids, Buffer):
            ids = self._dev(np.asarray(ids, np.int64))
        if not isinstance(positions, Buffer):
            positions = self._dev(np.asarray(positions, np.int64))
        if isinstance(sampling, SamplingArrays):
            sampling = self.sampling_buffers(sampling)
        one_op = self.greedy_steps_in_one_op and int(sampling[-1].to_numpy()) == layers.MODE_GREEDY
        with self._lock:
            if one_op:
                toks, states, last, pos = self.decode_greedy_model.execute(
                    ids, positions, states, self._dev(np.arange(steps, dtype=np.int64)))
                return DecodeResult(self.host(toks), states, last, pos)
            toks, states, last, pos = self.decode_model.execute(
                ids, positions, states, *sampling,
                self._dev(np.arange(steps, dtype=np.int64)), Buffer.from_numpy(np.array(steps, np.int64)))
        return DecodeResult(self.host(toks), states, last, pos)


class Engine(CompiledGraphs):
    """Compiled SRM graphs for one config, weight dtype and device."""

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
        check_weights(config, weights)
        self._open(weights_registry(config, weights, self.dtype,
                                    packed=self.kernels and isinstance(self.device, CPU)))

    def empty_states(self, batch: int) -> Buffer:
        c = self.config
        return self._dev(np.zeros((c.n_layers, batch, c.n_heads, c.head_dim), np.float32))

    # -- the two calls
    def prefill(self, prompts: list, sampling: SamplingArrays | None = None) -> PrefillResult:
        """Right-pad ``prompts`` (non-empty lists of ids, each at most n long) and run them."""
        B = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int64)
        C = layers.CHUNK
        T = int(lengths.max())
        nc = -(-T // C)
        ids = right_padded(prompts, nc * C)
        pos = np.arange(nc * C, dtype=np.int64).reshape(nc, C)
        last = np.stack([(lengths - 1) // C, (lengths - 1) % C], 1).astype(np.int64)
        sampling = sampling or SamplingArrays.greedy(B)
        with self._lock:
            logits, nxt, states = self.prefill_model.execute(
                self._dev(ids.reshape(B, nc, C)), self._dev(pos), self._dev(last),
                *self.sampling_buffers(sampling), self._dev(lengths))
        return PrefillResult(logits, self.host(nxt), states)


__all__ = ["CompiledGraphs", "Engine", "SamplingArrays", "PrefillResult", "DecodeResult", "resolve_device",
           "resolve_dtype", "right_padded", "to_bfloat16_bits", "bfloat16_round", "weights_registry"]
