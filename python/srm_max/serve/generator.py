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
any work; a bad one raises ``GenerationError`` naming it (``gen.check(prompts, ...)``
raises it without running anything).

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

Scoring (``serve/logprobs.py``; docs/scoring.md):

    gen.score("To be, or not to be", top_n=5)     # Logprobs: per-token log-probabilities
    gen.loglikelihood([("The sky is", " blue"), ("The sky is", " green")])  # [(sum, is_greedy)]
    gen.loglikelihood_rolling(long_text)          # lm-eval's rolling windows
    gen.generate("To be", logprobs=5).logprobs    # the sampled tokens' log-probabilities

Every log-probability is the model's raw one (log_softmax of its logits: no
temperature, top-k or top-p, whatever sampled the token). ``score`` and
``loglikelihood`` score through the engine's prefill graph. With ``logprobs=n`` a completion's
tokens get theirs from the decode itself (the whole-step decode ops and the plain decode
graphs alike; the first token from the graph that drew it, graphs/sampler.py;
``scoring.completion_scores``): no second pass, the same numbers as scoring the text.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import shipped_graphs
from ..checkpoints.format import load_checkpoint
from ..checkpoints.tokenizer import check_is_tokenizer, check_vocabulary, read_tokenizer
from ..embedded import model_dir
from ..errors import GenerationError
from ..models import registry
from ..models.architecture import ModelConfig
from ..runtime.compiled import CompiledGraphs
from ..runtime.device import DEFAULT_DEVICE, resolve_device, resolve_dtype, run_dtype
from .prefix_cache import cache_of
from . import logprobs as scoring_api
from .logprobs import Logprobs, TokenTexts
from . import sequence
from .sample_many import sample_many
from .sampling import DEFAULT_STEPS_PER_CALL, SamplingParams, brief_repr, check_max_new_tokens, check_prompts, \
    check_steps_per_call, check_stop, check_text, resolve_seed
from .scheduler import SlotPool
from .scoring import check_top_n, completion_scores

FINISH_REASONS = ("stop", "length", "context")


@dataclass
class Completion:
    text: str | None  # None without a tokenizer
    ids: list[int]  # the new tokens
    finish_reason: str  # "stop" | "length" | "context"
    prompt_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # the sample's own seed: generate(prompt_ids, seed=seed) replays it
    logprobs: Logprobs | None = None  # with generate(..., logprobs=n): the new tokens' (text offsets from 0)


@dataclass
class StreamEvent:
    """What one decode step produced. Keys are prompt indices."""

    step: int
    tokens: dict[int, int]  # new token of each sample that got one
    texts: dict[int, str]  # the settled text it added (with a tokenizer); may be ""
    finished: dict[int, str]  # samples that finished at this step -> reason
    # with stream(..., logprobs=n): the log-probability of each new token, and with n >= 1
    # the n likeliest tokens there ({token text, or id without a tokenizer: log-probability})
    logprobs: dict[int, float] = field(default_factory=dict)
    top_logprobs: dict[int, dict] = field(default_factory=dict)


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


def _check_path(path) -> None:
    """A GenerationError naming ``path`` unless it is one (a str or an os.PathLike), or None."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise GenerationError(f"path must be a checkpoint directory (a str or a pathlib.Path), got {brief_repr(path)}")


def _check_tokenizer(tokenizer) -> None:
    """A GenerationError naming ``tokenizer`` unless it is a Tokenizer, a tokenizer.json path or None."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        check_is_tokenizer(tokenizer, GenerationError)


def _load_tokenizer(tokenizer, config: ModelConfig):
    """A tokenizer (a Tokenizer, or a tokenizer.json path) checked against the vocabulary, or None."""
    _check_tokenizer(tokenizer)
    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = read_tokenizer(tokenizer, GenerationError)
    check_vocabulary(tokenizer, config.vocab_size, GenerationError)
    return tokenizer


def _engine_for(config, weights: dict[str, np.ndarray], dtype: str, device: str):
    """The MAX engine of the config's architecture."""
    return registry.of(config).engine(config, weights, dtype=dtype, device=device)


class Generator:
    """Batched text generation with an SRM or a PHA model on MAX."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], tokenizer=None,
                 dtype: str | None = "float32", device: str = DEFAULT_DEVICE, warmup: bool = True,
                 prefix_cache_mb: float | None = None):
        """``prefix_cache_mb``: the prefix-state cache's budget (``serve/prefix_cache.py``;
        None: 64 MiB, 0: off); used by engines that prefill from a state (the SRM)."""
        cache = cache_of(prefix_cache_mb)
        resolve_device(device)  # a bad device fails here, before any work
        dtype = resolve_dtype(dtype)
        tok = _load_tokenizer(tokenizer, config)
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
        self.token_texts = TokenTexts(self.decode)  # each token's text decoded once

    @classmethod
    def from_engine(cls, engine: CompiledGraphs, tokenizer=None, prefix_cache_mb: float | None = None) -> "Generator":
        cache = cache_of(prefix_cache_mb)
        tok = _load_tokenizer(tokenizer, engine.config)
        self = cls.__new__(cls)
        self._init(engine, tok, cache)
        return self

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = DEFAULT_DEVICE, dtype: str | None = None,
                        tokenizer=None, warmup: bool = True, prefix_cache_mb: float | None = None) -> "Generator":
        """Load a checkpoint directory (config.json, model.safetensors, tokenizer.json).

        ``path=None`` loads the embedded default model. ``dtype=None`` runs in the
        stored dtype (float16 checkpoints run as float32); ``tokenizer`` overrides
        the checkpoint's tokenizer.json; ``prefix_cache_mb`` as the constructor.
        """
        _check_path(path)  # as every argument below: refused before any loading
        _check_tokenizer(tokenizer)
        cache_of(prefix_cache_mb)
        resolve_device(device)
        if dtype is not None:
            resolve_dtype(dtype)
        ckpt = load_checkpoint(model_dir(path))
        if dtype is None:
            dtype = run_dtype(ckpt.dtype)
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
                 seed=None, stop=None, steps_per_call: int = DEFAULT_STEPS_PER_CALL,
                 progress: Callable[[int, int], None] | None = None, logprobs: int | None = None):
        """Generate for one prompt (-> Completion) or a list (-> list[Completion]).

        ``progress(done, total)`` is called after every engine call with the
        number of new tokens so far and the most there can be. ``logprobs=n`` (0-20):
        each Completion's ``logprobs`` holds its tokens' raw log-probabilities and the
        n likeliest tokens at each place (module docs).
        """
        top_n = check_top_n(logprobs, "logprobs", allow_none=True)
        sequences, single, pool = self._pool(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                                             steps_per_call, logprobs=top_n)
        total = sum(max(0, s.budget(self.config.context_length)) for s in sequences)
        for _ in pool.run():
            if progress:
                progress(sum(len(s.tokens) for s in sequences), total)
        if progress and not total:
            progress(0, 0)
        results = [Completion(s.text(self.decode), list(s.tokens), s.reason, s.prompt, s.seed) for s in sequences]
        if top_n is not None:
            scores = completion_scores(sequences, top_n)
            for r, s in zip(results, scores):
                r.logprobs = self.token_texts.logprobs(r.ids, s, top_n, before=r.prompt_ids)
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
               seed=None, stop=None, steps_per_call: int = 1, logprobs: int | None = None) -> Iterator[StreamEvent]:
        """Yield one StreamEvent per decode step (arguments as ``generate``; with
        ``logprobs`` each event carries its tokens' log-probabilities, scored once per
        engine call for every sample that took tokens in it).

        Arguments are checked when this is called, not at the first ``next``.
        """
        top_n = check_top_n(logprobs, "logprobs", allow_none=True)
        sequences, _, pool = self._pool(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                                        steps_per_call, stream_text=self.tokenizer is not None, logprobs=top_n)
        return self._events(pool, top_n, self.token_texts)

    def check(self, prompts, max_new_tokens: int = 64, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=None,
              steps_per_call: int = DEFAULT_STEPS_PER_CALL, logprobs: int | None = None) -> None:
        """Raise the GenerationError that ``generate`` and ``stream`` raise for these arguments,
        running nothing: for a caller that must refuse them before it shows anything."""
        self._sequences(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, steps_per_call,
                        check_top_n(logprobs, "logprobs", allow_none=True))

    def _sequences(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, steps_per_call,
                   logprobs: int | None = None) -> tuple[list[sequence.Sequence], bool]:
        """The checked arguments as sequences (in prompt order), and whether the prompt was a single one."""
        ids, single = check_prompts(prompts, self.config, self.encode)
        max_new = check_max_new_tokens(max_new_tokens)
        params = SamplingParams.build(len(ids), temperature, top_k, top_p, seed)
        stop_ids, stop_strings = check_stop(stop, self.config.vocab_size, self.tokenizer is not None)
        check_steps_per_call(steps_per_call)
        stop_ids = frozenset(int(t) for t in stop_ids)
        sequences = [sequence.Sequence(p, float(params.temperature[b]), int(params.top_k[b]),
                                       float(params.top_p[b]), int(params.seed[b]), max_new, stop_ids,
                                       tuple(stop_strings), tag=b, logprobs=logprobs)
                     for b, p in enumerate(ids)]
        return sequences, single

    def _pool(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, steps_per_call,
              stream_text: bool = False, logprobs: int | None = None):
        """The checked arguments as sequences (in prompt order), in a pool that holds them all."""
        sequences, single = self._sequences(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                                            steps_per_call, logprobs)
        pool = SlotPool(self.engine, self.decode, len(sequences), steps_per_call, stream_text=stream_text,
                        prefix_cache=self.prefix_cache)
        pool.submit(sequences)
        return sequences, single, pool

    def _events(self, pool: SlotPool, top_n: int | None = None,
                texts: TokenTexts | None = None) -> Iterator[StreamEvent]:
        """The pool's ticks as events; with ``top_n`` their tokens' log-probabilities, those the
        decode returned (``Taken.score``)."""
        step = 0
        for turn in pool.run():
            for tick in turn.ticks:
                event = StreamEvent(step, {s.tag: t.token for s, t in tick.items() if t.joined},
                                    {s.tag: t.text for s, t in tick.items() if t.text is not None},
                                    {s.tag: t.finished for s, t in tick.items() if t.finished is not None})
                for s, t in tick.items():
                    if top_n is None or not t.joined:
                        continue
                    value, ids, values = t.score
                    event.logprobs[s.tag] = value
                    if top_n:
                        event.top_logprobs[s.tag] = texts.top(ids, values, top_n)
                yield event
                step += 1

    # ---------------------------------------------------------------- scoring
    def score(self, texts, top_n: int = 0, max_length: int | None = None):
        """The log-probability of every token of a text (-> Logprobs) or of each text of a
        list (-> list[Logprobs]) after the tokens before it; the first token, with no
        context, gets ``None``. Texts are text or token ids.

        ``top_n`` (0-20): the likeliest tokens at each place too. A text longer than
        ``max_length`` (default: the context length) is scored in lm-eval's
        ``loglikelihood_rolling`` windows: each later window reads only the token(s)
        before it, no state passes between windows (``serve/logprobs.py``).
        """
        return scoring_api.score(self, texts, top_n, max_length)

    def loglikelihood(self, requests, max_length: int | None = None,
                      progress: Callable[[int, int], None] | None = None) -> list[tuple[float, bool]]:
        """lm-eval's ``loglikelihood``: for each (context, continuation) pair, the sum of the
        continuation's log-probabilities after the context and whether each of its tokens is
        the likeliest there (``is_greedy``).

        Pairs are texts, tokenized as lm-eval's causal models do (the context's trailing
        spaces move to the continuation, context + continuation is encoded whole and split
        after the context's tokens; an empty context is the end-of-text token), or token
        ids (lists or 1-D integer arrays). As lm-eval, the model reads the last
        ``max_length`` tokens of context and continuation. A context shared by several
        continuations is read once and its state forked; ``progress(done, total)`` is
        called after each engine batch.
        """
        return scoring_api.loglikelihood(self, requests, max_length, progress)

    def loglikelihood_rolling(self, texts, max_length: int | None = None):
        """lm-eval's ``loglikelihood_rolling``: the total log-probability of a text (-> float)
        or of each of a list, every token scored once in rolling windows of ``max_length``
        (default: the context length), the first after the end-of-text token (without one
        in the tokenizer the first token is not scored)."""
        return scoring_api.loglikelihood_rolling(self, texts, max_length)

    @property
    def end_of_text_id(self) -> int | None:
        """The tokenizer's ``<|endoftext|>`` id (the document separator of `srm-max train`), or None."""
        return scoring_api.end_of_text_id(self.tokenizer)


__all__ = ["Completion", "FINISH_REASONS", "Generator", "SampleRun", "StreamEvent"]
