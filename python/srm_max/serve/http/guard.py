"""What every request passes before a route sees it: the API key, the body size limit, the
body-read timeout, and the count of answers by endpoint and status.

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one
wraps streamed responses and hides a client's disconnect from them.
"""

from __future__ import annotations

import asyncio
import hmac

from .errors import APIError
from .metrics import Metrics

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_BODY_METHODS = (b"POST", b"PUT", b"PATCH")
# The longest wait for the next piece of a request body: uvicorn has no such limit, so a client
# whose Content-Length promises more than it sends would hold its connection and task forever.
# Between pieces, not for the whole body: a slow but steady upload of any size still arrives.
BODY_READ_TIMEOUT_S = 30.0


class Guard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: Metrics,
                 body_timeout_s: float = BODY_READ_TIMEOUT_S):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        headers = dict(scope["headers"])
        if self.api_key is not None and not self._authorized(headers.get(b"authorization", b"")):
            return await _answer(APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}),
                                 counted)
        if scope["method"].encode() not in _BODY_METHODS:
            return await self.app(scope, receive, counted)
        too_big = APIError(413, f"The request body is larger than {self.max_body_bytes} bytes",
                           code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _answer(too_big, counted)
        # read the whole (bounded) body here, so a chunked upload cannot pass the limit
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    message = await receive()
            except TimeoutError:
                return await _answer(self._too_slow(), counted)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await _answer(too_big, counted)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the real channel: its disconnect reaches the route

        return await self.app(scope, replay, counted)

    def _too_slow(self) -> APIError:
        # the connection closes after the answer: the body's unread rest, should it come after
        # all, would be read as the next request
        return APIError(408, f"The request body stopped arriving: nothing came for {self.body_timeout_s:g} s",
                        code="request_timeout", headers={"Connection": "close"})

    def _authorized(self, header: bytes) -> bool:
        # latin-1 maps each byte to one character and back: the token's bytes as the client sent them
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"),
                                                                  self.api_key.encode())


async def _answer(error: APIError, send) -> None:
    import json

    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
