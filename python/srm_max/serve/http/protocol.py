"""The OpenAI request and response shapes: a body checked into a ``CheckedRequest``, and the JSON
the server answers with (a completion, or the chunks of a streamed one).

Every parameter is checked before any work, and a bad one is a 400 naming it.
Parameters the engine does not implement (penalties, ``logit_bias``, ...) are
refused rather than ignored, so a client never gets an answer computed
differently from what it asked for; unknown fields are refused as OpenAI does.

Log-probabilities (``http/logprobs.py``): /v1/completions takes ``logprobs`` (0-20
alternatives per token) and ``echo`` (the prompt before the completion; with
``logprobs`` its tokens' log-probabilities too, the first null; ``max_tokens: 0``
scores a text without generating), in OpenAI's legacy shape; /v1/chat/completions
takes ``logprobs: true`` and ``top_logprobs`` (0-20) in the chat shape. Streamed
chunks carry the log-probabilities of their tokens.

Seeds: choice k of a request (k = i * n + j for sample j of prompt i) is drawn
with seed ``seed + k`` (mod 2**64), the seed ``Generator.generate`` gives prompt
k of a list. So ``generate(prompt_i, seed=choice.seed)`` replays any choice, and
with n = 1 a request equals ``generate(prompts, seed=seed)``. Every choice
reports its ``seed``; without one the request draws a fresh base seed.

Finish reasons: "stop" and "length" as OpenAI; a sample that reaches the
context length ends with "length" too, and the extra field ``finish_detail``
says "context" (it is otherwise the same as ``finish_reason``).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass

from ...errors import ContextLengthError, GenerationError
from ...scalars import is_plain_real
from ..sampling import brief_repr, check_prompts, check_stop, check_temperature, check_text, check_top_k, \
    check_top_p, is_int, nth_seed, resolve_seed
from ..scoring import MAX_TOP_N
from .chat import no_template_error, render
from .errors import APIError, bad_request
from .logprobs import chat_logprobs, completion_logprobs
from .sequence import Delta

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 2.0  # OpenAI's bound; ``Generator`` takes any temperature a float32 holds
MAX_TOP_LOGPROBS = MAX_TOP_N  # alternatives per token (OpenAI's chat bound; its legacy one is 5)

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
           "stream_options", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "functions", "function_call", "response_format", "parallel_tool_calls"}


@dataclass
class CheckedRequest:
    """A checked request: what the engine loop needs, and what the answer needs."""

    prompts: list[list[int]]
    n: int
    max_new: int
    temperature: float
    top_k: int
    top_p: float
    seed: int  # choice k gets seed + k
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool = False
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    echo: bool = False

    def choice_seed(self, choice: int) -> int:
        return nth_seed(self.seed, choice)


class _LongInteger(ValueError):
    pass


def _json_int(digits: str) -> int:
    """A JSON integer; one longer than Python converts from text is refused by name."""
    if len(digits.lstrip("-")) > sys.get_int_max_str_digits():
        raise _LongInteger
    return int(digits)


def parse_body(raw: bytes):
    """The JSON value of a request body: strict UTF-8 (RFC 8259), or a 400 saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: byte {e.start} is {raw[e.start]:#04x} ({e.reason})",
                          code="invalid_json") from None
    try:
        return json.loads(text, parse_int=_json_int)
    except _LongInteger:
        raise bad_request(f"the request body has an integer of more than {sys.get_int_max_str_digits()} digits",
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: it is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, and an integer of more digits than Python converts
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def parse_completion(body, generator, model_name: str, max_samples: int) -> CheckedRequest:
    """A /v1/completions body checked into a ``CheckedRequest``, or an ``APIError`` (400) naming the problem."""
    body = check_fields(body, COMPLETION_FIELDS)
    check_model(body, model_name)
    refuse_unsupported(body)
    if "prompt" not in body:
        raise bad_request("prompt is required", "prompt")
    job = parse_job(body, generator, body["prompt"], max_samples)
    logprobs = body.get("logprobs")
    job.logprobs = None if logprobs is None or logprobs is False else _top_n("logprobs", logprobs)
    job.echo = _given(body, "echo", False)
    if not isinstance(job.echo, bool):
        raise bad_request(f"echo must be a boolean, got {brief_repr(job.echo)}", "echo")
    return job


def parse_chat(body, generator, model_name: str, template: str | None, max_samples: int) -> CheckedRequest:
    """A /v1/chat/completions body checked into a ``CheckedRequest`` (its messages rendered by ``template``)."""
    body = check_fields(body, CHAT_FIELDS)
    check_model(body, model_name)
    if template is None:
        raise no_template_error(model_name)
    refuse_unsupported(body)
    prompt = render(template, body.get("messages"))
    job = parse_job(body, generator, prompt, max_samples, chat=True, max_tokens_field="max_completion_tokens")
    logprobs = _given(body, "logprobs", False)
    if not isinstance(logprobs, bool):
        raise bad_request(f"logprobs must be a boolean, got {brief_repr(logprobs)}", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if logprobs:
        job.logprobs = 0 if top is None else _top_n("top_logprobs", top)
    return job


def _top_n(name: str, value) -> int:
    if not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {brief_repr(value)}", name)
    return int(value)


def check_fields(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {brief_repr(unknown[0])}", unknown[0])
    return body


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise bad_request(f"The model {brief_repr(model)} does not exist; this server serves {model_name!r}",
                          "model", "model_not_found")


def refuse_unsupported(body: dict) -> None:
    """Options whose answer would differ from what was asked: refused, not ignored. A value
    that does nothing (best_of 1, a penalty of 0, no bias, no tools) is accepted only as
    the type the option takes."""
    def refuse(name, what):
        raise bad_request(f"{name} is not supported by this server ({what})", name, "unsupported_parameter")

    def of_type(name, accept, what):
        value = body.get(name)
        if value is not None and not accept(value):
            raise bad_request(f"{name} must be {what}, got {brief_repr(value)}", name)
        return value

    if of_type("best_of", is_int, "an integer") not in (None, 1):
        refuse("best_of", "use n and choose on the client")
    if of_type("suffix", lambda v: isinstance(v, str), "a string") not in (None, ""):
        refuse("suffix", "no insertion mode")
    for name in ("presence_penalty", "frequency_penalty"):
        if of_type(name, is_plain_real, "a number") not in (None, 0):
            refuse(name, "no penalties in the sampler")
    if of_type("logit_bias", lambda v: isinstance(v, dict), "an object of token ids to biases"):
        refuse("logit_bias", "no logit bias in the sampler")
    for name in ("tools", "functions"):
        if of_type(name, lambda v: isinstance(v, list), "a list"):
            refuse(name, "no tool calls")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            refuse(name, "no tool calls")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        refuse("response_format", "text only")


def parse_job(body: dict, generator, prompts, max_samples: int, *, chat: bool = False,
              max_tokens_field: str = "max_tokens") -> CheckedRequest:
    """Check the sampling fields of ``body`` for ``prompts`` (text or ids, as the request gave them)."""
    ids = _checked("messages" if chat else "prompt", check_prompts, prompts, generator.config, generator.encode)[0]
    n = body.get("n")
    n = 1 if n is None else n
    if not is_int(n) or n < 1:
        raise bad_request(f"n must be an integer >= 1, got {brief_repr(n)}", "n")
    if len(ids) * n > max_samples:
        raise bad_request(f"{len(ids)} prompt(s) x n={n} is {len(ids) * n} samples, more than this server "
                          f"queues ({max_samples})", "n")
    max_new = _max_tokens(body, max_tokens_field, ids, generator.config.context_length)
    temperature = _checked("temperature", check_temperature, _given(body, "temperature", 1.0),
                           maximum=MAX_TEMPERATURE)
    top_k = _checked("top_k", check_top_k, _given(body, "top_k", 0))
    top_p = _checked("top_p", check_top_p, _given(body, "top_p", 1.0))
    seed = _checked("seed", resolve_seed, body.get("seed"))
    stream = _given(body, "stream", False)
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {brief_repr(stream)}", "stream")
    options = _given(body, "stream_options", {})
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool) or \
            set(options) - {"include_usage"}:
        raise bad_request("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    if options and not stream:
        raise bad_request("stream_options is only for a streamed answer (stream: true)", "stream_options")
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise bad_request(f"user must be a string, got {brief_repr(user)}", "user")
        _checked("user", check_text, user, "user")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls must be a boolean, got {brief_repr(parallel)}", "parallel_tool_calls")
    return CheckedRequest(ids, n, max_new, temperature, top_k, top_p, seed, _stop(body.get("stop"), generator), stream,
               bool(options.get("include_usage")), chat)


def _given(body: dict, name: str, default):
    """A field's value; absent and null are both the default, as OpenAI reads them."""
    value = body.get(name)
    return default if value is None else value


def _checked(param: str, check, *args, **kwargs):
    """``check(*args, **kwargs)``, its GenerationError a 400 naming ``param``."""
    try:
        return check(*args, **kwargs)
    except GenerationError as e:
        raise bad_request(str(e), param, "context_length_exceeded" if isinstance(e, ContextLengthError) else None) \
            from None


def _max_tokens(body: dict, field: str, prompts: list[list[int]], n_ctx: int) -> int:
    """The new tokens of each sample: ``field``, else ``max_tokens`` (chat takes either; both are checked)."""
    names = dict.fromkeys((field, "max_tokens"))
    given = {}
    for name in names:
        value = body.get(name)
        if value is not None and (not is_int(value) or value < 0):
            raise bad_request(f"{name} must be an integer >= 0, got {brief_repr(value)}", name)
        if value is not None:
            given[name] = value
    if not given:
        # OpenAI's default; a prompt near the context ends earlier, with finish_detail "context"
        return DEFAULT_MAX_TOKENS
    field, value = next(iter(given.items()))
    for i, p in enumerate(prompts):
        if len(p) + value > n_ctx:
            raise bad_request(
                f"This model's maximum context length is {n_ctx} tokens, but prompt {i} has {len(p)} tokens "
                f"and {field} is {value} ({len(p) + value} in all). Reduce the prompt or {field}.",
                field, "context_length_exceeded")
    return value


def _stop(stop, generator) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    return _checked("stop", check_stop, stop, generator.config.vocab_size, generator.tokenizer is not None)[1]


# ------------------------------------------------------------ answers
def public_reason(reason: str) -> str:
    return "length" if reason == "context" else reason


class Answer:
    """The response and chunk bodies of one request (completion or chat shape)."""

    def __init__(self, job: CheckedRequest, model: str):
        self.job, self.model = job, model
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if job.chat else "text_completion"
        self.prompt_tokens = sum(len(p) for p in job.prompts)
        self.started: set[int] = set()  # chat chunks: the role goes in a choice's first one
        self.samples: list = []  # the request's samples (sequence.ServedSample), for the cached prompt tokens
        # the bytes every running completion chunk starts with (see ``chunk_json``)
        self._head = dumps({"id": self.id, "object": self.object, "created": self.created,
                            "model": self.model})[:-1].encode() + b',"choices":[{"index":'

    def _finish_fields(self, delta: Delta) -> dict:
        if delta.finish_reason is None:
            return {"finish_reason": None}
        return {"finish_reason": public_reason(delta.finish_reason), "finish_detail": delta.finish_reason,
                "seed": self.job.choice_seed(delta.index)}

    def choice(self, delta: Delta) -> dict:
        body = {"index": delta.index}
        if self.job.chat:
            body["message"] = {"role": "assistant", "content": delta.text}
        else:
            body["text"] = delta.text
        body["logprobs"] = self._logprobs(delta)
        return body | self._finish_fields(delta) | {"token_ids": delta.ids}

    def _logprobs(self, delta: Delta) -> dict | None:
        if delta.logprobs is None:
            return None
        return (chat_logprobs if self.job.chat else completion_logprobs)(delta.logprobs)

    def completion(self, finals: list[Delta]) -> dict:
        finals = sorted(finals, key=lambda d: d.index)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "seed": self.job.seed, "choices": [self.choice(d) for d in finals],
                "usage": self.usage(sum(len(d.ids) for d in finals))}

    def completion_json(self, finals: list[Delta]) -> bytes:
        """``completion(finals)`` encoded (UTF-8, "choices" last), one choice at a time: a thread
        encoding hundreds of MB of log-probabilities hands the interpreter to the event loop
        between choices, where one encode of it all would hold it for seconds."""
        body = self.completion(finals)
        choices = [json.dumps(c, ensure_ascii=False, allow_nan=False, separators=(",", ":")) for c in
                   body.pop("choices")]
        return f'{dumps(body)[:-1]},"choices":[{",".join(choices)}]}}'.encode()

    def chunk(self, delta: Delta) -> dict:
        body = {"index": delta.index}
        if self.job.chat:
            content = {"content": delta.text}
            if delta.index not in self.started:
                content = {"role": "assistant"} | content
                self.started.add(delta.index)
            body["delta"] = content
        else:
            body["text"] = delta.text
        body["logprobs"] = self._logprobs(delta)
        body |= self._finish_fields(delta) | {"token_ids": delta.ids}
        return {"id": self.id, "object": self.object + ("" if not self.job.chat else ".chunk"),
                "created": self.created, "model": self.model, "choices": [body]}

    def chunk_json(self, delta: Delta) -> bytes:
        """``dumps(self.chunk(delta))``, encoded: a stream sends one per sample per engine call,
        so the chunk of a running completion sample is put together from bytes made once."""
        if self.job.chat or delta.finish_reason is not None or delta.logprobs is not None:
            return dumps(self.chunk(delta)).encode()
        return b"".join((self._head, str(delta.index).encode(), b',"text":', json.dumps(delta.text).encode(),
                         b',"logprobs":null,"finish_reason":null,"token_ids":[',
                         ",".join(map(str, delta.ids)).encode(), b"]}]}"))

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {"id": self.id, "object": self.object + ("" if not self.job.chat else ".chunk"),
                "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage(completion_tokens)}

    def usage(self, completion_tokens: int) -> dict:
        prompt = self.prompt_tokens  # once per prompt, whatever n (as OpenAI counts)
        # a prompt's tokens its prefill took from the prefix cache: its first sample's count
        # (the samples of a prompt share its prefill)
        cached = sum(s.cached_tokens for s in self.samples if s.index % self.job.n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def dumps(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"))  # compact: a stream sends one per engine call


def queue_full(retry_after: int) -> APIError:
    return APIError(429, f"The server is busy: its waiting queue is full. Retry after {retry_after} s.",
                    code="queue_full", headers={"Retry-After": str(retry_after)})
