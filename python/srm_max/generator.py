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

from .config import SRMConfig
from .engine import Engine, resolve_device, resolve_dtype
from .errors import GenerationError
from .sampling import SamplingParams, check_max_new_tokens, resolve_seed

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


def _settled(text: str, stop_strings: Sequence[str]) -> int:
    """How much of a running sample's ``text`` its stream may show.

    Not a trailing U+FFFD: a byte-level tokenizer decodes the first bytes of a
    character split across tokens as U+FFFD until its last byte arrives. Not a
    tail that could be the start of a stop string: the sample's text would be
    cut before it.
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    held = 0
    for s in stop_strings:
        for k in range(min(len(s) - 1, end), held, -1):
            if text.startswith(s[:k], end - k):
                held = k
                break
    return end - held


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
    """The MAX engine for the config's architecture: PHAEngine for "pha", else Engine (SRM)."""
    if config.architecture == "pha":
        from .pha_engine import PHAEngine

        return PHAEngine(config, weights, dtype=dtype, device=device)
    return Engine(config, weights, dtype=dtype, device=device)


class Generator:
    """Batched text generation with an SRM or a PHA model on MAX."""

    def __init__(self, config: SRMConfig, weights: dict[str, np.ndarray], tokenizer=None,
                 dtype: str | None = "float32", device: str = "auto", warmup: bool = True):
        resolve_device(device)  # a bad device fails here, before any work
        dtype = resolve_dtype(dtype)
        tok = _load_tokenizer(tokenizer)
        _check_tokenizer(tok, config)
        engine = _engine_for(config, weights, dtype, device)
        self._init(engine, tok)
        if warmup:
            engine.warmup()

    def _init(self, engine: Engine, tokenizer) -> None:
        self.engine = engine
        self.config = engine.config
        self.tokenizer = tokenizer

    @classmethod
    def from_engine(cls, engine: Engine, tokenizer=None) -> "Generator":
        tok = _load_tokenizer(tokenizer)
        _check_tokenizer(tok, engine.config)
        self = cls.__new__(cls)
        self._init(engine, tok)
        return self

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = "auto", dtype: str | None = None,
                        tokenizer=None, warmup: bool = True) -> "Generator":
        """Load a checkpoint directory (config.json, model.safetensors, tokenizer.json).

        ``path=None`` loads the embedded default model. ``dtype=None`` runs in the
        stored dtype (float16 checkpoints run as float32); ``tokenizer`` overrides
        the checkpoint's tokenizer.json.
        """
        resolve_device(device)
        if path is None:
            from .embedded import default_model_path

            path = default_model_path()
        if dtype is not None:
            resolve_dtype(dtype)
        from .checkpoint import load_checkpoint

        ckpt = load_checkpoint(path)
        if ckpt.config.architecture not in ("srm", "pha"):
            raise GenerationError(
                f"{path}: architecture {ckpt.config.architecture!r} is not served by the MAX engine "
                "(its PyTorch reference is srm_max.reference)")
        if dtype is None:
            dtype = ckpt.dtype if ckpt.dtype in ("float32", "bfloat16") else "float32"
        tok = tokenizer if tokenizer is not None else ckpt.tokenizer_path
        return cls(ckpt.config, ckpt.weights, tokenizer=tok, dtype=dtype, device=device, warmup=warmup)

    # ---------------------------------------------------------------- input checks
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise GenerationError("a text prompt needs a tokenizer (pass token ids, or load one)")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))

    def _normalize_prompts(self, prompts) -> tuple[list[list[int]], bool]:
        """-> (list of id lists, single?)"""
        def is_int(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

        single = False
        if isinstance(prompts, str):
            items, single = [prompts], True
        elif isinstance(prompts, np.ndarray):
            if prompts.ndim == 1:
                items, single = [prompts.tolist()], True
            elif prompts.ndim == 2:
                items = [row.tolist() for row in prompts]
            else:
                raise GenerationError(f"prompts: expected a 1-D or 2-D id array, got {prompts.ndim}-D")
        elif isinstance(prompts, Sequence):
            if len(prompts) == 0:
                raise GenerationError("prompt 0 is empty")
            if all(is_int(v) for v in prompts):
                items, single = [list(prompts)], True
            else:
                items = list(prompts)
        else:
            raise GenerationError(f"prompts: expected text, token ids or a list of them, got {type(prompts).__name__}")
        out = []
        V, n = self.config.vocab_size, self.config.context_length
        for i, p in enumerate(items):
            if isinstance(p, str):
                ids = self.encode(p)
            elif isinstance(p, np.ndarray) and p.ndim == 1:
                ids = p.tolist()
            elif isinstance(p, Sequence) and all(is_int(v) for v in p):
                ids = list(p)
            else:
                raise GenerationError(f"prompt {i}: expected text or a sequence of token ids, got {type(p).__name__}")
            if len(ids) == 0:
                raise GenerationError(f"prompt {i} is empty")
            bad = [t for t in ids if not (0 <= int(t) < V)]
            if bad:
                raise GenerationError(f"prompt {i}: token id {int(bad[0])} is outside the vocabulary [0, {V})")
            if len(ids) > n:
                raise GenerationError(f"prompt {i} has {len(ids)} tokens, more than the context length {n}")
            out.append([int(t) for t in ids])
        return out, single

    def _normalize_stop(self, stop) -> tuple[np.ndarray, list[str]]:
        if stop is None:
            return np.zeros(0, np.int64), []
        items = [stop] if isinstance(stop, (str, int, np.integer)) else list(stop)
        ids, strings = [], []
        for s in items:
            if isinstance(s, str):
                if not s:
                    raise GenerationError("stop: empty stop string")
                if self.tokenizer is None:
                    raise GenerationError(f"stop string {s!r} needs a tokenizer")
                strings.append(s)
            elif isinstance(s, (int, np.integer)) and not isinstance(s, bool):
                if not 0 <= int(s) < self.config.vocab_size:
                    raise GenerationError(f"stop token id {int(s)} is outside the vocabulary [0, {self.config.vocab_size})")
                ids.append(int(s))
            else:
                raise GenerationError(f"stop: expected token ids or strings, got {s!r}")
        return np.array(ids, np.int64), strings

    # ---------------------------------------------------------------- generation
    def generate(self, prompts, max_new_tokens: int = 64, temperature=0.0, top_k=0, top_p=1.0,
                 seed=None, stop=None, steps_per_call: int = 8,
                 progress: Callable[[int, int], None] | None = None):
        """Generate for one prompt (-> Completion) or a list (-> list[Completion]).

        ``progress(done, total)`` is called after every engine call with the
        number of new tokens so far and the most there can be.
        """
        run = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, steps_per_call)
        for _ in self._run(run, events=False, progress=progress):
            pass
        results = self._completions(run)
        return results[0] if run["single"] else results

    def sample_many(self, prompts, n: int, verifier=None, max_batch="auto", seed=None, **options) -> SampleRun:
        """``n`` samples of every prompt through a refilled pool of state slots, yielded in
        order of completion (see ``slot_pool.sample_many`` for the options).

        ``seed=None`` draws a fresh seed. The returned iterator's ``seed`` replays the
        whole run; each Sample's ``seed`` replays that sample alone through ``generate``.
        Sampling parameters are one value for all prompts.
        """
        from .slot_pool import sample_many

        seed = resolve_seed(seed)
        for name in ("temperature", "top_k", "top_p"):
            value = options.get(name)
            if isinstance(value, (list, tuple, np.ndarray)):
                raise GenerationError(
                    f"{name}: sample_many takes one value for all prompts, got a list of {np.size(value)}")
        if isinstance(options.get("top_k"), (int, np.integer)) and options["top_k"] == -1:
            options["top_k"] = 0  # -1 means off, as 0 does; the engine gets the one spelling
        samples = sample_many(self, prompts, n, verifier=verifier, max_batch=max_batch, seed=seed, **options)
        return SampleRun(samples, seed)

    def stream(self, prompts, max_new_tokens: int = 64, temperature=0.0, top_k=0, top_p=1.0,
               seed=None, stop=None, steps_per_call: int = 1) -> Iterator[StreamEvent]:
        """Yield one StreamEvent per decode step (arguments as ``generate``).

        Arguments are checked when this is called, not at the first ``next``.
        """
        run = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, steps_per_call)
        return self._run(run, events=True, progress=None)

    def _prepare(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, steps_per_call) -> dict:
        ids, single = self._normalize_prompts(prompts)
        max_new = check_max_new_tokens(max_new_tokens)
        params = SamplingParams.build(len(ids), temperature, top_k, top_p, seed)
        stop_ids, stop_strings = self._normalize_stop(stop)
        if not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise GenerationError(f"steps_per_call must be an integer >= 1, got {steps_per_call!r}")
        B, n = len(ids), self.config.context_length
        lengths = np.array([len(p) for p in ids], np.int64)
        return {
            "prompts": ids, "single": single, "max_new": max_new, "params": params,
            "stop_ids": stop_ids, "stop_strings": stop_strings, "steps": steps_per_call,
            "lengths": lengths, "budget": np.minimum(max_new, n - lengths),
            "out": np.zeros((B, max(1, min(max_new, n))), np.int64), "count": np.zeros(B, np.int64),
            "done": np.zeros(B, bool), "reason": [""] * B, "cut": [None] * B,
            "shown": [0] * B,  # characters of each sample's text its stream has emitted
        }

    def _completions(self, run) -> list[Completion]:
        res = []
        for b, p in enumerate(run["prompts"]):
            ids = run["out"][b, : run["count"][b]].tolist()
            text = self.decode(ids)
            if text is not None and run["cut"][b] is not None:
                text = text[: run["cut"][b]]
            res.append(Completion(text, ids, run["reason"][b], p, run["params"].seed[b]))
        return res

    def _accept(self, run, rows: np.ndarray, tokens: np.ndarray, step: int, events: bool):
        """Take one step's tokens for samples ``rows`` (those still running in the engine)."""
        done, count, out = run["done"], run["count"], run["out"]
        live = ~done[rows]
        r, t = rows[live], tokens[live]
        finished: dict[int, str] = {}
        is_stop = np.isin(t, run["stop_ids"])
        stopped = r[is_stop]
        for b in stopped:
            done[b], run["reason"][b] = True, "stop"
            finished[int(b)] = "stop"
        r, t = r[~is_stop], t[~is_stop]
        out[r, count[r]] = t
        count[r] += 1
        streams_text = events and self.tokenizer is not None
        decoded: dict[int, str] = {}
        if run["stop_strings"] or streams_text:
            for b in r:
                b = int(b)
                text = decoded[b] = self.decode(out[b, : count[b]].tolist())
                hits = [text.find(s) for s in run["stop_strings"] if s in text]
                if hits:
                    done[b], run["reason"][b], run["cut"][b] = True, "stop", min(hits)
                    finished[b] = "stop"
        for b in r:
            b = int(b)
            if done[b]:
                continue
            if count[b] >= run["max_new"]:
                done[b], run["reason"][b] = True, "length"
                finished[b] = "length"
            elif run["lengths"][b] + count[b] >= self.config.context_length:
                done[b], run["reason"][b] = True, "context"
                finished[b] = "context"
        if not events:
            return None
        texts: dict[int, str] = {}
        if streams_text:
            for b in [*stopped.tolist(), *r.tolist()]:
                text = decoded[b] if b in decoded else self.decode(out[b, : count[b]].tolist())
                texts[b] = self._stream_text(run, b, text)
        return StreamEvent(step, {int(b): int(x) for b, x in zip(r, t)}, texts, finished)

    @staticmethod
    def _stream_text(run, b: int, text: str) -> str:
        """What sample ``b``'s stream adds, given its decoded ``text`` so far: the newly
        settled part while it runs, the rest of its final text when it has finished."""
        if run["done"][b]:
            end = len(text) if run["cut"][b] is None else run["cut"][b]
        else:
            end = _settled(text, run["stop_strings"])
        start = run["shown"][b]
        run["shown"][b] = max(start, end)
        return text[start:end]

    def _run(self, run, events: bool, progress) -> Iterator[StreamEvent]:
        eng = self.engine
        n = self.config.context_length
        done, budget = run["done"], run["budget"]
        for b in np.flatnonzero(budget <= 0):
            done[b] = True
            run["reason"][b] = "length" if run["max_new"] == 0 else "context"
        total = int(budget.clip(min=0).sum())
        if done.all():
            if progress:
                progress(0, total)
            return
        rows = np.flatnonzero(~done)  # sample index of each engine row
        sampling = run["params"].arrays().take(rows)
        pre = eng.prefill([run["prompts"][b] for b in rows], sampling)
        ev = self._accept(run, rows, pre.next_ids, 0, events)
        if progress:
            progress(int(run["count"].sum()), total)
        if ev is not None:
            yield ev
        states, ids = pre.states, pre.next_ids
        positions = run["lengths"][rows].copy()  # position of ``ids``
        sbufs = eng.sampling_buffers(sampling)
        ids_buf = pos_buf = None
        step = 1
        while not done.all():
            live = ~done[rows]
            if live.sum() * 2 <= len(rows) and len(rows) > 1:
                # Compact: drop finished rows (one small host round trip of the states).
                keep = np.flatnonzero(live)
                st = eng.host(states)[:, keep]
                states = eng._dev(np.ascontiguousarray(st))
                rows, ids, positions = rows[keep], np.asarray(ids)[keep], positions[keep]
                sampling = sampling.take(keep)
                sbufs = eng.sampling_buffers(sampling)
                ids_buf = pos_buf = None
            remaining = int((np.minimum(run["max_new"] - run["count"][rows],
                                        n - run["lengths"][rows] - run["count"][rows]))[~done[rows]].max())
            S = max(1, min(run["steps"], remaining))
            res = eng.decode(ids if ids_buf is None else ids_buf,
                             positions if pos_buf is None else pos_buf, states, sbufs, S)
            states, ids_buf, pos_buf = res.states, res.ids, res.positions
            ids, positions = res.tokens[:, -1], positions + S
            for s in range(S):
                ev = self._accept(run, rows, res.tokens[:, s], step, events)
                step += 1
                if ev is not None:
                    yield ev
                if done[rows].all():
                    break
            if progress:
                progress(int(run["count"].sum()), total)


__all__ = ["Generator", "Completion", "StreamEvent", "SampleRun", "FINISH_REASONS"]
