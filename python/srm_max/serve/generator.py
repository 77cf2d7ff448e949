"""The user API: ``Generator``.

    from srm_max import Generator
    gen = Generator.from_pretrained("ckpt/", device="auto", dtype=None)
    out = gen.generate("Once upon a time", max_new_tokens=50, temperature=0.8, top_p=0.95, seed=1)
    out.text, out.ids, out.finish_reason          # "stop" | "length" | "context"
    out.seed                                      # generate(out.prompt_ids, seed=out.seed) replays it
    outs = gen.generate(["a", "b"], ...)          # a list, one Completion per prompt
    for event in gen.stream(["a", "b"], ...):     # one StreamEvent per decode step
        ...

Prompts are text (encoded by the checkpoint's ``tokenizer.json``) or token
ids; a single prompt (str, or a flat sequence of ints) gives a single
Completion, a list of prompts gives a list. Every argument is checked before
any work; a bad one raises ``GenerationError`` naming it.

A prompt plus its completion never passes the context length n: when a
sample reaches n tokens it finishes with reason "context".

``stop``: token ids and/or strings. A stop token ends the sample and is not
included in ``ids``/``text``; a stop string ends the sample once the decoded
text contains it: ``text`` is cut before it, ``ids`` keep the token(s) that
produced it.

``seed=None`` (the default) draws a fresh seed; every Completion and every
``sample_many`` run reports the seed it used.

Streamed texts add up to the final ``Completion.text`` of each sample: a
stream holds back text until it is settled, that is, the bytes of a character
split across tokens (decoded as a trailing U+FFFD until complete) and a tail
that could be the start of a stop string; a finishing sample releases the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import shipped_graphs
from ..checkpoints.format import load_checkpoint
from ..embedded import default_model_path
from ..errors import GenerationError
from ..models import registry
from ..models.srm.config import SRMConfig
from ..runtime.compiled import CompiledGraphs
from ..runtime.device import resolve_device, resolve_dtype
from .prefix_cache import cache_of
from .sample_many import sample_many
from .sampling import SamplingParams, check_max_new_tokens, check_prompts, check_steps_per_call, check_stop, \
    check_text, resolve_seed
from . import scheduler
from .scheduler import SlotPool

FINISH_REASONS = ("stop", "length", "context")


@dataclass
class Completion:
    text: str | None  # None without a tokenizer
    ids: list[int]  # the new tokens
    finish_reason: str  # "stop" | "length" | "context"
    prompt_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # the sample's own seed: generate(prompt_ids, seed=seed) replays it


@dataclass
class StreamEvent:
    """What one decode step produced. Keys are prompt indices."""

    step: int
    tokens: dict[int, int]  # new token of each sample that got one
    texts: dict[int, str]  # the settled text it added (with a tokenizer); may be ""
    finished: dict[int, str]  # samples that finished at this step -> reason


class SampleRun:
    """What ``Generator.sample_many`` returns: an iterator over its Samples that
    also tells the seed the run used (``sample_many(..., seed=run.seed)`` replays it)."""

    def __init__(self, samples: Iterator, seed: int):
        self._samples = samples
        self.seed = seed

    def __iter__(self) -> "SampleRun":
        return self

    def __next__(self):
        return next(self._samples)

    def close(self) -> None:
        self._samples.close()


def _load_tokenizer(tokenizer):
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, Path)):
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(tokenizer))
        except Exception as e:  # noqa: BLE001
            raise GenerationError(f"tokenizer {str(tokenizer)!r} cannot be loaded: {e}") from None
    return tokenizer


def _check_tokenizer(tokenizer, config: SRMConfig) -> None:
    if tokenizer is None:
        return
    size = tokenizer.get_vocab_size()
    if size > config.vocab_size:
        raise GenerationError(
            f"tokenizer has {size} tokens but the model's vocabulary is {config.vocab_size}: "
            "mismatched tokenizer")


def _engine_for(config, weights: dict[str, np.ndarray], dtype: str, device: str):
    """The MAX engine of the config's architecture."""
    return registry.of(config).engine(config, weights, dtype=dtype, device=device)


class Generator:
    """Batched text generation with an SRM or a PHA model on MAX."""

    def __init__(self, config: SRMConfig, weights: dict[str, np.ndarray], tokenizer=None,
                 dtype: str | None = "float32", device: str = "auto", warmup: bool = True,
                 prefix_cache_mb: float | None = None):
        """``prefix_cache_mb``: the prefix-state cache's budget (``serve/prefix_cache.py``;
        None: 64 MiB, 0: off); used by engines that prefill from a state (the SRM)."""
        cache = cache_of(prefix_cache_mb)
        resolve_device(device)  # a bad device fails here, before any work
        dtype = resolve_dtype(dtype)
        tok = _load_tokenizer(tokenizer)
        _check_tokenizer(tok, config)
        engine = _engine_for(config, weights, dtype, device)
        self._init(engine, tok, cache)
        shipped_graphs.install(engine.graph_jobs())  # the embedded model's: no compile on a first run
        if warmup:
            engine.warmup()

    def _init(self, engine: CompiledGraphs, tokenizer, prefix_cache) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = tokenizer
        self.prefix_cache = prefix_cache  # shared by every pool of this generator

    @classmethod
    def from_engine(cls, engine: CompiledGraphs, tokenizer=None, prefix_cache_mb: float | None = None) -> "Generator":
        cache = cache_of(prefix_cache_mb)
        tok = _load_tokenizer(tokenizer)
        _check_tokenizer(tok, engine.config)
        self = cls.__new__(cls)
        self._init(engine, tok, cache)
        return self

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = "auto", dtype: str | None = None,
                        tokenizer=None, warmup: bool = True, prefix_cache_mb: float | None = None) -> "Generator":
        """Load a checkpoint directory (config.json, model.safetensors, tokenizer.json).

        ``path=None`` loads the embedded default model. ``dtype=None`` runs in the
        stored dtype (float16 checkpoints run as float32); ``tokenizer`` overrides
        the checkpoint's tokenizer.json; ``prefix_cache_mb`` as the constructor.
        """
        cache_of(prefix_cache_mb)  # a bad budget fails here, before any loading
        resolve_device(device)
        if path is None:
            path = default_model_path()
        if dtype is not None:
            resolve_dtype(dtype)
        ckpt = load_checkpoint(path)
        if dtype is None:
            dtype = ckpt.dtype if ckpt.dtype in ("float32", "bfloat16") else "float32"
        tok = tokenizer if tokenizer is not None else ckpt.tokenizer_path
        return cls(ckpt.config, ckpt.weights, tokenizer=tok, dtype=dtype, device=device, warmup=warmup,
                   prefix_cache_mb=prefix_cache_mb)

    # ---------------------------------------------------------------- input checks
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise GenerationError("a text prompt needs a tokenizer (pass token ids, or load one)")
        return list(self.tokenizer.encode(check_text(text, "text")).ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

    # ---------------------------------------------------------------- generation
    def generate(self, prompts, max_new_tokens: int = 64, temperature=0.0, top_k=0, top_p=1.0,
                 seed=None, stop=None, steps_per_call: int = 8,
                 progress: Callable[[int, int], None] | None = None):
        """Generate for one prompt (-> Completion) or a list (-> list[Completion]).

        ``progress(done, total)`` is called after every engine call with the
        number of new tokens so far and the most there can be.
        """
        sequences, single, pool = self._pool(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                                             steps_per_call)
        total = sum(max(0, s.budget(self.config.context_length)) for s in sequences)
        for _ in pool.run():
            if progress:
                progress(sum(len(s.tokens) for s in sequences), total)
        if progress and not total:
            progress(0, 0)
        results = [Completion(s.text(self.decode), list(s.tokens), s.reason, s.prompt, s.seed) for s in sequences]
        return results[0] if single else results

    def sample_many(self, prompts, n: int, verifier=None, max_batch="auto", seed=None, **options) -> SampleRun:
        """``n`` samples of every prompt through a refilled pool of state slots, yielded in
        order of completion (see ``serve.sample_many`` for the options).

        ``seed=None`` draws a fresh seed. The returned iterator's ``seed`` replays the
        whole run; each Sample's ``seed`` replays that sample alone through ``generate``.
        Sampling parameters are one value for all prompts.
        """
        seed = resolve_seed(seed)
        samples = sample_many(self, prompts, n, verifier=verifier, max_batch=max_batch, seed=seed, **options)
        return SampleRun(samples, seed)

    def stream(self, prompts, max_new_tokens: int = 64, temperature=0.0, top_k=0, top_p=1.0,
               seed=None, stop=None, steps_per_call: int = 1) -> Iterator[StreamEvent]:
        """Yield one StreamEvent per decode step (arguments as ``generate``).

        Arguments are checked when this is called, not at the first ``next``.
        """
        sequences, _, pool = self._pool(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                                        steps_per_call, stream_text=self.tokenizer is not None)
        return self._events(pool)

    def _pool(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, steps_per_call,
              stream_text: bool = False):
        """The checked arguments as sequences (in prompt order), in a pool that holds them all."""
        ids, single = check_prompts(prompts, self.config, self.encode)
        max_new = check_max_new_tokens(max_new_tokens)
        params = SamplingParams.build(len(ids), temperature, top_k, top_p, seed)
        stop_ids, stop_strings = check_stop(stop, self.config.vocab_size, self.tokenizer is not None)
        check_steps_per_call(steps_per_call)
        stop_ids = frozenset(int(t) for t in stop_ids)
        sequences = [scheduler.Sequence(p, float(params.temperature[b]), int(params.top_k[b]), float(params.top_p[b]),
                              int(params.seed[b]), max_new, stop_ids, tuple(stop_strings), tag=b)
                     for b, p in enumerate(ids)]
        pool = SlotPool(self.engine, self.decode, len(sequences), steps_per_call, stream_text=stream_text,
                        prefix_cache=self.prefix_cache)
        pool.submit(sequences)
        return sequences, single, pool

    @staticmethod
    def _events(pool: SlotPool) -> Iterator[StreamEvent]:
        step = 0
        for turn in pool.run():
            for tick in turn.ticks:
                yield StreamEvent(step, {s.tag: t.token for s, t in tick.items() if t.joined},
                                  {s.tag: t.text for s, t in tick.items() if t.text is not None},
                                  {s.tag: t.finished for s, t in tick.items() if t.finished is not None})
                step += 1


__all__ = ["Completion", "FINISH_REASONS", "Generator", "SampleRun", "StreamEvent"]
