"""Streamed answers: the engine thread's news carried to the event loop, and written
to each client as Server-Sent Events.

With hundreds of streams, the per-chunk work of the HTTP side runs on the same
cores as the engine and slows it down, so this path does as little as it can per
engine call:

- ``Mailbox``: the engine thread posts every request's news of a turn, and the
  event loop is woken once for all of them (not once per request), after the
  engine thread is done with the turn;
- ``EventStream``: a plain ASGI response that writes one body message per engine
  call per request (all of that call's SSE events, already encoded), with one task
  watching for the client's disconnect and one sending a keep-alive comment when
  the stream has been quiet for ``ping`` seconds; nothing runs per event besides
  the write itself.

The bytes are those of any SSE response (``data: {json}`` events separated by a
blank line, CRLF line ends, ``text/event-stream`` with caching and proxy buffering
off), so every SSE client reads them unchanged.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

SEP = b"\r\n"
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-store"),
           (b"connection", b"keep-alive"), (b"x-accel-buffering", b"no")]
PING = b": ping" + SEP + SEP


def event(data: bytes) -> bytes:
    """One SSE event of one ``data`` line (JSON holds no raw line break)."""
    return b"data: " + data + SEP + SEP


class Mailbox:
    """Carries ``(queue, item)`` posts from the engine thread to asyncio queues on ``loop``.

    Posts wait until ``flush``, which wakes the event loop once for all of them: the
    engine thread flushes after handing out a whole turn's news, so the event loop
    does not compete with it for the interpreter while it still works on that turn
    (the next engine call, which releases the interpreter, starts sooner)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._posts: list[tuple[asyncio.Queue, object]] = []

    def post(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._posts.append((queue, item))

    def flush(self) -> None:
        with self._lock:
            if not self._posts:
                return
            posts, self._posts = self._posts, []
        try:
            self.loop.call_soon_threadsafe(_deliver, posts)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is waiting
            pass


def _deliver(posts: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in posts:
        queue.put_nowait(item)


class EventStream(Response):
    """An ASGI response streaming the bytes of ``chunks`` (each item: one or more encoded
    events, sent as one message). ``on_disconnect`` runs if the client goes away
    first; it must make ``chunks`` end. (A Starlette ``Response`` only so that a route
    may return it; it builds its messages itself.)"""

    def __init__(self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None], ping: float = 15.0):
        self.chunks, self.on_disconnect, self.ping = chunks, on_disconnect, ping
        self.status_code, self.raw_headers, self.background = 200, HEADERS, None

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        self._last_write = loop.time()

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.on_disconnect()

        async def keep_alive():
            while True:
                await asyncio.sleep(self._last_write + self.ping - loop.time())
                if loop.time() - self._last_write >= self.ping:
                    await send({"type": "http.response.body", "body": PING, "more_body": True})
                    self._last_write = loop.time()

        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        tasks = [asyncio.create_task(watch())] + ([asyncio.create_task(keep_alive())] if self.ping > 0 else [])
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._last_write = loop.time()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            for t in tasks:
                t.cancel()
        if self.background is not None:
            await self.background()
