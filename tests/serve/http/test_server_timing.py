"""`srm-max serve` under unlucky timing: clients that leave while queued, during an engine call,
right after their body or halfway through a stream, next to many others at once. The server
answers every one that stays with a 200 or a 429, never a 5xx, and afterwards holds no slot,
queue place, request or task for those that left.

One server for the module: uvicorn in a thread on a loopback port over the TINY engine with a
byte-level tokenizer, two slots and six queue places, so a handful of requests fills it. The
clients are raw asyncio sockets, so that one can leave at any byte.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from srm_max import Generator  # noqa: E402
from tests.support.graphs import graphs  # noqa: E402
from tests.support.tiny import TINY  # noqa: E402
from tests.support.tokenizers import byte_level_tokenizer  # noqa: E402
from tests.support.uvicorn_server import serving  # noqa: E402

pytestmark = graphs(TINY)

SLOTS, WAITING = 2, 6
PROMPT = "ab é€😀中 üx"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
LIMIT = 30  # seconds: a bound no passing test comes near; a server that hangs fails here


class Served:
    def __init__(self, url: str, generator, app):
        self.url, self.generator, self.app = url, generator, app
        host, port = url.removeprefix("http://").split(":")
        self.address = host, int(port)
        self.loop = app.state.server.engine_loop

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=LIMIT) as r:
            lines = r.read().decode().splitlines()
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in lines if not line.startswith("#"))}

    def wait_for(self, condition, what: str) -> dict[str, float]:
        deadline = time.monotonic() + LIMIT
        while time.monotonic() < deadline:
            m = self.metrics()
            if condition(m):
                return m
            time.sleep(0.01)
        gauges = {k: v for k, v in m.items() if not k.endswith(("_created", "_total")) and "_bucket" not in k}
        raise AssertionError(f"timed out waiting for {what}: {gauges}")

    def idle(self) -> None:
        """No request, sample, slot or queue place is held, by the metrics and by the engine loop."""
        self.wait_for(lambda m: m["srm_running_requests"] + m["srm_waiting_requests"] + m["srm_waiting_samples"]
                      + m["srm_slots_busy"] == 0, "the engine loop to be idle")
        loop = self.loop
        assert not loop._live and loop._queued == 0 and loop._pool.idle

    def tasks(self) -> set[asyncio.Task]:
        """The tasks on the server's event loop."""
        (event_loop,) = self.app.state.server.mailboxes

        async def others():
            return asyncio.all_tasks() - {asyncio.current_task()}

        return asyncio.run_coroutine_threadsafe(others(), event_loop).result(LIMIT)


@pytest.fixture(scope="module")
def served(engine):
    from srm_max.serve.http import create_app

    engine.warmup()  # a cold compile happens here, not inside a client's timeout
    gen = Generator.from_engine(engine, tokenizer=byte_level_tokenizer())
    app = create_app(gen, model_name="tiny", max_batch=SLOTS, max_waiting=WAITING, steps_per_call=2,
                     chat_template=TEMPLATE)
    with serving(app) as url:
        yield Served(url, gen, app)


def post(body: dict, path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def ask(address, body: dict, path: str = "/v1/completions", leave_after: int | None = None):
    """-> (status, head, body) of a request, or None when the client leaves: right after sending
    its body (``leave_after`` 0) or once it has read ``leave_after`` bytes of the answer."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(post(body, path))
        await writer.drain()
        if leave_after == 0:
            return None
        got = b""
        while chunk := await asyncio.wait_for(reader.read(1 << 16), LIMIT):
            got += chunk
            if leave_after is not None and len(got) >= leave_after:
                return None
    finally:
        writer.transport.abort()  # a reset, as a client that dies sends
    head, _, rest = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode().lower(), rest


def test_a_client_gone_from_the_queue_frees_its_place_during_an_engine_call(served):
    """The engine is held in its prefill: the queue places of clients that leave free up at once
    (a new request is admitted, not refused 429), and /health and /metrics answer meanwhile,
    also with half-sent requests (slowloris) holding connections."""
    lock, held = served.generator.engine._lock, []  # the engine runs every call under it: held, the loop blocks
    slow = [socket.create_connection(served.address, timeout=LIMIT) for _ in range(20)]
    for s in slow:
        s.sendall(b"GET /health HTTP/1.1\r\nHo")

    async def main():
        running = asyncio.create_task(ask(served.address, {"prompt": PROMPT, "n": SLOTS, "max_tokens": 4}))
        await asyncio.to_thread(served.wait_for, lambda m: m["srm_running_requests"] == 1, "the first to start")
        queued = [asyncio.create_task(ask(served.address, {"prompt": PROMPT, "n": 3, "max_tokens": 4, "stream": s}))
                  for s in (True, False)]
        await asyncio.to_thread(served.wait_for, lambda m: m["srm_waiting_samples"] == WAITING, "a full queue")
        status, head, _ = await ask(served.address, {"prompt": PROMPT, "max_tokens": 4})
        assert status == 429 and "retry-after:" in head
        for q in queued:
            q.cancel()  # the clients leave
        await asyncio.to_thread(served.wait_for, lambda m: m["srm_waiting_samples"] == 0, "the places to free")
        late = asyncio.create_task(ask(served.address, {"prompt": PROMPT, "n": 3, "max_tokens": 4}))
        await asyncio.to_thread(served.wait_for, lambda m: m["srm_waiting_samples"] == 3, "the late one queued")
        start = time.monotonic()
        with urllib.request.urlopen(served.url + "/health", timeout=LIMIT) as r:
            assert r.status == 200 and time.monotonic() - start < 2
        lock.release()
        held.clear()
        return await running, await late

    lock.acquire()
    held.append(True)
    try:
        answers = asyncio.run(main())
    finally:
        if held:
            lock.release()
        for s in slow:
            s.close()
    assert [status for status, _, _ in answers] == [200, 200]
    served.idle()


def test_clients_that_leave_at_any_moment_leave_nothing_behind(served):
    """Completions and chat, streamed or not, n > 1, echo and log-probabilities (scoring with
    max_tokens 0 beside generation), stop strings and prompts that fill the context, all at once;
    each client reads its answer, or leaves right after its body, after a few bytes or after a
    moment. The answers read are 200 (equal to ``generate``) or 429; nothing is left afterwards."""
    rng = random.Random(3)
    gen = served.generator
    assert asyncio.run(ask(served.address, {"prompt": PROMPT, "max_tokens": 1}))[0] == 200
    baseline = served.tasks()
    full = [1 + i % 60 for i in range(TINY.context_length - 4)]  # room for 4 tokens

    def request(i: int):
        chat, filled = i % 5 == 4, i % 7 == 0
        max_tokens = rng.choice([0, 1, 4] if filled else [0, 1, 4, 12])
        body = {"max_tokens": max_tokens, "n": rng.randint(1, 3), "seed": i, "temperature": 0.8}
        if chat:
            body["messages"] = [{"role": "user", "content": PROMPT}]
        else:
            body["prompt"] = full if filled else PROMPT
            if rng.random() < 0.4:
                body |= {"echo": True, "logprobs": rng.randint(0, 3)}
        if rng.random() < 0.5 and max_tokens:
            body["stream"] = True
        if rng.random() < 0.3:
            body["stop"] = ["é", "x"]
        return body, "/v1/chat/completions" if chat else "/v1/completions"

    async def client(i: int):
        body, path = request(i)
        how = rng.choice(["read", "read", "sent", "bytes", "moment"])
        if how == "moment":
            task = asyncio.create_task(ask(served.address, body, path))
            await asyncio.sleep(rng.random() * 0.03)
            task.cancel()
            return body, path, None
        return body, path, await ask(served.address, body, path, {"read": None, "sent": 0, "bytes": 300}[how])

    async def main():
        return await asyncio.gather(*[client(i) for i in range(48)])

    read = 0
    for body, path, got in asyncio.run(main()):
        if got is None:
            continue
        status, head, rest = got
        assert status in (200, 429), (status, rest)
        if status == 429:
            assert "retry-after:" in head
            continue
        read += 1
        if body.get("stream") or not body["max_tokens"]:
            continue
        prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        for choice in json.loads(rest)["choices"]:
            want = gen.generate(prompt, max_new_tokens=body["max_tokens"], temperature=0.8, seed=choice["seed"],
                                stop=body.get("stop"))
            assert choice["token_ids"] == want.ids
    assert read  # some answers were read whole
    served.idle()
    deadline = time.monotonic() + LIMIT
    while (left := served.tasks() - baseline) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, left
