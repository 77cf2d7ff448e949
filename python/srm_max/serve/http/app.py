"""The OpenAI-compatible HTTP API over one ``EngineLoop``.

Routes (module-level handlers on ``routes``, sharing the app's ``Server`` through
``request.app.state.server``): POST /v1/completions, POST /v1/chat/completions (with a
chat template), GET /v1/models, GET /health, GET /metrics. A request is checked completely
before it is queued (a bad one is a 400 and touches nothing), then its samples
run in the scheduler's engine loop; the route only waits for their news. A
client that goes away (streamed or not) cancels its samples, which leave their
slots at the loop's next turn.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from ..sampling import DEFAULT_STEPS_PER_CALL
from .errors import APIError, error_body
from .guard import BODY_READ_TIMEOUT_S, Guard
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .protocol import Answer, CheckedRequest, dumps, parse_body, parse_chat, parse_completion, queue_full
from .engine_loop import EngineLoop, EngineLoopStopped, QueueFull
from .sequence import ERROR, Delta, ServedRequest, ServedSample
from .stream import EventStream, Mailbox, event

DEFAULT_MAX_BODY_BYTES = 1 << 20  # far above any prompt that fits a context


@dataclass
class Server:
    """What the routes share (``app.state.server``): the model, the engine loop and the
    mailboxes through which the loop's thread hands news to the event loops."""

    generator: object
    model_name: str
    max_waiting: int
    metrics: Metrics
    engine_loop: EngineLoop | None = None
    mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = field(default_factory=dict)  # one per event loop

    def flush(self) -> None:
        """Called by the engine loop once it has handed out a turn's news."""
        for mailbox in list(self.mailboxes.values()):
            mailbox.flush()

    def mailbox(self) -> Mailbox:
        loop = asyncio.get_running_loop()
        return self.mailboxes.get(loop) or self.mailboxes.setdefault(loop, Mailbox(loop))


def create_app(generator, model_name: str = "srm-max", max_batch: int = 64, max_waiting: int = 1024,
               steps_per_call: int = DEFAULT_STEPS_PER_CALL, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template: str | None = None,
               on_engine_failure: Callable[[BaseException], None] | None = None,
               body_timeout_s: float = BODY_READ_TIMEOUT_S) -> FastAPI:
    """The app; its engine loop starts and stops with the app's lifespan.

    ``max_batch``: the most samples decoded together; ``max_waiting``: the most samples
    queued for a slot (beyond it: 429); ``chat_template``: Jinja, or None for no chat
    (``app.state.chat_template``, read at each chat request); ``body_timeout_s``: the longest
    wait for the next piece of a request body (then 408, and the connection closes).
    """
    server = Server(generator, model_name, max_waiting, Metrics())
    server.engine_loop = EngineLoop(generator, max_batch, max_waiting, steps_per_call, server.metrics, server.flush,
                                    on_failure=on_engine_failure)
    app = FastAPI(title="srm-max", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.state.chat_template = chat_template
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, metrics=server.metrics,
                       body_timeout_s=body_timeout_s)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.include_router(routes)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    engine_loop = app.state.server.engine_loop
    if not engine_loop.alive:
        engine_loop.start()
    try:
        yield
    finally:
        engine_loop.stop()


async def _api_error(request: Request, e: APIError) -> Response:
    return _error_response(e)


async def _http_error(request: Request, e: HTTPException) -> Response:
    return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)


async def _server_error(request: Request, e: Exception) -> Response:
    # a fault of the server itself: still OpenAI's error shape (Starlette logs it)
    return _error_response(APIError(500, f"internal error: {type(e).__name__}"))


routes = APIRouter()


def _server(request: Request) -> Server:
    return request.app.state.server


@routes.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    engine_loop = _server(request).engine_loop
    if not engine_loop.alive:
        raise APIError(503, f"the engine loop is not running: {engine_loop.failure}")
    return {"status": "ok"}


@routes.get("/metrics")
async def metrics(request: Request):
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(request: Request):
    server = _server(request)
    return {"object": "list", "data": [{
        "id": server.model_name, "object": "model", "created": int(time.time()), "owned_by": "srm-max",
        "max_model_len": server.generator.config.context_length}]}


@routes.post("/v1/completions")
async def completions(request: Request):
    server = _server(request)
    job = parse_completion(parse_body(await request.body()), server.generator, server.model_name, server.max_waiting)
    return await _run(request, server, job)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request):
    server = _server(request)
    job = parse_chat(parse_body(await request.body()), server.generator, server.model_name,
                     request.app.state.chat_template, server.max_waiting)
    return await _run(request, server, job)


async def _run(request: Request, server: Server, job: CheckedRequest):
    """Queue the checked request's samples in the engine loop; answer as they finish (or
    stream their news)."""
    answer = Answer(job, server.model_name)
    queue: asyncio.Queue = asyncio.Queue()
    mailbox = server.mailbox()

    def sink(deltas: list[Delta]) -> None:  # called from the engine thread
        mailbox.post(queue, deltas)

    req = ServedRequest(answer.id, job.stream, job.stop, sink, logprobs=job.logprobs, echo=job.echo)
    req.samples = [ServedSample(p, job.temperature, job.top_k, job.top_p, job.choice_seed(i * job.n + j), job.max_new,
                                stop_strings=tuple(job.stop), request=req, index=i * job.n + j,
                                logprobs=job.logprobs)
                   for i, p in enumerate(job.prompts) for j in range(job.n)]
    answer.samples = req.samples
    engine_loop = server.engine_loop
    try:
        engine_loop.submit(req)
    except QueueFull as e:
        raise queue_full(e.retry_after) from None
    except EngineLoopStopped as e:
        raise APIError(503, str(e)) from None
    if job.stream:
        def went_away():
            engine_loop.cancel(req)
            queue.put_nowait(None)

        return EventStream(_events(engine_loop, req, answer, queue), went_away)
    return await _collect(request, engine_loop, req, answer, queue)


async def _collect(request: Request, engine_loop: EngineLoop, req: ServedRequest, answer: Answer,
                   queue: asyncio.Queue):
    """The whole answer once every sample has finished; a client that goes away first
    cancels the samples."""
    async def watch():
        # the body has been read: the next message is the client's disconnect
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine_loop.cancel(req)
        queue.put_nowait(None)

    watcher = asyncio.create_task(watch())
    finals: dict[int, Delta] = {}
    try:
        while len(finals) < len(req.samples):
            deltas = await queue.get()
            if deltas is None:
                return Response(status_code=499)  # nobody reads it
            for d in deltas:
                if d.finish_reason == ERROR:
                    raise APIError(500, d.text)
                finals[d.index] = d
    finally:
        watcher.cancel()
    # many samples with their log-probabilities make an answer of hundreds of MB, seconds to
    # put together and encode: in a worker thread, while the event loop answers the others
    body = await asyncio.to_thread(answer.completion_json, list(finals.values()))
    return Response(body, media_type="application/json")


async def _events(engine_loop: EngineLoop, req: ServedRequest, answer: Answer, queue: asyncio.Queue):
    """The SSE bytes of a streamed answer: one item per engine call that brought news."""
    finished, tokens = 0, 0
    try:
        while finished < len(req.samples):
            deltas = await queue.get()
            if deltas is None:  # the client went away
                return
            out = []
            for d in deltas:
                if d.finish_reason == ERROR:
                    yield event(dumps(error_body(500, d.text)).encode())
                    return
                tokens += len(d.ids)
                finished += d.finish_reason is not None
                out.append(event(answer.chunk_json(d)))
            if finished == len(req.samples):  # the last news and the end go in one write
                if answer.job.include_usage:
                    out.append(event(dumps(answer.usage_chunk(tokens)).encode()))
                out.append(event(b"[DONE]"))
            yield b"".join(out)
    finally:
        # a disconnect ends this generator early: the samples leave their slots
        if not req.done:
            engine_loop.cancel(req)


def _error_response(e: APIError) -> Response:
    # json.dumps escapes every non-ASCII character: a lone surrogate the message echoes
    # (an unknown field's name) cannot fail the answer's UTF-8 encoding
    return Response(json.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")

