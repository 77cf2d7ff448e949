"""Generation arguments, checked: the one place ``Generator``, ``sample_many`` and
the HTTP server check prompts, stop conditions and sampling parameters (each
caller turns a ``GenerationError`` into its own error).

Every sampling parameter may be a scalar (same for all prompts) or a sequence
with one value per prompt. ``temperature=0`` is greedy; ``top_k=0`` (or -1) and
``top_p=1`` switch those filters off. ``seed=None`` draws a fresh random seed;
a scalar seed s gives prompt i the seed s + i (mod 2**64); a list gives each
prompt its own seed. A sample's tokens depend only on its prompt, its
parameters and its seed, never on the rest of the batch.

Text (a prompt, a stop string) must be valid Unicode: a lone surrogate (the
JSON escape ``"\\ud800"``) has no UTF-8 form, so no tokenizer can read it. Bytes are
not text (nor token ids, although they iterate as ints): they are refused. A
real-valued parameter must be finite and keep its meaning in the engine's
float32: a value that overflows to inf, or a nonzero one that rounds to 0, is
refused. Rounding to 0 includes float32's subnormal range (below its smallest normal
number, about 1.18e-38): the engine flushes subnormals to 0, so a top_p there would
switch the filter off.
"""

from __future__ import annotations

import math
import reprlib
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ContextLengthError, GenerationError
from ..scalars import is_int, is_real

SEED_LIMIT = 1 << 64  # seeds are uint64 in the graphs
_I64_MAX = (1 << 63) - 1

_brief = reprlib.Repr()
_brief.maxstring = _brief.maxother = _brief.maxlong = 60
_brief.maxlevel, _brief.maxlist, _brief.maxdict = 2, 4, 4


def brief_repr(value) -> str:
    """``repr(value)`` cut short: an error message never echoes a megabyte of input,
    and a deeply nested value is not walked to its bottom."""
    return _brief.repr(value)


def _per_sample(name: str, value, batch: int) -> list[tuple[str, object]]:
    """(name, value) per sample: ``name[i]`` for the items of a per-prompt list."""
    if isinstance(value, (list, tuple, np.ndarray)):
        values = list(np.asarray(value).tolist()) if isinstance(value, np.ndarray) else list(value)
        if len(values) != batch:
            raise GenerationError(
                f"{name}: expected one value or a list of {batch} (one per prompt), got a list of {len(values)}")
        return [(f"{name}[{i}]", v) for i, v in enumerate(values)]
    return [(name, value)] * batch


_F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32; the engine flushes smaller ones to 0


def _fits_float32(x: float) -> bool:
    with np.errstate(over="ignore", under="ignore"):
        y = np.float32(x)
    return bool(np.isfinite(y)) and (abs(y) >= _F32_TINY or x == 0)


def check_real(value, name: str, rule: str, accept: Callable[[float], bool]) -> float:
    """``value`` as a float: a real number (not a bool), finite, that ``accept`` takes (else a
    GenerationError "``name`` must be ``rule``") and that the engine's float32 holds: no
    overflow to inf, no nonzero value rounded or flushed to 0 (else a GenerationError saying which)."""
    if is_real(value):
        try:
            x = float(value)
        except OverflowError:  # an int beyond every float
            x = math.inf
        if math.isfinite(x) and accept(x):
            if _fits_float32(x):
                return x
            what = ("rounds to 0 in the engine's float32 (below its smallest normal number, "
                    f"{_F32_TINY:.3g})" if abs(x) < 1 else "overflows to inf in the engine's float32")
            raise GenerationError(f"{name}: {brief_repr(value)} {what}")
    raise GenerationError(f"{name} must be {rule}, got {brief_repr(value)}")


def check_temperature(value, name: str = "temperature", maximum: float = math.inf) -> float:
    """A temperature >= 0 (0 = greedy), at most ``maximum`` (the server takes OpenAI's 2)."""
    rule = "a finite number >= 0" if maximum == math.inf else f"a number in [0, {maximum:g}]"
    return check_real(value, name, rule + " (0 = greedy)", lambda t: 0 <= t <= maximum)


def check_top_p(value, name: str = "top_p") -> float:
    """A nucleus mass in (0, 1] (1 = off); 0 keeps no token, so it is refused."""
    return check_real(value, name, "a number in (0, 1] (1 = off)", lambda p: 0 < p <= 1)


def check_top_k(value, name: str = "top_k") -> int:
    """A top-k as the engine takes it: 0 for off (-1 means off too), else k."""
    if not is_int(value) or not -1 <= int(value) <= _I64_MAX:
        raise GenerationError(
            f"{name} must be an integer >= 0, or -1 (0 and -1 = off), below 2**63, got {brief_repr(value)}")
    return max(int(value), 0)


def check_seed(seed, name: str = "seed") -> int:
    """A seed as an int, or a GenerationError naming ``name``."""
    if not is_int(seed) or not 0 <= int(seed) < SEED_LIMIT:
        raise GenerationError(f"{name} must be an integer in [0, 2**64), got {brief_repr(seed)}")
    return int(seed)


def fresh_seed() -> int:
    # 63 bits: the seed also fits a signed int64 (numpy, JSON readers), so reporting it loses nothing.
    return secrets.randbits(63)


def nth_seed(seed: int, k: int) -> int:
    """The seed of sample k of a call or request seeded ``seed``: seed + k (mod 2**64), so
    ``generate(prompt_k, seed=nth_seed(seed, k))`` replays it alone."""
    return (seed + k) % SEED_LIMIT


def resolve_seed(seed, name: str = "seed") -> int:
    """``seed`` checked, or a fresh random one for ``None``."""
    return fresh_seed() if seed is None else check_seed(seed, name)


@dataclass
class SamplingParams:
    """Validated per-sample parameters (lists of length B)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seed: list[int]

    @classmethod
    def build(cls, batch: int, temperature=0.0, top_k=0, top_p=1.0, seed=None) -> "SamplingParams":
        temps = [check_temperature(t, name) for name, t in _per_sample("temperature", temperature, batch)]
        ks = [check_top_k(k, name) for name, k in _per_sample("top_k", top_k, batch)]
        ps = [check_top_p(p, name) for name, p in _per_sample("top_p", top_p, batch)]
        if isinstance(seed, (list, tuple, np.ndarray)):
            seeds = [check_seed(s, name) for name, s in _per_sample("seed", seed, batch)]
        else:
            base = resolve_seed(seed)
            seeds = [nth_seed(base, i) for i in range(batch)]
        return cls(temps, ks, ps, seeds)

    def arrays(self):
        from ..runtime.call_types import SamplingArrays

        return SamplingArrays(np.array(self.temperature, np.float32), np.array(self.top_k, np.int64),
                              np.array(self.top_p, np.float32), np.array(self.seed, np.uint64))


def check_scalar_sampling(temperature, top_k, top_p) -> tuple[float, int, float]:
    """One temperature, top-k and top-p for every sample (``sample_many``'s)."""
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if isinstance(value, (list, tuple, np.ndarray)):
            raise GenerationError(
                f"{name}: sample_many takes one value for all prompts, got a list of {np.size(value)}")
    return check_temperature(temperature), check_top_k(top_k), check_top_p(top_p)


def check_max_new_tokens(max_new_tokens) -> int:
    if not is_int(max_new_tokens) or int(max_new_tokens) < 0:
        raise GenerationError(f"max_new_tokens must be an integer >= 0, got {brief_repr(max_new_tokens)}")
    return int(max_new_tokens)


# Decode steps per engine call for generate, sample_many and the server: more amortise
# each call's fixed cost, fewer let a finished sample's slot refill (and a request join) sooner.
DEFAULT_STEPS_PER_CALL = 8
# The most samples decoded together that a memory plan gives (sample_many.plan_max_batch) and
# that serve's --max-batch accepts.
MAX_SLOTS = 65536


def check_steps_per_call(steps_per_call) -> int:
    if not is_int(steps_per_call) or steps_per_call < 1:
        raise GenerationError(f"steps_per_call must be an integer >= 1, got {brief_repr(steps_per_call)}")
    return int(steps_per_call)


# ------------------------------------------------------------ text, prompts, stop
def check_text(text: str, name: str) -> str:
    """``text`` if it is valid Unicode, else a GenerationError naming ``name`` and where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(f"{name}: character {e.start} is a lone surrogate "
                              f"(U+{ord(text[e.start]):04X}): not valid Unicode text") from None
    return text


_BYTES = (bytes, bytearray, memoryview)


def refuse_bytes(value, name: str) -> None:
    """A GenerationError naming ``name`` when ``value`` is bytes: neither text (its encoding
    is the caller's to know) nor token ids, although it iterates as ints."""
    if isinstance(value, _BYTES):
        raise GenerationError(f"{name}: got {type(value).__name__}, which is not text: decode it to str "
                              "(data.decode('utf-8')), or pass a list of token ids")


def token_ids(p) -> list[int] | None:
    """``p`` as a new list of Python ints when it is a sequence of integers (a 1-D integer
    array included; bools and bytes are not integers here), else None. Prompts run to
    thousands of ids, so the common case (a list of ints) is checked by type in one pass."""
    if isinstance(p, np.ndarray):
        return p.tolist() if p.ndim == 1 and p.dtype.kind in "iu" else None
    if not isinstance(p, Sequence) or isinstance(p, (str, *_BYTES)):
        return None
    if set(map(type, p)) <= {int}:
        return list(p)
    return [int(v) for v in p] if all(is_int(v) for v in p) else None


def check_prompts(prompts, config, encode: Callable[[str], list[int]]) -> tuple[list[list[int]], bool]:
    """Prompts (text, token ids, or a list of either) -> (one id list per prompt, single?).

    A single prompt is a str or a flat sequence of ints; ``encode`` turns text into
    ids (and raises a GenerationError without a tokenizer). Every prompt is non-empty,
    in the vocabulary and within the context length of ``config``.
    """
    single = False
    refuse_bytes(prompts, "prompts")
    if isinstance(prompts, str):
        items, single = [prompts], True
    elif isinstance(prompts, np.ndarray):
        if prompts.dtype.kind not in "iu":
            raise GenerationError(f"prompts: expected an array of integer token ids, got an array of {prompts.dtype}")
        if prompts.ndim == 1:
            items, single = [prompts.tolist()], True
        elif prompts.ndim == 2:
            if len(prompts) == 0:  # as an empty list: no prompt to run
                raise GenerationError(f"prompts is empty: an id array of shape {prompts.shape} holds no prompt")
            items = [row.tolist() for row in prompts]
        else:
            raise GenerationError(f"prompts: expected a 1-D or 2-D id array, got {prompts.ndim}-D")
    elif isinstance(prompts, Sequence):
        if len(prompts) == 0:
            raise GenerationError("prompt 0 is empty")
        ids = token_ids(prompts)
        if ids is not None:
            items, single = [ids], True
        else:
            items = list(prompts)
    else:
        raise GenerationError(f"prompts: expected text, token ids or a list of them, got {type(prompts).__name__}")
    out = []
    V, n = config.vocab_size, config.context_length
    for i, p in enumerate(items):
        refuse_bytes(p, f"prompt {i}")
        if isinstance(p, str):
            ids = encode(check_text(p, f"prompt {i}"))
        else:
            ids = token_ids(p)
            if ids is None:
                kind = f"an array of {p.dtype}" if isinstance(p, np.ndarray) else type(p).__name__
                raise GenerationError(f"prompt {i}: expected text or a sequence of token ids, got {kind}")
        if len(ids) == 0:
            raise GenerationError(f"prompt {i} is empty")
        if min(ids) < 0 or max(ids) >= V:
            bad = next(t for t in ids if not 0 <= t < V)
            raise GenerationError(f"prompt {i}: token id {brief_repr(bad)} is outside the vocabulary [0, {V})")
        if len(ids) > n:
            raise ContextLengthError(f"prompt {i} has {len(ids)} tokens, more than the context length {n}")
        out.append(ids)
    return out, single


def check_stop(stop, vocab_size: int, has_tokenizer: bool) -> tuple[np.ndarray, list[str]]:
    """Stop conditions (a token id, a string, or a list of them) -> (ids, strings)."""
    if stop is None:
        return np.zeros(0, np.int64), []
    refuse_bytes(stop, "stop")
    if isinstance(stop, (str, int, np.integer)):
        items, names = [stop], ["stop"]
    elif isinstance(stop, Iterable) and not isinstance(stop, Mapping):
        items = list(stop)
        names = [f"stop[{j}]" for j in range(len(items))]
    else:
        raise GenerationError(f"stop: expected token ids and/or strings, got {brief_repr(stop)}")
    ids, strings = [], []
    for name, s in zip(names, items):
        refuse_bytes(s, name)
        if isinstance(s, str):
            if not s:
                raise GenerationError(f"{name}: empty stop string")
            if not has_tokenizer:
                raise GenerationError(f"stop string {brief_repr(s)} needs a tokenizer")
            strings.append(check_text(s, name))
        elif is_int(s):
            if not 0 <= int(s) < vocab_size:
                raise GenerationError(f"stop token id {brief_repr(int(s))} is outside the vocabulary [0, {vocab_size})")
            ids.append(int(s))
        else:
            raise GenerationError(f"stop: expected token ids or strings, got {brief_repr(s)}")
    return np.array(ids, np.int64), strings


__all__ = ["DEFAULT_STEPS_PER_CALL", "SamplingParams", "brief_repr", "check_max_new_tokens", "check_prompts",
           "check_real", "check_scalar_sampling", "check_seed", "check_steps_per_call", "check_stop",
           "check_temperature", "check_text", "check_top_k", "check_top_p", "fresh_seed", "is_int", "nth_seed",
           "refuse_bytes", "resolve_seed", "token_ids"]
