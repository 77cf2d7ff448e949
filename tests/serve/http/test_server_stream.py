"""The server's streaming path without a model: chunk bytes, the mailbox, the SSE response.

A streamed completion's chunks are put together from bytes made once per request
(``Answer.chunk_json``); they must be exactly the compact JSON of ``Answer.chunk``.
The ``Mailbox`` wakes the event loop once per flush; ``EventStream`` writes one
message per item, a keep-alive comment when quiet, and notices a disconnect.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("starlette")

from srm_max.serve.http.protocol import Answer, CheckedRequest, dumps  # noqa: E402
from srm_max.serve.http.sequence import Delta  # noqa: E402
from srm_max.serve.http.stream import PING, EventStream, Mailbox, event  # noqa: E402


def job(chat: bool = False) -> CheckedRequest:
    return CheckedRequest(prompts=[[1, 2]], n=2, max_new=8, temperature=1.0, top_k=0, top_p=1.0, seed=(1 << 64) - 1,
               stop=[], stream=True, include_usage=False, chat=chat)


@pytest.mark.parametrize("model", ["srm-max", 'a "quoted" model/é'])
@pytest.mark.parametrize("chat", [False, True])
def test_chunk_bytes_are_the_compact_json_of_the_chunk(model, chat):
    answer, reference = Answer(job(chat), model), Answer(job(chat), model)
    reference.id, reference.created = answer.id, answer.created
    deltas = [Delta(0, "plain", [1, 2, 3]), Delta(1, "", []), Delta(0, 'q"uote\\ \n\t\r\x00 é€😀 \ufffd', [7]),
              Delta(1, "</script>\u2028", [0, 65535, 12]), Delta(0, "end", [9], "length"), Delta(1, "", [], "stop"),
              Delta(0, "x", [4], "context")]
    for d in deltas:
        got = answer.chunk_json(d)
        assert got == dumps(reference.chunk(d)).encode()
        assert json.loads(got)["choices"][0]["index"] == d.index
    assert event(b"{}") == b"data: {}\r\n\r\n"


@pytest.mark.parametrize("model", ["srm-max", 'a "quoted" model/é'])
@pytest.mark.parametrize("chat", [False, True])
def test_a_whole_answer_is_the_json_of_the_completion_choices_last(model, chat):
    """``completion_json`` (encoded a choice at a time) holds exactly ``completion``'s fields
    and values, as UTF-8; with the choices in index order, whatever order they finished in."""
    answer = Answer(job(chat), model)
    finals = [Delta(1, "</script>\u2028 é€😀", [0, 65535], "stop"), Delta(0, 'q"uote\\ \n\x00 \ufffd', [7], "length")]
    got = answer.completion_json(finals)
    assert json.loads(got.decode("utf-8")) == answer.completion(finals)
    assert [c["index"] for c in json.loads(got)["choices"]] == [0, 1]
    assert list(json.loads(got))[-1] == "choices" and "é€😀".encode() in got
    assert json.loads(answer.completion_json([]))["choices"] == []


def test_mailbox_wakes_the_loop_once_per_flush_with_every_post_in_order():
    loop = asyncio.new_event_loop()
    try:
        mailbox, queues = Mailbox(loop), [asyncio.Queue() for _ in range(3)]
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]

        def engine_turn():
            for i, q in enumerate(queues):
                mailbox.post(q, [i])
                mailbox.post(q, [i, "again"])
            mailbox.flush()
            mailbox.flush()  # nothing left: no second wake-up

        t = threading.Thread(target=engine_turn)
        t.start()
        t.join()
        assert all(q.empty() for q in queues)  # nothing before the loop runs
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakeups) == 1
        assert [[q.get_nowait(), q.get_nowait()] for q in queues] == [[[i], [i, "again"]] for i in range(3)]
    finally:
        loop.close()


def run_stream(items, delays, ping: float, disconnect_after: float | None = None):
    """Drive an ``EventStream`` like an ASGI server: -> (messages sent, whether on_disconnect ran)."""
    sent, gone = [], []

    async def main():
        disconnected = asyncio.Event()

        async def body():
            for item, delay in zip(items, delays):
                await asyncio.sleep(delay)
                if gone:
                    return
                yield item

        async def receive():
            if disconnect_after is None:
                await asyncio.Event().wait()  # never
            await asyncio.sleep(disconnect_after)
            disconnected.set()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(EventStream(body(), lambda: gone.append(True), ping=ping)({}, receive, send), 5)

    asyncio.run(main())
    return sent, bool(gone)


def test_event_stream_sends_one_message_per_item_and_pings_when_quiet():
    sent, gone = run_stream([b"data: a\r\n\r\n", b"data: b\r\n\r\ndata: c\r\n\r\n"], [0, 0.35], ping=0.1)
    assert not gone
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-type"] == b"text/event-stream; charset=utf-8"
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[0] == b"data: a\r\n\r\n" and bodies[-2:] == [b"data: b\r\n\r\ndata: c\r\n\r\n", b""]
    assert bodies.count(PING) >= 2  # about every 0.1 s of the 0.35 s of quiet
    assert [m["more_body"] for m in sent[1:]] == [True] * (len(bodies) - 1) + [False]


def test_event_stream_tells_of_a_disconnect():
    sent, gone = run_stream([b"data: a\r\n\r\n", b"data: b\r\n\r\n"], [0, 0.5], ping=0, disconnect_after=0.05)
    assert gone
    assert [m["body"] for m in sent[1:]] == [b"data: a\r\n\r\n", b""]
