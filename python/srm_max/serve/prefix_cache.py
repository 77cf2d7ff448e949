"""The prefix-state cache: a prompt that begins with a seen prefix starts from its state.

A recurrent model's state after a prefix is small (the SRM's: one ``[d]`` vector per
layer) and is all that the rest of the prompt needs, so a prompt ``P`` whose first
``k`` tokens were seen before prefills only ``P[k:]``, from the state after them, at
positions ``k..``: the same computation in a different grouping (see docs/prefix_cache.md
for the tolerance). ``SlotPool`` (the one scheduler) keeps its states here.

Key: a prefix is found by its length and a rolling hash of its tokens (every prefix
hash of a prompt in one pass), then confirmed by comparing the stored tokens, so a
hash collision costs a comparison, never a wrong state.

Entries: the state after a prompt's last token, and the states at the points inside a
prompt where a later prompt is likely to leave it (``split_points``): where the prompt
stops agreeing with a recent prompt or with a batch mate (a shared system prompt or
few-shot prefix), and the last multiple of ``interval`` tokens before its end (so a
long shared prefix is found again, to within ``interval`` tokens, after the recent
prompts have moved on). A state inside a
prompt exists only if the prefill stops there, so the scheduler prefills a prompt in
pieces ending at these points.

``prefill_cached`` is an engine's prefill through the cache (the scheduler's, and any
other caller's that prefills prompts).

Eviction: least recently used first, within ``budget_bytes`` (the states' and the
stored tokens' array bytes); 0 turns the cache off. Thread-safe: one cache may serve
several pools (``Generator`` calls from several threads, the server's engine loop).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import GenerationError
from ..scalars import is_int, is_real
from .sampling import brief_repr

DEFAULT_BUDGET_MB = 64
DEFAULT_INTERVAL = 256
# a shared prefix shorter than this is not worth an extra prefill call to keep its state
DEFAULT_MIN_SHARED = 32
DEFAULT_RECENT = 32

_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_BASE_INV = pow(_BASE, -1, 1 << 64)


def prefix_hashes(tokens) -> np.ndarray:
    """[n + 1] uint64: entry k is the hash of ``tokens[:k]``, sum_i (t_i + 1) B^(k-1-i)
    modulo 2**64 (entry 0 is 0).

    All n at once: h_k = B^(k-1) * sum_{i<k} (t_i + 1) B^-i, a cumulative sum of the
    tokens scaled by powers of B's inverse, with numpy's wrapping uint64 arithmetic
    standing for the arithmetic modulo 2**64."""
    t = np.asarray(tokens, np.uint64) + np.uint64(1)
    n = len(t)
    out = np.zeros(n + 1, np.uint64)
    if n:
        with np.errstate(over="ignore"):
            inv = np.cumprod(np.full(n, _BASE_INV, np.uint64))  # B^-1 .. B^-n
            pows = np.cumprod(np.full(n, _BASE, np.uint64))  # B^1 .. B^n
            sums = np.cumsum(t * inv)  # sum_{i<k} t_i B^-(i+1)
            out[1:] = sums * pows  # B^k * that = sum t_i B^(k-1-i)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


@dataclass(eq=False)
class Entry:
    tokens: np.ndarray  # int32 [k]: the prefix
    state: np.ndarray  # one sample's state after it (host)
    key: tuple[int, int]  # (k, hash)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.state.nbytes


@dataclass
class Hit:
    length: int  # tokens of the prompt the state covers
    state: np.ndarray


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    tokens_saved: int = 0  # prompt tokens not prefilled thanks to a hit
    inserts: int = 0
    evictions: int = 0


class PrefixCache:
    """States after token prefixes (see the module docs)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_MB << 20, interval: int = DEFAULT_INTERVAL,
                 min_shared: int = DEFAULT_MIN_SHARED, recent: int = DEFAULT_RECENT, hash_mask: int = (1 << 64) - 1):
        """``hash_mask``: the hash bits kept (tests narrow it to make prefixes collide)."""
        if budget_bytes < 0 or interval < 1 or min_shared < 1 or recent < 0:
            raise ValueError("budget_bytes >= 0, interval >= 1, min_shared >= 1 and recent >= 0 are required")
        self.budget_bytes = int(budget_bytes)
        self.interval = interval
        self.min_shared = min_shared
        self.hash_mask = np.uint64(hash_mask)
        self.stats = CacheStats()
        self.bytes = 0
        self._index: dict[tuple[int, int], list[Entry]] = {}  # (length, hash) -> entries (collisions)
        self._lru: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, least recent first
        self._lengths: dict[int, int] = {}  # prefix length -> entries of that length
        self._recent: deque[np.ndarray] = deque(maxlen=recent)  # the last prompts seen, for split points
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self, tokens) -> np.ndarray:
        return prefix_hashes(tokens) & self.hash_mask

    # ------------------------------------------------------------ lookups
    def lookup(self, prompt: Sequence[int], hashes: np.ndarray | None = None) -> Hit | None:
        """The longest cached prefix of ``prompt`` that leaves at least one token to prefill
        (the prompt's last logits come from its prefill), or None; a hit becomes the most
        recently used entry."""
        if not self.enabled or len(prompt) < 2:
            return None
        with self._lock:
            self.stats.lookups += 1
            entry = self._find(np.asarray(prompt, np.int32), hashes)
            if entry is None:
                return None
            self._lru.move_to_end(id(entry))
            self.stats.hits += 1
            self.stats.tokens_saved += len(entry.tokens)
            return Hit(len(entry.tokens), entry.state)

    def _find(self, prompt: np.ndarray, hashes: np.ndarray | None) -> Entry | None:
        if not self._lengths:
            return None
        if hashes is None:
            hashes = self.hashes(prompt)
        for k in sorted((k for k in self._lengths if k < len(prompt)), reverse=True):
            for entry in self._index.get((k, int(hashes[k])), ()):
                if np.array_equal(entry.tokens, prompt[:k]):
                    return entry
        return None

    def split_points(self, prompt: Sequence[int], start: int, others: Sequence[Sequence[int]] = ()) -> list[int]:
        """Where a prefill of ``prompt`` from ``start`` should stop to keep states, in order:
        the end of the longest prefix it shares with a recent prompt, the ends of the
        prefixes it shares with each of ``others`` (the scheduler passes its neighbours in
        sorted order among its batch mates), the last multiple of ``interval`` before its
        end, and when it is a recent prompt's prefix (seen again), the point before its last
        token. Each lies strictly inside (start, len); a shared end is kept only at least
        ``min_shared`` tokens past ``start`` and past the shared end before it, since each
        point costs a prefill call."""
        if not self.enabled:
            return []
        p = np.asarray(prompt, np.int32)
        n = len(p)
        with self._lock:
            recent = list(self._recent)
        seen = max((common_prefix(p, r) for r in recent), default=0)
        shared = {common_prefix(p, np.asarray(o, np.int32)) for o in others} | {seen}
        points, last = set(), start
        for k in sorted(shared):
            if k >= last + self.min_shared and k < n:
                points.add(k)
                last = k
        checkpoint = (n - 1) // self.interval * self.interval
        if checkpoint > start:
            points.add(checkpoint)
        if seen == n and n - 1 > start:
            # a prompt seen before comes again: keep the state before its last token, the
            # longest prefix a lookup of it can use
            points.add(n - 1)
        return sorted(points)

    # ------------------------------------------------------------ inserts
    def remember(self, prompt: Sequence[int]) -> None:
        """Keep ``prompt`` among the recent ones that ``split_points`` compares with."""
        if self.enabled and self._recent.maxlen:
            with self._lock:
                self._recent.append(np.asarray(prompt, np.int32))

    def insert(self, tokens: Sequence[int], state: np.ndarray, hashes: np.ndarray | None = None) -> bool:
        """Keep ``state``, the state after ``tokens``; -> whether it is kept (not when the
        cache is off or the entry alone exceeds the budget). An entry already there is
        only marked as recently used."""
        if not self.enabled or len(tokens) == 0:
            return False
        toks = np.array(tokens, np.int32)
        h = int((hashes if hashes is not None else self.hashes(toks))[len(toks)])
        with self._lock:
            key = (len(toks), h)
            for entry in self._index.get(key, ()):
                if np.array_equal(entry.tokens, toks):
                    self._lru.move_to_end(id(entry))
                    return True
            entry = Entry(toks, np.array(state, copy=True), key)
            if entry.nbytes > self.budget_bytes:
                return False
            while self.bytes + entry.nbytes > self.budget_bytes:
                self._evict()
            self._index.setdefault(key, []).append(entry)
            self._lru[id(entry)] = entry
            self._lengths[key[0]] = self._lengths.get(key[0], 0) + 1
            self.bytes += entry.nbytes
            self.stats.inserts += 1
            return True

    def _evict(self) -> None:
        _, entry = self._lru.popitem(last=False)
        bucket = self._index[entry.key]
        bucket.remove(entry)
        if not bucket:
            del self._index[entry.key]
        k = entry.key[0]
        self._lengths[k] -= 1
        if not self._lengths[k]:
            del self._lengths[k]
        self.bytes -= entry.nbytes
        self.stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            while self._lru:
                self._evict()
            self._recent.clear()


# ------------------------------------------------------------ prefilling through the cache
def usable_cache(engine, cache: PrefixCache | None) -> PrefixCache | None:
    """``cache`` if it is on and ``engine`` can prefill from a state, else None."""
    usable = cache is not None and cache.enabled and getattr(engine, "supports_start_state", False)
    return cache if usable else None


def prefill_cached(engine, cache: PrefixCache, prompts: list[list[int]], sampling=None, **asked):
    """``engine.prefill(prompts, sampling, **asked)`` through ``cache`` (one that ``usable_cache``
    passed): -> the same PrefillResult (up to the order of the scan's sums) and, per
    prompt, the tokens taken from the cache. Each prompt starts from its longest cached
    prefix; first the pieces up to its split points run (a piece shared by several
    prompts once), their end states kept in the cache, then every prompt's last piece;
    the state after each whole prompt is kept too."""
    hashes = [cache.hashes(p) for p in prompts]
    hits = [cache.lookup(p, h) for p, h in zip(prompts, hashes)]
    start = [h.length if h else 0 for h in hits]
    state = [h.state if h else None for h in hits]
    cached = list(start)
    near = _neighbours(prompts)
    cuts = [cache.split_points(p, start[i], near[i]) for i, p in enumerate(prompts)]
    while any(cuts):
        todo = [(i, c.pop(0)) for i, c in enumerate(cuts) if c]
        row = {}  # a piece's prefix -> its row: prompts that share it up to the cut run it once
        for i, cut in todo:
            row.setdefault(tuple(prompts[i][:cut]), (i, cut))
        runs = list(row.values())
        pre = _prefill_from(engine, [prompts[i][start[i]:cut] for i, cut in runs], None,
                            [state[i] for i, _ in runs], [start[i] for i, _ in runs])
        ends = engine.host(pre.states)
        index = {key: r for r, key in enumerate(row)}
        for i, cut in todo:
            state[i] = ends[:, index[tuple(prompts[i][:cut])]].copy()
            start[i] = cut
            cache.insert(prompts[i][:cut], state[i], hashes[i])
    pre = _prefill_from(engine, [p[s:] for p, s in zip(prompts, start)], sampling, state, start, **asked)
    ends = engine.host(pre.states)
    for i, p in enumerate(prompts):
        cache.insert(p, ends[:, i], hashes[i])
        cache.remember(p)
    return pre, cached


def _prefill_from(engine, pieces: list[list[int]], sampling, states: list, starts: list[int], **asked):
    """Prefill ``pieces``, each from its host state (None: a fresh one) at its start."""
    if all(s is None for s in states):
        return engine.prefill(pieces, sampling, **asked)
    like = next(s for s in states if s is not None)
    stacked = np.stack([np.zeros_like(like) if s is None else s for s in states], axis=1)
    return engine.prefill(pieces, sampling, start_states=engine.to_device(stacked),
                          start_positions=np.asarray(starts, np.int64), **asked)


def _neighbours(prompts: list[list[int]]) -> list[list[list[int]]]:
    """Each prompt's neighbours in sorted order: the batch mates it shares the longest
    prefixes with (those that share a prefix with it sort next to it)."""
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    near: list[list[list[int]]] = [[] for _ in prompts]
    for a, b in zip(order, order[1:]):
        near[a].append(prompts[b])
        near[b].append(prompts[a])
    return near


def cache_of(prefix_cache_mb: float | None) -> PrefixCache:
    """The cache for a ``prefix_cache_mb`` option: None = the default budget, 0 = off."""
    mb = DEFAULT_BUDGET_MB if prefix_cache_mb is None else prefix_cache_mb
    # an int of any size is a budget in bytes; a float must be finite to be one
    if not is_real(mb) or not (is_int(mb) or math.isfinite(mb)) or not mb >= 0:
        raise GenerationError(
            f"prefix_cache_mb must be a finite number >= 0 (0 turns the cache off), got {brief_repr(mb)}")
    return PrefixCache(int(mb * (1 << 20)))


__all__ = ["CacheStats", "DEFAULT_BUDGET_MB", "DEFAULT_INTERVAL", "Hit", "PrefixCache", "cache_of",
           "common_prefix", "prefill_cached", "prefix_hashes", "usable_cache"]
