"""Continuous batching: one thread owns the engine and runs every admitted sample.

The thread runs the package's one scheduler (``serve.scheduler.SlotPool``, at most
``max_batch`` slots) turn after turn: each turn it moves waiting samples into the
free slots, drops cancelled ones, runs one decode call of a few steps and hands
each request the tokens and text of its samples (``ServedRequest.sink``). So a request
joins at the next turn, never waiting for the batch to drain, and a finished or
disconnected sample's slot is reused at the next turn; the batching does not
change what anyone gets (see the scheduler). After a round of ``sink`` calls the
loop calls ``flush``: a sink may hold its news until then (the app's wakes its
event loop once per turn).

Admission is bounded: ``submit`` refuses a request whose samples do not fit in
the waiting queue (``QueueFull``; the app answers 429 with Retry-After).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from ..sampling import DEFAULT_STEPS_PER_CALL
from ..scheduler import SlotPool
from .logprobs import RequestScoring
from .metrics import Metrics
from .sequence import CANCELLED, ERROR, Delta, ServedRequest, ServedSample

log = logging.getLogger("srm_max.serve.http")
_TYPICAL_STEPS = 64  # the length of a completion, for Retry-After only


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the waiting queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class EngineLoopStopped(Exception):
    pass


class EngineLoop:
    def __init__(self, generator, max_batch: int, max_waiting: int, steps_per_call: int = DEFAULT_STEPS_PER_CALL,
                 metrics: Metrics | None = None, flush: Callable[[], None] = lambda: None,
                 on_failure: Callable[[BaseException], None] | None = None):
        if max_batch < 1 or max_waiting < 1 or steps_per_call < 1:
            raise ValueError("max_batch, max_waiting and steps_per_call must be >= 1")
        self.generator = generator
        self.engine = generator.engine
        self.n_ctx = generator.config.context_length
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.steps_per_call = steps_per_call
        self.metrics = metrics or Metrics()
        self.flush = flush
        self.metrics.watch(self.snapshot)
        self._cv = threading.Condition()
        # samples not yet in a slot, in order; those of a request that has ended (its client gone)
        # stay until popped or compacted away, so a disconnect costs its own samples, not the queue's
        self._waiting: deque[ServedSample] = deque()  # guarded by _cv
        self._queued = 0  # the unfinished samples in _waiting: what admission counts; guarded by _cv
        self._live: dict[str, ServedRequest] = {}  # admitted and not done; guarded by _cv
        self._busy = 0  # running samples (read by snapshot)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the loop, if it died
        self.on_failure = on_failure  # told once the loop has died (after its requests have failed)
        # the batch: engine thread only
        self._pool = SlotPool(self.engine, generator.decode, max_batch, steps_per_call,
                              prefix_cache=generator.prefix_cache)
        self.metrics.watch_prefix_cache(self._pool.prefix_cache)
        self._scoring = RequestScoring(self.engine, generator.decode)  # logprobs / echo
        self._seconds_per_token = 0.05  # a running estimate, for Retry-After

    # ------------------------------------------------------------ the HTTP side
    def submit(self, request: ServedRequest) -> None:
        with self._cv:
            if self._stopping or not self.alive:
                raise EngineLoopStopped("the engine loop is not running")
            if self._queued + len(request.samples) > self.max_waiting:
                raise QueueFull(self._retry_after())
            self._live[request.id] = request
            self._waiting.extend(request.samples)
            self._queued += len(request.samples)
            self._cv.notify()

    def cancel(self, request: ServedRequest) -> None:
        """The client went away: its waiting samples leave the queue at once (not after the engine
        call under way, which may be a long prefill: a request arriving meanwhile is admitted, not
        refused 429), its running ones their rows at the loop's next turn."""
        if request.done or request.cancelled:
            return
        request.cancelled = True
        self.metrics.disconnects.inc()
        with self._cv:
            self._drop_waiting(request)
            self._cv.notify()

    def snapshot(self) -> dict:
        with self._cv:
            running = sum(1 for r in self._live.values() if r.started)
            return {"running": running, "waiting": len(self._live) - running,
                    "waiting_samples": self._queued, "slots": self.max_batch, "busy": self._busy}

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _retry_after(self) -> int:
        # a guess: the batches queued ahead, each about _TYPICAL_STEPS steps at the measured step time
        ahead = self._queued / max(1, self.max_batch)
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
            if self.failure is not None and self.on_failure is not None:
                self.on_failure(self.failure)

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self._stopping = True
            requests = list(self._live.values())
            self._live.clear()
            self._waiting.clear()
            self._queued = 0
            self._busy = 0
        for r in requests:
            r.sink([Delta(-1, message, [], ERROR)])
        self.flush()

    # ------------------------------------------------------------ one turn
    def _turn(self) -> bool:
        """Admit, prefill, decode once, deliver. False when the loop should end."""
        pool = self._pool
        with self._cv:
            while True:
                if self._stopping:
                    return False
                if self._queued or not pool.idle:
                    break
                self._waiting.clear()  # nothing in it is unfinished
                self._cv.wait()
            free = pool.free_slots - len(pool.pending)
            while self._waiting and free > 0:
                s = self._waiting.popleft()
                if s.reason is not None:  # its request has ended
                    continue
                free -= 1
                s.admitted = True
                self._queued -= 1
                s.request.started = True
                pool.submit([s])
        try:
            turn = pool.turn()
        except Exception as e:  # noqa: BLE001  (an engine failure ends this batch, not the server)
            log.exception("engine call failed")
            self._fail_batch([*pool.live, *pool.pending], f"the engine failed: {e}")
            return True
        with self._cv:
            self._busy = len(pool.live)
        self._report(turn)
        return True

    def _report(self, turn) -> None:
        """Metrics and news of one turn: the prefill's first tokens, then the decode's."""
        if turn.prompt_tokens:
            self.metrics.engine_calls.labels("prefill").inc()
            self.metrics.prompt_tokens.inc(turn.prompt_tokens)
            self.metrics.prompts_prefilled.inc(turn.prompts_prefilled)
            self.metrics.prefix_cache_hits.inc(turn.cache_hits)
            self.metrics.prefix_cache_tokens_saved.inc(turn.cached_tokens)
        if turn.steps:
            self.metrics.engine_calls.labels("decode").inc()
            self._seconds_per_token = 0.9 * self._seconds_per_token + 0.1 * turn.decode_seconds / turn.steps
        touched: dict[ServedSample, object] = {}  # the samples with news, in order
        for tick in turn.ticks:
            touched.update(tick)
        touched.update(dict.fromkeys(turn.finished))
        scored = [s for s in touched if s.request.logprobs is not None]
        if scored:
            try:
                self._scoring.update(list(touched))  # what their deltas carry: one scoring batch per turn
            except Exception as e:  # noqa: BLE001  (it fails the requests that asked for it, not the server)
                log.exception("scoring failed")
                for r in {id(s.request): s.request for s in scored}.values():
                    self._fail_request(r, f"scoring failed: {e}")
        self._deliver(list(touched))

    def _fail_batch(self, samples: list[ServedSample], message: str) -> None:
        requests = {id(s.request): s.request for s in samples}
        for r in requests.values():
            self._fail_request(r, message)
        self.flush()
        with self._cv:  # their samples still waiting went with them (_fail_request)
            self._compact()
            self._busy = 0
        self._retire(requests.values())
        self._pool.pending.clear()
        self._pool.reset()
        self._scoring = RequestScoring(self.engine, self.generator.decode)

    def _fail_request(self, r: ServedRequest, message: str) -> None:
        """End one request with an error: its samples leave their slots and the queue at the
        next turn (as a client's that went away) and send nothing more. A request ends once:
        one that already ended (an earlier error, or its client gone) is sent no error."""
        for s in r.samples:
            self._finish(s, ERROR if s.reason is None else s.reason)
        if not r.cancelled:
            r.cancelled = True
            r.sink([Delta(-1, message, [], ERROR)])

    def _drop_waiting(self, request: ServedRequest) -> None:
        """The waiting samples of ``request``, whose client went away, leave the queue (under _cv):
        finished here, skipped when popped; a request with no sample left is forgotten."""
        for s in request.samples:
            if not s.admitted:
                self._finish(s, CANCELLED)
        if request.done:
            self._live.pop(request.id, None)
        self._compact()

    def _compact(self) -> None:
        """Drop the finished samples from the queue once they outnumber the others (under _cv):
        clients that come and go while an engine call runs cannot grow it without bound."""
        if len(self._waiting) > 2 * self._queued + 64:
            self._waiting = deque(s for s in self._waiting if s.reason is None)

    def _deliver(self, samples: list[ServedSample]) -> None:
        """Send each request the news of its ``samples`` (one sink call per request), then flush."""
        now = time.perf_counter()
        by_request: dict[str, tuple[ServedRequest, list[Delta]]] = {}
        ended: list[ServedRequest] = []
        generated = 0
        for s in samples:
            r, k = s.request, len(s.tokens) - s.counted_tokens
            if k:
                generated += k
                s.counted_tokens = len(s.tokens)
                if r.first_token is None:
                    r.first_token = now
                    self.metrics.ttft.observe(now - r.submitted)
                elif s.last_delivery is not None:
                    self.metrics.itl.observe((now - s.last_delivery) / k)
                s.last_delivery = now
            try:
                delta = s.delta(self.generator.decode, self._scoring)
            except Exception as e:  # noqa: BLE001  (one request's answer, not the server)
                log.exception("delivery failed")
                self._fail_request(r, f"internal error: {type(e).__name__}: {e}")
                ended.append(r)
                continue
            if s.reason is not None:
                self._finish(s, s.reason)
                ended.append(r)
            if delta is not None:
                by_request.setdefault(r.id, (r, []))[1].append(delta)
        self.metrics.generated_tokens.inc(generated)
        for r, deltas in by_request.values():
            if not r.cancelled:  # nothing after a request's error, nor to a client that has gone
                r.sink(deltas)
        self.flush()
        self._retire(ended)

    def _finish(self, s: ServedSample, reason: str) -> None:
        """Count a finished sample once; one still waiting leaves the queue's count. Under the lock:
        ``cancel`` (an HTTP thread) and the engine thread may end the same request at once."""
        with self._cv:
            if s.counted:
                return
            s.counted = True
            s.reason = reason
            if not s.admitted:
                self._queued -= 1
        self.metrics.samples_finished.labels(reason).inc()

    def _retire(self, requests: Iterable[ServedRequest]) -> None:
        """Forget the requests among ``requests`` that are done."""
        with self._cv:
            for r in requests:
                if r.done:
                    self._live.pop(r.id, None)
