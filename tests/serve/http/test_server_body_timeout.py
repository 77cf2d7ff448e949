"""A request body that stops arriving is a 408 (OpenAI's error shape) after the body-read
timeout, and its connection closes; a body sent slowly but steadily, each piece within the
timeout, is answered as any other.

One server for the module: uvicorn in a thread on a free loopback port over the TINY engine,
with the timeout made short. The requests go over raw sockets, so that a body can stop
halfway.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from srm_max import Generator  # noqa: E402
from tests.support.graphs import graphs  # noqa: E402
from tests.support.tiny import TINY  # noqa: E402
from tests.support.tokenizers import byte_level_tokenizer  # noqa: E402
from tests.support.uvicorn_server import serving  # noqa: E402

pytestmark = graphs(TINY)

MODEL = "tiny"
TIMEOUT_S = 0.5
CLIENT_TIMEOUT_S = 30  # a server that never answers fails the test here instead of hanging it


@pytest.fixture(scope="module")
def served(engine):
    from srm_max.serve.http import create_app

    engine.warmup()  # a cold compile happens here, not inside a request's timeout
    gen = Generator.from_engine(engine, tokenizer=byte_level_tokenizer())
    app = create_app(gen, model_name=MODEL, max_batch=4, max_waiting=8, body_timeout_s=TIMEOUT_S)
    with serving(app) as url:
        host, port = url.removeprefix("http://").split(":")
        yield (host, int(port)), gen


def connect(address) -> socket.socket:
    return socket.create_connection(address, timeout=CLIENT_TIMEOUT_S)


def head(length: int | None) -> bytes:
    """A POST's head: with a Content-Length, or chunked (``length`` None)."""
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
            ).encode()


def answer(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())


BODY = json.dumps({"model": MODEL, "prompt": "ab é", "max_tokens": 6, "temperature": 0}).encode()


@pytest.mark.parametrize("sent", [
    head(len(BODY)),  # the head alone
    head(len(BODY)) + BODY[:10],  # part of the body the Content-Length promises
    head(None) + b"a\r\n" + BODY[:10] + b"\r\n",  # a chunk, and no last chunk
], ids=["nothing", "part", "chunked"])
def test_a_body_that_stops_arriving_is_408_and_the_connection_closes(served, sent):
    address, gen = served
    with connect(address) as sock:
        sock.sendall(sent)
        start = time.monotonic()
        status, headers, body = answer(sock)
        assert time.monotonic() - start >= TIMEOUT_S * 0.9
        assert status == 408 and headers["connection"] == "close"
        assert body == {"error": {"message": f"The request body stopped arriving: nothing came for {TIMEOUT_S:g} s",
                                  "type": "invalid_request_error", "param": None, "code": "request_timeout"}}
        assert sock.recv(1) == b""  # closed by the server
    # and the server goes on
    with connect(address) as sock:
        sock.sendall(head(len(BODY)) + BODY)
        status, _, body = answer(sock)
    assert status == 200 and body["choices"][0]["token_ids"] == gen.generate("ab é", max_new_tokens=6).ids


def test_a_slow_steady_upload_is_answered(served):
    """Four pieces, each within the timeout, the whole taking longer than it."""
    address, gen = served
    pieces = [BODY[i:i + len(BODY) // 4 + 1] for i in range(0, len(BODY), len(BODY) // 4 + 1)]
    assert len(pieces) == 4
    with connect(address) as sock:
        sock.sendall(head(len(BODY)))
        for piece in pieces:
            time.sleep(TIMEOUT_S * 0.4)
            sock.sendall(piece)
        status, _, body = answer(sock)
    assert status == 200 and body["choices"][0]["token_ids"] == gen.generate("ab é", max_new_tokens=6).ids
