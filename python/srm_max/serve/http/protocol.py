"""The OpenAI request and response shapes: a body checked into a ``Job``, and the JSON
the server answers with (a completion, or the chunks of a streamed one).

Every parameter is checked before any work, and a bad one is a 400 naming it.
Parameters the engine does not implement (``logprobs``, ``echo``, penalties,
``logit_bias``, ...) are refused rather than ignored, so a client never gets
an answer computed differently from what it asked for; unknown fields are
refused as OpenAI does.

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
import time
import uuid
from dataclasses import dataclass

from ...errors import GenerationError
from ..sampling import SamplingParams, check_prompts, check_seed, check_stop, resolve_seed
from .errors import APIError, bad_request
from .sequence import Delta

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
_U64 = (1 << 64) - 1

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
           "stream_options", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "functions", "function_call", "response_format", "parallel_tool_calls"}


@dataclass
class Job:
    """A checked request: what the scheduler needs, and what the answer needs."""

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

    def sample_seed(self, choice: int) -> int:
        return (self.seed + choice) & _U64


def check_fields(body, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    return body


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise bad_request(f"The model {model!r} does not exist; this server serves {model_name!r}",
                          "model", "model_not_found")


def refuse_unsupported(body: dict) -> None:
    """Options whose answer would differ from what was asked: refused, not ignored."""
    def refuse(name, what):
        raise bad_request(f"{name} is not supported by this server ({what})", name, "unsupported_parameter")

    if body.get("logprobs") not in (None, False):
        refuse("logprobs", "the engine returns sampled tokens, not their log-probabilities")
    if body.get("top_logprobs") is not None:
        refuse("top_logprobs", "the engine returns sampled tokens, not their log-probabilities")
    if body.get("echo"):
        refuse("echo", "the response holds the completion only")
    if body.get("best_of") not in (None, 1):
        refuse("best_of", "use n and choose on the client")
    if body.get("suffix") not in (None, ""):
        refuse("suffix", "no insertion mode")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            refuse(name, "no penalties in the sampler")
    if body.get("logit_bias"):
        refuse("logit_bias", "no logit bias in the sampler")
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name):
            refuse(name, "no tool calls")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        refuse("response_format", "text only")


def parse_job(body: dict, generator, prompts, max_samples: int, *, chat: bool = False,
              max_tokens_field: str = "max_tokens") -> Job:
    """Check the sampling fields of ``body`` for ``prompts`` (text or ids, as the request gave them)."""
    try:
        ids, _ = check_prompts(prompts, generator.config, generator.encode)
    except GenerationError as e:
        raise bad_request(str(e), "messages" if chat else "prompt") from None
    n = body.get("n", 1)
    n = 1 if n is None else n
    if not _is_int(n) or n < 1:
        raise bad_request(f"n must be an integer >= 1, got {n!r}", "n")
    if len(ids) * n > max_samples:
        raise bad_request(f"{len(ids)} prompt(s) x n={n} is {len(ids) * n} samples, more than this server "
                          f"queues ({max_samples})", "n")
    max_new = _max_tokens(body, max_tokens_field, ids, generator.config.context_length)
    sampling = {}
    for name, default in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
        value = body.get(name)
        value = default if value is None else value
        try:
            built = SamplingParams.build(1, **{name: value})
        except GenerationError as e:
            raise bad_request(str(e), name) from None
        sampling[name] = getattr(built, name)[0]
    seed = body.get("seed")
    try:
        seed = resolve_seed(seed) if seed is None else check_seed(seed)
    except GenerationError as e:
        raise bad_request(str(e), "seed") from None
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad_request("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    return Job(ids, n, max_new, sampling["temperature"], sampling["top_k"], sampling["top_p"], seed,
               _stop(body.get("stop"), generator), stream, bool(options.get("include_usage")), chat)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _max_tokens(body: dict, field: str, prompts: list[list[int]], n_ctx: int) -> int:
    value = body.get(field)
    if value is None and field != "max_tokens":
        value = body.get("max_tokens")
    if value is None:
        # OpenAI's default; a prompt near the context ends earlier, with finish_detail "context"
        return DEFAULT_MAX_TOKENS
    if not _is_int(value) or value < 0:
        raise bad_request(f"{field} must be an integer >= 0, got {value!r}", field)
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
    try:
        return check_stop(items, generator.config.vocab_size, generator.tokenizer is not None)[1]
    except GenerationError as e:
        raise bad_request(str(e), "stop") from None


# ------------------------------------------------------------ answers
def public_reason(reason: str) -> str:
    return "length" if reason == "context" else reason


class Answer:
    """The response and chunk bodies of one request (completion or chat shape)."""

    def __init__(self, job: Job, model: str):
        self.job, self.model = job, model
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if job.chat else "text_completion"
        self.prompt_tokens = sum(len(p) for p in job.prompts)
        self.started: set[int] = set()  # chat chunks: the role goes in a choice's first one
        # the bytes every running completion chunk starts with (see ``chunk_json``)
        self._head = dumps({"id": self.id, "object": self.object, "created": self.created,
                            "model": self.model})[:-1].encode() + b',"choices":[{"index":'

    def _finish_fields(self, delta: Delta) -> dict:
        if delta.finish_reason is None:
            return {"finish_reason": None}
        return {"finish_reason": public_reason(delta.finish_reason), "finish_detail": delta.finish_reason,
                "seed": self.job.sample_seed(delta.index)}

    def choice(self, delta: Delta) -> dict:
        body = {"index": delta.index}
        if self.job.chat:
            body["message"] = {"role": "assistant", "content": delta.text}
        else:
            body["text"] = delta.text
        body["logprobs"] = None
        return body | self._finish_fields(delta) | {"token_ids": delta.ids}

    def completion(self, finals: list[Delta]) -> dict:
        finals = sorted(finals, key=lambda d: d.index)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "seed": self.job.seed, "choices": [self.choice(d) for d in finals],
                "usage": self.usage(sum(len(d.ids) for d in finals))}

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
        body["logprobs"] = None
        body |= self._finish_fields(delta) | {"token_ids": delta.ids}
        return {"id": self.id, "object": self.object + ("" if not self.job.chat else ".chunk"),
                "created": self.created, "model": self.model, "choices": [body]}

    def chunk_json(self, delta: Delta) -> bytes:
        """``dumps(self.chunk(delta))``, encoded: a stream sends one per sample per engine call,
        so the chunk of a running completion sample is put together from bytes made once."""
        if self.job.chat or delta.finish_reason is not None:
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
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}


def dumps(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"))  # compact: a stream sends one per engine call


def queue_full(retry_after: int) -> APIError:
    return APIError(429, f"The server is busy: its waiting queue is full. Retry after {retry_after} s.",
                    code="queue_full", headers={"Retry-After": str(retry_after)})
