"""Continuous batching: one thread owns the engine and runs every admitted sample.

The loop keeps the running samples as the rows of one batch (at most
``max_batch``): their recurrent states [L, rows, H, hd] on the device, their
next ids, positions and sampling parameters. Each turn it

1. drops the rows of finished or cancelled samples,
2. moves waiting samples into the free rows, prefilling their prompts together
   in one call (a sample's state is then copied into the batch),
3. runs one decode call of a few steps for the whole batch,
4. hands each request the tokens and text of its samples (``Work.sink``).

So a request joins at the next turn, never waiting for the batch to drain, and a
finished or disconnected sample's row is reused at the next turn. A sample's
tokens depend only on its prompt, parameters, seed and positions (the sampler's
random counter), never on its batch mates or on the steps per call, so the
batching does not change what anyone gets.

Admission is bounded: ``submit`` refuses a request whose samples do not fit in
the waiting queue (``QueueFull``; the app answers 429 with Retry-After).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np

from ..engine import SamplingArrays
from .metrics import Metrics
from .sequence import CANCELLED, ERROR, Delta, Sample, Work

log = logging.getLogger("srm_max.server")
_TYPICAL_STEPS = 64  # the length of a completion, for Retry-After only


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the waiting queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class SchedulerStopped(Exception):
    pass


class Scheduler:
    def __init__(self, generator, max_batch: int, max_waiting: int, steps_per_call: int = 4,
                 metrics: Metrics | None = None):
        if max_batch < 1 or max_waiting < 1 or steps_per_call < 1:
            raise ValueError("max_batch, max_waiting and steps_per_call must be >= 1")
        self.generator = generator
        self.engine = generator.engine
        self.n_ctx = generator.config.context_length
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.steps_per_call = steps_per_call
        self.metrics = metrics or Metrics()
        self.metrics.watch(self.snapshot)
        self._cv = threading.Condition()
        self._waiting: deque[Sample] = deque()  # guarded by _cv
        self._live: dict[str, Work] = {}  # admitted and not done; guarded by _cv
        self._busy = 0  # rows in the batch (read by snapshot)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the loop, if it died
        # the batch: engine thread only
        self._rows: list[Sample] = []
        self._states = None
        self._ids = np.zeros(0, np.int64)
        self._positions = np.zeros(0, np.int64)
        self._sampling = None
        self._device_inputs = None  # (ids, positions) buffers from the last decode, while rows stay put
        self._seconds_per_token = 0.05  # a running estimate, for Retry-After

    # ------------------------------------------------------------ the HTTP side
    def submit(self, request: Work) -> None:
        with self._cv:
            if self._stopping or not self.alive:
                raise SchedulerStopped("the engine loop is not running")
            if len(self._waiting) + len(request.samples) > self.max_waiting:
                raise QueueFull(self._retry_after())
            self._live[request.id] = request
            self._waiting.extend(request.samples)
            self._cv.notify()

    def cancel(self, request: Work) -> None:
        """The client went away: its samples leave their rows at the loop's next turn."""
        if request.done or request.cancelled:
            return
        request.cancelled = True
        self.metrics.disconnects.inc()
        with self._cv:
            self._cv.notify()

    def snapshot(self) -> dict:
        with self._cv:
            running = sum(1 for r in self._live.values() if r.started)
            return {"running": running, "waiting": len(self._live) - running,
                    "waiting_samples": len(self._waiting), "slots": self.max_batch, "busy": self._busy}

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _retry_after(self) -> int:
        # a guess: the batches queued ahead, each about _TYPICAL_STEPS steps at the measured step time
        ahead = len(self._waiting) / max(1, self.max_batch)
        return int(min(60, max(1, round(ahead * _TYPICAL_STEPS * self._seconds_per_token))))

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._loop, name="srm-max-engine-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as e:  # noqa: BLE001  (a dead loop must not leave clients hanging)
            self.failure = e
            log.exception("engine loop failed")
        finally:
            self._fail_all("the server is shutting down" if self.failure is None else
                           f"the engine failed: {self.failure}")

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self._stopping = True
            requests = list(self._live.values())
            self._live.clear()
            self._waiting.clear()
            self._busy = 0
        for r in requests:
            r.sink([Delta(-1, message, [], ERROR)])

    # ------------------------------------------------------------ one turn
    def _turn(self) -> bool:
        """Admit, prefill, decode once, deliver. False when the loop should end."""
        with self._cv:
            while True:
                self._drop_cancelled_waiting()
                if self._stopping:
                    return False
                if self._rows or self._waiting:
                    break
                self._cv.wait()
            starting = []
            while self._waiting and len(self._rows) + len(starting) < self.max_batch:
                starting.append(self._waiting.popleft())
        kept = []
        for s in self._rows:
            if s.reason is None and s.request.cancelled:
                self._finish(s, CANCELLED)
            if s.reason is None:
                kept.append(s)
        try:
            if starting or len(kept) != len(self._rows):
                self._rebuild(kept, starting)
            if self._rows:
                self._decode()
        except Exception as e:  # noqa: BLE001  (an engine failure ends this batch, not the server)
            log.exception("engine call failed")
            self._fail_batch(kept + starting, f"the engine failed: {e}")
        self._retire_requests()
        return True

    def _fail_batch(self, samples: list[Sample], message: str) -> None:
        requests = {id(s.request): s.request for s in samples}
        for r in requests.values():
            for s in r.samples:
                if s.reason is None:
                    self._finish(s, ERROR)
            r.sink([Delta(-1, message, [], ERROR)])
        with self._cv:  # their samples still waiting go too
            self._waiting = deque(s for s in self._waiting if s.reason is None)
        self._rows, self._states, self._sampling, self._device_inputs = [], None, None, None
        self._ids = self._positions = np.zeros(0, np.int64)
        with self._cv:
            self._busy = 0

    def _drop_cancelled_waiting(self) -> None:
        if any(s.request.cancelled for s in self._waiting):
            keep = deque()
            for s in self._waiting:
                if s.request.cancelled:
                    self._finish(s, CANCELLED)
                else:
                    keep.append(s)
            self._waiting = keep
            self._retire_requests()

    def _rebuild(self, kept: list[Sample], starting: list[Sample]) -> None:
        """The batch of the ``kept`` rows plus the ``starting`` samples, those prefilled."""
        eng = self.engine
        old_index = {id(s): i for i, s in enumerate(self._rows)}
        keep_rows = [old_index[id(s)] for s in kept]
        for s in starting:
            s.request.started = True
        for s in starting:
            if s.request.cancelled:
                self._finish(s, CANCELLED)
        todo = [s for s in starting if s.reason is None and not s.finish_without_running(self.n_ctx)]
        self._deliver([s for s in starting if s.reason is not None], {}, 0.0)
        host = [eng.host(self._states)[:, keep_rows]] if kept else []
        ids, positions = [self._ids[keep_rows]], [self._positions[keep_rows]]
        rows = list(kept)
        if todo:
            t0 = time.perf_counter()
            pre = eng.prefill([s.prompt for s in todo], _sampling_of(todo))
            elapsed = time.perf_counter() - t0
            self.metrics.engine_calls.labels("prefill").inc()
            self.metrics.prompt_tokens.inc(sum(len(s.prompt) for s in todo))
            for s, token in zip(todo, pre.next_ids.tolist()):
                s.accept(int(token), self.generator.decode, self.n_ctx)
            self._deliver(todo, {id(s): 1 for s in todo}, elapsed)
            # a sample done at its first token takes no row
            go_on = [i for i, s in enumerate(todo) if s.reason is None]
            host.append(eng.host(pre.states)[:, go_on])
            ids.append(np.asarray(pre.next_ids, np.int64)[go_on])
            positions.append(np.array([len(todo[i].prompt) for i in go_on], np.int64))
            rows += [todo[i] for i in go_on]
        self._rows = rows
        with self._cv:
            self._busy = len(rows)
        self._device_inputs = None
        if not rows:
            self._states, self._sampling = None, None
            self._ids = self._positions = np.zeros(0, np.int64)
            return
        self._states = eng._dev(np.ascontiguousarray(np.concatenate(host, axis=1)))
        self._ids = np.concatenate(ids)
        self._positions = np.concatenate(positions)
        self._sampling = eng.sampling_buffers(_sampling_of(rows))

    def _decode(self) -> None:
        eng, rows = self.engine, self._rows
        budgets = [s.budget(self.n_ctx) for s in rows]
        with self._cv:
            pending = bool(self._waiting)
        # with samples waiting, end the call when the first row frees up; else run the full
        # steps (past a sample's end its tokens are dropped, and positions clamp in-graph)
        S = max(1, min(self.steps_per_call, min(budgets) if pending else max(budgets)))
        ids, positions = self._device_inputs or (self._ids, self._positions)
        t0 = time.perf_counter()
        res = eng.decode(ids, positions, self._states, self._sampling, S)
        elapsed = time.perf_counter() - t0
        self.metrics.engine_calls.labels("decode").inc()
        self._states = res.states
        self._device_inputs = (res.ids, res.positions)
        self._ids = res.tokens[:, -1].copy()
        self._positions = self._positions + S
        new = {}
        for s, row in zip(rows, res.tokens.tolist()):
            before = len(s.tokens)
            for token in row:
                if s.reason is not None:
                    break
                s.accept(token, self.generator.decode, self.n_ctx)
            new[id(s)] = len(s.tokens) - before
        self._seconds_per_token = 0.9 * self._seconds_per_token + 0.1 * elapsed / S
        self._deliver(rows, new, elapsed)

    def _deliver(self, samples: list[Sample], new: dict[int, int], elapsed: float) -> None:
        """Send each request the news of its ``samples`` (one sink call per request);
        ``new``: the tokens each took in the engine call that took ``elapsed`` seconds."""
        now = time.perf_counter()
        by_request: dict[str, tuple[Work, list[Delta]]] = {}
        for s in samples:
            r, k = s.request, new.get(id(s), 0)
            if k:
                self.metrics.generated_tokens.inc(k)
                if r.first_token is None:
                    r.first_token = now
                    self.metrics.ttft.observe(now - r.submitted)
                elif s.last_delivery is not None:
                    self.metrics.itl.observe((now - s.last_delivery) / k)
                s.last_delivery = now
            delta = s.delta(self.generator.decode)
            if s.reason is not None:
                self._finish(s, s.reason)
            if delta is not None:
                by_request.setdefault(r.id, (r, []))[1].append(delta)
        for r, deltas in by_request.values():
            r.sink(deltas)
        self._retire_requests()

    def _finish(self, s: Sample, reason: str) -> None:
        """Count a finished sample once."""
        if s.counted:
            return
        s.counted = True
        s.reason = reason
        self.metrics.samples_finished.labels(reason).inc()

    def _retire_requests(self) -> None:
        with self._cv:
            for rid in [rid for rid, r in self._live.items() if r.done]:
                del self._live[rid]


def _sampling_of(samples: list[Sample]) -> SamplingArrays:
    return SamplingArrays(np.array([s.temperature for s in samples], np.float32),
                          np.array([s.top_k for s in samples], np.int64),
                          np.array([s.top_p for s in samples], np.float32),
                          np.array([s.seed for s in samples], np.uint64))
