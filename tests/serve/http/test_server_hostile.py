"""Hostile requests: each is a 400 naming the parameter or the problem, never a 5xx;
and the same checks in ``Generator`` and ``sample_many`` (a ``GenerationError``).

The app runs in-process over an engine that never runs: every check happens
before any engine work (a use of the engine fails the test), and the engine loop
is never started, so a request that passes every check is answered 503 "not
running". Nothing here compiles a graph.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

from srm_max import Generator  # noqa: E402
from srm_max.errors import GenerationError  # noqa: E402
from srm_max.serve.http.errors import APIError  # noqa: E402
from srm_max.serve.http.protocol import MAX_TEMPERATURE, parse_body, parse_completion  # noqa: E402
from tests.support.stand_ins import NoWork  # noqa: E402
from tests.support.tiny import TINY  # noqa: E402
from tests.support.tokenizers import byte_level_tokenizer  # noqa: E402

MODEL = "tiny"
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def gen():
    return Generator.from_engine(NoWork(), tokenizer=byte_level_tokenizer())


class Unrun:
    """The engine of an app whose loop never starts: its config and no other attribute (a
    capability probe, ``getattr`` with a default, finds nothing; any other use fails)."""

    config = TINY


@pytest.fixture(scope="module")
def app():
    from srm_max.serve.http import create_app

    gen = Generator.from_engine(Unrun(), tokenizer=byte_level_tokenizer())
    return create_app(gen, model_name=MODEL, max_batch=4, max_waiting=8, chat_template=TEMPLATE)


def post(app, raw: bytes | str, path: str = "/v1/completions", fault: type | None = None,
         method: str = "POST") -> tuple[int, dict | None]:
    """(status, parsed JSON body or None for none) of one request (a POST unless ``method``)
    through the whole ASGI app (its guard included).

    ``fault``: the exception the app re-raises to its server after answering a fault of its own."""
    raw = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    sent, answer = [], {}

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": raw, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"] = answer.get("body", b"") + message.get("body", b"")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    if fault is None:
        asyncio.run(app(scope, receive, send))
    else:
        with pytest.raises(fault):
            asyncio.run(app(scope, receive, send))
    return answer["status"], json.loads(answer["body"]) if answer.get("body") else None


def refused(app, raw, param, *, path="/v1/completions", says=()) -> dict:
    status, body = post(app, raw, path)
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for words in says:
        assert words in error["message"], error["message"]
    return error


# ------------------------------------------------------------------ the three requests
def test_a_utf8_encoded_surrogate_in_the_body_is_400(app):
    raw = b'{"prompt": "ab\xed\xa0\x80", "max_tokens": 2}'
    error = refused(app, raw, None, says=("not valid UTF-8", f"byte {raw.index(0xED)} is 0xed"))
    assert error["code"] == "invalid_json"


def test_a_json_escaped_lone_surrogate_in_the_prompt_is_400(app):
    refused(app, r'{"prompt": "ab\ud800", "max_tokens": 2}', "prompt", says=("prompt 0", "lone surrogate", "U+D800"))
    refused(app, r'{"prompt": ["ab", "\udfff"]}', "prompt", says=("prompt 1", "U+DFFF"))
    # a pair of escapes is one character: that prompt passes the checks
    status, body = post(app, r'{"prompt": "ab\ud83d\ude00", "max_tokens": 2}')
    assert status == 503 and "not running" in body["error"]["message"]


def test_a_deeply_nested_body_is_400(app):
    error = refused(app, '{"a":' * 50_000, None, says=("nested too deeply",))
    assert error["code"] == "invalid_json"
    refused(app, '{"prompt": "ab", "user": ' + "[" * 50_000 + "]" * 50_000 + "}", None, says=("nested",))


@pytest.mark.parametrize("value", ["1e308", "2.5", "-0.5", "NaN", "Infinity", "-Infinity", "1" + "0" * 400,
                                   '"1"', "true", "[1]"])
def test_temperature_outside_0_2_or_not_a_number_is_400(app, value):
    refused(app, '{"prompt": "ab", "temperature": %s}' % value, "temperature", says=("[0, 2]",))


@pytest.mark.parametrize("value", ["0", "1.5", "NaN", "Infinity", "1" + "0" * 400, '"0.5"', "false"])
def test_top_p_outside_0_1_is_400(app, value):
    refused(app, '{"prompt": "ab", "top_p": %s}' % value, "top_p", says=("(0, 1]",))


def test_a_top_p_that_a_float32_rounds_to_0_is_400(app):
    refused(app, '{"prompt": "ab", "top_p": 1e-50}', "top_p", says=("1e-50 rounds to 0 in the engine's float32",))


@pytest.mark.parametrize("value", [str(2**63), str(-2), "1.5", "true", '"5"', "1e3"])
def test_top_k_outside_its_range_is_400(app, value):
    refused(app, '{"prompt": "ab", "top_k": %s}' % value, "top_k")


CHAT = '{"messages": [{"role": "user", "content": "ab"}], %s}'


@pytest.mark.parametrize("field,value,says,path", [
    ("best_of", "2", "not supported", "/v1/completions"), ("best_of", "true", "an integer", "/v1/completions"),
    ("best_of", "1.0", "an integer", "/v1/completions"), ("suffix", '"x"', "not supported", "/v1/completions"),
    ("suffix", "0", "a string", "/v1/completions"), ("presence_penalty", "0.5", "not supported", "/v1/completions"),
    ("frequency_penalty", "false", "a number", "/v1/chat/completions"),
    ("logit_bias", '{"5": 10}', "not supported", "/v1/completions"),
    ("logit_bias", "0", "an object", "/v1/chat/completions"),
    ("tools", '[{"type": "function"}]', "not supported", "/v1/chat/completions"),
    ("tools", '""', "a list", "/v1/chat/completions"),
    ("tool_choice", '"auto"', "not supported", "/v1/chat/completions"),
    ("function_call", "false", "not supported", "/v1/chat/completions"),
    ("response_format", '{"type": "json_object"}', "not supported", "/v1/chat/completions"),
])
def test_an_unsupported_option_or_one_of_the_wrong_type_is_400(app, field, value, says, path):
    option = '"%s": %s' % (field, value)
    body = CHAT % option if "chat" in path else '{"prompt": "ab", %s}' % option
    refused(app, body, field, path=path, says=(says,))


def test_an_option_that_does_nothing_is_accepted_as_its_own_type(app):
    both = '"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}'
    status, answer = post(app, '{"prompt": "ab", "best_of": 1, "suffix": "", %s}' % both)
    assert status == 503 and "not running" in answer["error"]["message"]  # every check passed
    chat = CHAT % (both + ', "tools": [], "tool_choice": "none", "response_format": {"type": "text"}')
    status, answer = post(app, chat, "/v1/chat/completions")
    assert status == 503 and "not running" in answer["error"]["message"]


def test_the_bounds_that_apply_are_accepted(gen):
    body = {"prompt": "ab", "temperature": MAX_TEMPERATURE, "top_p": 1e-30, "top_k": 2**63 - 1, "seed": 2**64 - 1}
    job = parse_completion(body, gen, MODEL, 8)
    assert (job.temperature, job.top_p, job.top_k, job.seed) == (2.0, 1e-30, 2**63 - 1, 2**64 - 1)
    assert np.float32(job.top_p) > 0
    low = parse_completion({"prompt": "ab", "temperature": 0, "top_k": -1, "top_p": 1}, gen, MODEL, 8)
    assert (low.temperature, low.top_k, low.top_p) == (0.0, 0, 1.0)


# ------------------------------------------------------------------ lone surrogates in every text field
@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "ab", "stop": "\ud800"}, "stop", "stop:"),
    ({"prompt": "ab", "stop": ["x", "a\udc00"]}, "stop", "stop[1]"),
    ({"prompt": "ab", "user": "\ud800"}, "user", "user:"),
    ({"prompt": "ab", "user": 7}, "user", "user must be a string"),
    ({"prompt": "ab", "model": "\ud800"}, "model", "does not exist"),
])
def test_a_lone_surrogate_in_a_string_field_is_400(app, body, param, says):
    error = refused(app, json.dumps(body), param)
    assert says in error["message"]


@pytest.mark.parametrize("message, says", [
    ({"role": "user", "content": "ab\ud800"}, "messages[1].content: character 2 is a lone surrogate"),
    ({"role": "\udbff", "content": "ab"}, "messages[1].role"),
])
def test_a_lone_surrogate_in_a_chat_message_is_400(app, message, says):
    body = {"model": MODEL, "messages": [{"role": "system", "content": "x"}, message]}
    refused(app, json.dumps(body), "messages", path="/v1/chat/completions", says=(says,))


def test_a_template_that_fails_on_a_message_is_400(app):
    app.state.chat_template = "{{ messages[0].content + 1 }}"  # a TypeError inside the template
    try:
        body = {"messages": [{"role": "user", "content": "ab"}]}
        refused(app, json.dumps(body), "messages", path="/v1/chat/completions", says=("chat template",))
    finally:
        app.state.chat_template = TEMPLATE


def test_an_unknown_field_named_by_a_lone_surrogate_gets_a_readable_error(app):
    """The answer echoes the field's name: it is escaped, not a failed UTF-8 encoding (a 500)."""
    error = refused(app, r'{"prompt": "ab", "\ud800": 1}', r"\ud800", says=("Unrecognized request argument",))
    assert error["message"].endswith(r"'\ud800'")
    json.dumps(error, allow_nan=False).encode("utf-8")  # valid Unicode: the param is the escape's text


def test_every_other_field_of_a_wrong_type_is_400(app):
    for name, value in [("stream", 1), ("stream", "yes"), ("stream_options", []),
                        ("stream_options", {"include_usage": 1}), ("stream_options", {"include_usage": True}),
                        ("n", 1.0), ("n", 10**400), ("max_tokens", "3"), ("seed", 2**64), ("stop", {"a": 1}),
                        ("stop", ["a"] * 17), ("stop", ""), ("prompt", {"a": 1}), ("prompt", [[1, [2]]]),
                        ("prompt", [True]), ("prompt", None), ("max_tokens", True)]:
        refused(app, json.dumps({"prompt": "ab", name: value} if name != "prompt" else {name: value}), name)
    refused(app, json.dumps({"prompt": "ab", "stream": True, "stream_options": {"include_usage": True, "x": 1}}),
            "stream_options")
    body = {"messages": [{"role": "user", "content": "ab"}], "max_completion_tokens": 2, "max_tokens": -1}
    refused(app, json.dumps(body), "max_tokens", path="/v1/chat/completions")
    refused(app, json.dumps(body | {"max_tokens": 2, "parallel_tool_calls": "no"}), "parallel_tool_calls",
            path="/v1/chat/completions")


def test_chat_content_as_text_parts_is_read_and_other_parts_are_400(app):
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    status, body = post(app, json.dumps({"messages": [{"role": "user", "content": parts}]}), "/v1/chat/completions")
    assert status == 503 and "not running" in body["error"]["message"]  # every check passed
    from srm_max.serve.http.chat import render

    assert render(TEMPLATE, [{"role": "user", "content": parts}]) == "user: ab\ncd\n"
    for content in ([{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text", "text": 1}], ["ab"]):
        refused(app, json.dumps({"messages": [{"role": "user", "content": content}]}), "messages",
                path="/v1/chat/completions", says=("messages[0].content[0] must be a text part",))


def test_a_prompt_longer_than_the_context_is_context_length_exceeded(app):
    error = refused(app, json.dumps({"prompt": "a" * (TINY.context_length + 1)}), "prompt",
                    says=(f"more than the context length {TINY.context_length}",))
    assert error["code"] == "context_length_exceeded"


def test_head_health_answers_as_get(app):
    assert post(app, b"", "/health", method="HEAD")[0] == post(app, b"", "/health", method="GET")[0] == 503


def test_an_api_key_matches_the_bytes_a_client_sends():
    from srm_max.serve.http.guard import Guard

    guard = Guard(None, "s\u00e9cret", 1, None)
    assert guard._authorized("Bearer s\u00e9cret".encode("utf-8")) and not guard._authorized(b"Bearer s\xe9cret")


def test_a_server_fault_is_a_500_in_the_openai_shape(app, monkeypatch):
    from srm_max.serve.http import app as app_module

    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(app_module, "parse_completion", broken)
    status, body = post(app, '{"prompt": "ab"}', fault=KeyError)
    assert status == 500 and body["error"]["type"] == "server_error" and "KeyError" in body["error"]["message"]


def test_parse_body_refuses_what_is_not_json(gen):
    for raw, says in [(b"\xff", "UTF-8"), (b"[" * 100_000, "nested"), (b'{"n": 1' + b"0" * 5000 + b"}", "4300 digits"),
                      (b'{"n": -1' + b"0" * 4300 + b"}", "4300 digits"),
                      (b"\xef\xbb\xbf{}", "JSON"), ('{"a": 1}'.encode("utf-16"), "UTF-8")]:
        with pytest.raises(APIError, match=says) as caught:
            parse_body(raw)
        assert caught.value.status == 400


# ------------------------------------------------------------------ the same checks in Generator
@pytest.mark.parametrize("kwargs, says", [
    (dict(prompts="ab\ud800"), r"prompt 0: character 2 is a lone surrogate \(U\+D800\)"),
    (dict(prompts=["ab", "\udfff"]), "prompt 1: character 0 is a lone surrogate"),
    (dict(prompts="ab", stop=["\ud800"]), r"stop\[0\]: character 0 is a lone surrogate"),
    (dict(prompts="ab", temperature=1e308), r"temperature: 1e\+308 overflows to inf in the engine's float32"),
    (dict(prompts="ab", temperature=1e-50), "temperature: 1e-50 rounds to 0 in the engine's float32"),
    (dict(prompts="ab", temperature=10**400), "temperature must be a finite number >= 0"),
    (dict(prompts="ab", temperature=np.float64("inf")), "temperature must be"),
    (dict(prompts=["ab", "a"], temperature=[0.5, float("nan")]), r"temperature\[1\] must be"),
    (dict(prompts="ab", top_p=1e-50), "top_p: 1e-50 rounds to 0 in the engine's float32"),
    (dict(prompts="ab", top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(prompts="ab", top_p=float("nan")), "top_p must be"),
    (dict(prompts="ab", top_k=2**63), "top_k must be an integer"),
    (dict(prompts="ab", stop=1.5), "stop: expected token ids"),
    (dict(prompts=[[1, 2**70]]), "token id 1180591620717411303424 is outside"),
])
def test_generator_names_the_bad_argument(gen, kwargs, says):
    with pytest.raises(GenerationError, match=says):
        gen.generate(**kwargs)
    with pytest.raises(GenerationError, match=says):
        gen.stream(**kwargs)


def test_generator_takes_temperatures_above_the_servers_bound(gen):
    """The library's bound is what a float32 holds; 2 is the server's (OpenAI's)."""
    from srm_max.serve.sampling import SamplingParams

    assert SamplingParams.build(1, temperature=1e30).temperature == [1e30]
    with pytest.raises(GenerationError, match="float32"):
        SamplingParams.build(1, temperature=1e39)


@pytest.mark.parametrize("kwargs, says", [
    (dict(temperature=1e308), "temperature"),
    (dict(top_p=1e-50), "top_p"),
    (dict(top_k=[1]), "top_k: sample_many takes one value"),
    (dict(stop="\ud800"), "stop: character 0 is a lone surrogate"),
    (dict(n=True), "n must be an integer"),
    (dict(max_batch=2.0), "max_batch"),
])
def test_sample_many_names_the_bad_argument(gen, kwargs, says):
    kwargs = {"n": 2} | kwargs
    with pytest.raises(GenerationError, match=says):
        gen.sample_many(["ab"], **kwargs)


def test_sample_many_names_a_lone_surrogate_in_a_prompt(gen):
    with pytest.raises(GenerationError, match="prompt 1: character 0 is a lone surrogate"):
        gen.sample_many(["ab", "\ud800"], 2)


def test_encode_names_a_lone_surrogate(gen):
    with pytest.raises(GenerationError, match="text: character 1 is a lone surrogate"):
        gen.encode("a\ud800")
