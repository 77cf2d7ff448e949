"""The server's engine loop (serve/http/engine_loop.py) without HTTP: a client that goes away
while an engine call runs, and a request whose answer fails to build, end their own
requests only; the loop goes on serving the others. A loop that dies tells its owner
(``srm-max serve`` then exits, so that a supervisor restarts it).

The TINY engine with a byte-level tokenizer; requests as the app builds them, their
news collected by a sink that sets an event once the request has ended.
"""

from __future__ import annotations

import threading
import time

import pytest

from srm_max import Generator
from srm_max.serve.http.engine_loop import EngineLoop
from srm_max.serve.http.sequence import ERROR, Delta, ServedRequest, ServedSample
from tests.support.graphs import graphs
from tests.support.tiny import TINY
from tests.support.tokenizers import byte_level_tokenizer

pytestmark = graphs(TINY)

PROMPT = [5, 17, 3, 44, 9]
WAIT = 120  # seconds: a bound on a few engine calls, never reached by a passing test


class Inbox:
    """A request's sink: its deltas, and an event set when it has ended (every sample's
    final delta, or an error)."""

    def __init__(self, samples: int):
        self.samples = samples
        self.deltas: list[Delta] = []
        self.ended = threading.Event()

    def __call__(self, deltas: list[Delta]) -> None:
        self.deltas += deltas
        if any(d.finish_reason == ERROR for d in deltas) or \
                sum(d.finish_reason is not None for d in self.deltas) == self.samples:
            self.ended.set()


def request(rid: str, stream: bool, n: int = 2, logprobs: int | None = 1, max_new: int = 12):
    inbox = Inbox(n)
    r = ServedRequest(rid, stream, [], inbox, logprobs=logprobs, echo=logprobs is not None)
    r.samples = [ServedSample(list(PROMPT), 0.8, 0, 1.0, 7 + i, max_new, request=r, index=i, logprobs=logprobs)
                 for i in range(n)]
    return r, inbox


@pytest.fixture
def loop(engine):
    loop = EngineLoop(Generator.from_engine(engine, tokenizer=byte_level_tokenizer()), max_batch=4, max_waiting=16,
                      steps_per_call=3)
    loop.start()
    yield loop
    loop.stop()


def served_after(loop: EngineLoop, stream: bool) -> None:
    """A request with log-probabilities after the fault is answered in full, and the loop lives."""
    r, inbox = request("after", stream)
    loop.submit(r)
    assert inbox.ended.wait(WAIT)
    assert all(d.finish_reason != ERROR for d in inbox.deltas) and r.done
    assert sum(len(d.ids) for d in inbox.deltas) == sum(len(s.tokens) for s in r.samples) > 0
    assert all(d.logprobs is not None for d in inbox.deltas if d.ids)
    assert loop.alive and loop.failure is None


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_during_an_engine_call_ends_only_its_request(loop, engine, monkeypatch, stream):
    # the first token from the prefill, three from the decode: the samples finish in the call their client leaves
    r, inbox = request("gone", stream, max_new=4)
    real_decode = type(engine).decode
    left = threading.Event()

    def decode_then_leave(self, *args, **kwargs):
        out = real_decode(self, *args, **kwargs)
        if not left.is_set():  # the first call's news reaches a request whose client has just left
            loop.cancel(r)
            left.set()
        return out

    monkeypatch.setattr(type(engine), "decode", decode_then_leave)
    loop.submit(r)
    assert left.wait(WAIT)
    monkeypatch.undo()
    served_after(loop, stream)
    assert r.cancelled and inbox.deltas == []  # nothing for a client that has gone


def test_an_answer_that_fails_to_build_ends_only_its_request(loop, monkeypatch):
    r, inbox = request("broken", stream=True)
    real_delta = ServedSample.delta

    def broken(self, *args, **kwargs):
        if self.request is r:
            raise KeyError("a bug")
        return real_delta(self, *args, **kwargs)

    monkeypatch.setattr(ServedSample, "delta", broken)
    loop.submit(r)
    assert inbox.ended.wait(WAIT)
    served_after(loop, stream=True)  # with the fault still there: it is that request's only
    monkeypatch.undo()
    # one error, whichever of its samples failed first, and nothing after it
    error = [d for d in inbox.deltas if d.finish_reason == ERROR]
    assert len(error) == 1 and "KeyError" in error[0].text and inbox.deltas[-1] is error[0]


def test_a_dead_loop_tells_its_owner(engine, monkeypatch):
    told = threading.Event()
    loop = EngineLoop(Generator.from_engine(engine, tokenizer=byte_level_tokenizer()), max_batch=4, max_waiting=16,
                      on_failure=lambda e: told.set())

    def dies(*args, **kwargs):
        raise RuntimeError("the loop's own fault")

    monkeypatch.setattr(loop, "_report", dies)
    r, inbox = request("first", stream=False, logprobs=None)
    loop.start()
    loop.submit(r)
    assert told.wait(WAIT) and inbox.ended.wait(WAIT)
    assert isinstance(loop.failure, RuntimeError) and not loop.alive
    assert [d.finish_reason for d in inbox.deltas] == [ERROR]


def test_clients_that_leave_the_queue_during_an_engine_call_free_it_at_once(loop, engine):
    """With the loop blocked in an engine call, requests that come and go keep getting places
    (each leaves its own at once), and what they leave behind in the queue stays bounded."""
    first, inbox = request("first", stream=False, logprobs=None, max_new=3)
    with engine._lock:  # the engine runs every call under it: the loop blocks at its next one
        loop.submit(first)
        limit = time.monotonic() + WAIT
        while not first.started:  # in its slots: the loop is in (or at) its prefill
            assert time.monotonic() < limit
            time.sleep(0.001)
        for i in range(500):
            r, _ = request(f"gone{i}", stream=i % 2 == 0, n=loop.max_waiting // 2)
            loop.submit(r)  # never QueueFull: the ones before it have left
            loop.cancel(r)
        assert loop.snapshot()["waiting_samples"] == 0 and len(loop._waiting) <= 2 * loop.max_waiting + 64
        assert list(loop._live) == ["first"]
    assert inbox.ended.wait(WAIT) and all(d.finish_reason == "length" for d in inbox.deltas)
    served_after(loop, stream=False)


def test_a_scrape_reads_the_loops_gauges_from_one_snapshot():
    """The gauges of one /metrics answer come from one snapshot of the loop, so they agree
    (busy slots and occupancy, running and waiting) however the loop moves meanwhile."""
    from srm_max.serve.http.metrics import Metrics

    metrics, states = Metrics(), iter([{"running": 3, "waiting": 1, "waiting_samples": 2, "slots": 8, "busy": 6},
                                       {"running": 0, "waiting": 0, "waiting_samples": 0, "slots": 8, "busy": 0}])
    metrics.watch(lambda: next(states))
    lines = dict(line.rsplit(" ", 1) for line in metrics.render().decode().splitlines() if line.startswith("srm_")
                 and "{" not in line)
    assert {k: float(lines[k]) for k in ("srm_running_requests", "srm_waiting_requests", "srm_waiting_samples",
                                         "srm_slots", "srm_slots_busy", "srm_slot_occupancy")} == {
        "srm_running_requests": 3, "srm_waiting_requests": 1, "srm_waiting_samples": 2, "srm_slots": 8,
        "srm_slots_busy": 6, "srm_slot_occupancy": 0.75}
