"""`srm-max serve`: the OpenAI-compatible server, driven by the official openai client.

One server for the module: uvicorn in a thread on a free loopback port, over the
TINY engine with a byte-level tokenizer (characters split across tokens, so
streamed text must hold back partial characters). Four slots, so a request of
more samples than that runs through slot refills.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")

from srm_max import Generator  # noqa: E402
from tests.support.graphs import graphs  # noqa: E402
from tests.support.tiny import TINY  # noqa: E402
from tests.support.tokenizers import byte_level_tokenizer  # noqa: E402
from tests.support.uvicorn_server import serving  # noqa: E402

pytestmark = graphs(TINY)

KEY = "test-key"
MODEL = "tiny"
SLOTS, WAITING = 4, 8
MAX_BODY = 64 << 10
PROMPTS = ["ab é", "€😀 x"]
SAMPLED = dict(temperature=0.9, extra_body={"top_k": 20}, top_p=0.95)


class Served:
    def __init__(self, url: str, generator, app):
        self.url, self.generator, self.app = url, generator, app
        self.client = openai.OpenAI(api_key=KEY, base_url=url + "/v1", max_retries=0, timeout=120)

    def post(self, path: str, body, key: str | None = KEY, raw: bytes | None = None):
        """(status, headers, parsed JSON body) of a POST, without the client's retries."""
        data = raw if raw is not None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.headers, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.headers, json.loads(e.read())

    def metrics(self) -> dict[str, float]:
        req = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_for(self, condition, what: str, limit: float = 60.0):
        """Poll the metrics until ``condition(metrics)`` holds (bounded)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            m = self.metrics()
            if condition(m):
                return m
        raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def served(engine):
    from srm_max.serve.http import create_app

    engine.warmup()  # a cold compile happens here, not inside a client's timeout
    gen = Generator.from_engine(engine, tokenizer=byte_level_tokenizer())
    app = create_app(gen, model_name=MODEL, max_batch=SLOTS, max_waiting=WAITING, steps_per_call=4, api_key=KEY,
                     max_body_bytes=MAX_BODY)
    with serving(app) as url:
        yield Served(url, gen, app)


@contextmanager
def engine_held(served):
    """Block the engine loop at its next engine call (the engine runs every call under its lock)."""
    lock = served.generator.engine._lock
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def texts_of(response) -> list[str]:
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


# ------------------------------------------------------------------ answers
def test_completions_equal_generate_with_the_same_seed(served):
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=30, seed=7, **SAMPLED)
    expected = served.generator.generate(PROMPTS, max_new_tokens=30, temperature=0.9, top_k=20, top_p=0.95, seed=7)
    assert r.object == "text_completion" and r.model == MODEL
    assert texts_of(r) == [c.text for c in expected]
    for choice, c in zip(sorted(r.choices, key=lambda c: c.index), expected):
        assert choice.token_ids == c.ids
        assert choice.seed == c.seed
        assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == sum(len(c.prompt_ids) for c in expected)
    assert r.usage.completion_tokens == 60 and r.usage.total_tokens == r.usage.prompt_tokens + 60


def test_n_samples_of_each_prompt_take_seed_plus_choice_index(served):
    """Choice k = i * n + j (sample j of prompt i) is generate(prompt i, seed=seed + k); six
    samples on four slots, so some join when others finish."""
    n, seed = 3, 11
    before = served.metrics()["srm_prompts_prefilled_total"]
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS, n=n, max_tokens=12, seed=seed, **SAMPLED)
    # the samples of a prompt that start together share its prefill (its state is forked)
    assert served.metrics()["srm_prompts_prefilled_total"] - before < len(PROMPTS) * n
    assert sorted(c.index for c in r.choices) == list(range(len(PROMPTS) * n))
    for choice in r.choices:
        prompt = PROMPTS[choice.index // n]
        c = served.generator.generate(prompt, max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95,
                                      seed=seed + choice.index)
        assert (choice.text, choice.token_ids, choice.seed) == (c.text, c.ids, seed + choice.index)


def test_token_id_prompts_and_greedy(served):
    prompt = [[1, 2, 3, 4, 5], [9, 8]]
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    expected = served.generator.generate(prompt, max_new_tokens=10)
    assert [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)] == [c.ids for c in expected]
    single = served.client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=10, temperature=0)
    assert single.choices[0].token_ids == expected[0].ids


def streamed(served, **kw) -> tuple[dict[int, str], dict[int, str], dict[int, list[int]]]:
    texts, reasons, ids = defaultdict(str), {}, defaultdict(list)
    for chunk in served.client.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            ids[c.index] += c.token_ids
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return dict(texts), reasons, dict(ids)


def test_streamed_chunks_add_up_to_the_completion(served):
    kw = dict(prompt=PROMPTS, n=2, max_tokens=40, seed=3, **SAMPLED)
    whole = served.client.completions.create(model=MODEL, **kw)
    texts, reasons, ids = streamed(served, **kw)
    for c in whole.choices:
        assert texts[c.index] == c.text
        assert ids[c.index] == c.token_ids
        assert reasons[c.index] == c.finish_reason


def test_stream_usage_chunk(served):
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def a_stop_string(served, prompt, seed) -> str:
    """Two whole characters that the unstopped completion's text shows about halfway: a stop string that hits."""
    gen = served.generator
    ids = gen.generate(prompt, max_new_tokens=40, temperature=0.9, seed=seed).ids
    for k in range(len(ids) // 2, len(ids)):
        tail = gen.decode(ids[:k])[-2:]
        if len(tail) == 2 and "\ufffd" not in tail:
            return tail
    raise AssertionError("no stop string found")


def test_stop_strings_cut_as_generate_does(served):
    stop = a_stop_string(served, PROMPTS[0], 5)
    assert stop
    expected = served.generator.generate(PROMPTS[0], max_new_tokens=40, temperature=0.9, seed=5, stop=[stop])
    assert expected.finish_reason == "stop"
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0.9, seed=5,
                                         stop=[stop])
    assert (r.choices[0].text, r.choices[0].token_ids, r.choices[0].finish_reason) == \
        (expected.text, expected.ids, "stop")
    texts, reasons, _ = streamed(served, prompt=PROMPTS[0], max_tokens=40, temperature=0.9, seed=5, stop=stop)
    assert texts[0] == expected.text and stop not in texts[0] and reasons[0] == "stop"


def test_context_limit_is_length_with_the_detail(served):
    prompt = [1 + i % 60 for i in range(TINY.context_length - 6)]  # room for 6 tokens
    r = served.client.completions.create(model=MODEL, prompt=prompt, temperature=0)  # default max_tokens 16
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.finish_detail == "context"
    assert len(choice.token_ids) == TINY.context_length - len(prompt)
    status, _, body = served.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 10})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "max_tokens" and "96" in body["error"]["message"]


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("body, param", [
    ({"prompt": "ab", "logprobs": 21}, "logprobs"),
    ({"prompt": "ab", "model": "gpt-4"}, "model"),
    ({"prompt": "ab", "temperature": -1}, "temperature"),
    ({"prompt": "ab", "top_p": 0}, "top_p"),
    ({"prompt": "ab", "top_k": -2}, "top_k"),
    ({"prompt": "ab", "n": 0}, "n"),
    ({"prompt": "ab", "n": WAITING + 1}, "n"),
    ({"prompt": "ab", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "ab", "seed": -1}, "seed"),
    ({"prompt": "ab", "stop": [1]}, "stop"),
    ({"prompt": [], "max_tokens": 1}, "prompt"),
    ({"prompt": [TINY.vocab_size]}, "prompt"),
    ({"prompt": "ab", "echo": "yes"}, "echo"),
    ({"prompt": "ab", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "ab", "bogus": 1}, "bogus"),
    ({}, "prompt"),
])
def test_bad_parameters_are_400_naming_them(served, body, param):
    status, _, answer = served.post("/v1/completions", {"model": MODEL} | body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_the_client_raises_its_usual_errors(served):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        served.client.completions.create(model=MODEL, prompt="ab", logprobs=21)
    with pytest.raises(openai.BadRequestError, match="chat template"):
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ab"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=served.url + "/v1", max_retries=0).models.list()


def test_malformed_unauthorized_and_oversized_bodies(served):
    status, _, body = served.post("/v1/completions", None, raw=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, headers, body = served.post("/v1/completions", {"prompt": "ab"}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and "Bearer" in headers["WWW-Authenticate"]
    status, _, body = served.post("/v1/completions", {"prompt": "ab", "user": "x" * MAX_BODY})
    assert status == 413 and body["error"]["type"] == "invalid_request_error"


def test_bad_requests_do_not_disturb_a_running_one(served):
    kw = dict(prompt=PROMPTS[1], max_tokens=40, seed=21, **SAMPLED)
    with ThreadPoolExecutor(4) as pool:
        good = pool.submit(streamed, served, **kw)
        bad = [pool.submit(served.post, "/v1/completions", {"prompt": "ab", "top_p": 2}) for _ in range(6)]
        assert all(b.result()[0] == 400 for b in bad)
        texts, _, _ = good.result()
    assert texts[0] == served.generator.generate(PROMPTS[1], max_new_tokens=40, temperature=0.9, top_k=20,
                                                 top_p=0.95, seed=21).text


def test_a_full_queue_is_429_with_retry_after_and_the_rest_completes(served):
    body = {"model": MODEL, "prompt": PROMPTS[0], "n": 4, "max_tokens": 8, "temperature": 0.9, "seed": 1}
    # the engine held, at most 4 samples leave the queue (one prefill) and 8 wait: 5 requests of 4 cannot all fit
    with ThreadPoolExecutor(5) as pool:
        with engine_held(served):
            futures = [pool.submit(served.post, "/v1/completions", body) for _ in range(5)]
            refused = next(as_completed(futures, timeout=60))  # only a refusal can finish while the engine is held
            status, headers, answer = refused.result()
            assert status == 429 and int(headers["Retry-After"]) >= 1 and answer["error"]["code"] == "queue_full"
        results = [f.result() for f in futures]
    assert {status for status, _, _ in results} == {200, 429}
    texts = {tuple(c["text"] for c in a["choices"]) for status, _, a in results if status == 200}
    assert len(texts) == 1  # the same seed, whichever slots and batch mates


def test_an_engine_failure_ends_its_batch_not_the_server(served, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(served.generator.engine, "prefill", broken)
    # a prompt no earlier test sent: the pool reuses its last prefill for a prompt it holds
    prompt = "an engine failure"
    status, _, body = served.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert status == 500 and "injected failure" in body["error"]["message"]
    monkeypatch.undo()
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.choices[0].token_ids == served.generator.generate(PROMPTS[0], max_new_tokens=4).ids


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_its_slot(served, stream):
    before = served.metrics()
    cancelled = 'srm_samples_finished_total{reason="cancelled"}'
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 80, "temperature": 0.9,
                       "stream": stream}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with engine_held(served):  # the sample cannot finish before its client leaves
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {KEY}"})
        sock = conn.sock
        if stream:
            assert conn.getresponse().status == 200
        served.wait_for(lambda m: m["srm_running_requests"] + m["srm_waiting_requests"] == 1, "the request to queue")
        sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        served.wait_for(lambda m: m["srm_client_disconnects_total"] == before["srm_client_disconnects_total"] + 1,
                        "the disconnect")
    # gone from the books (a request still waiting for the engine loop is not running either)
    after = served.wait_for(lambda m: m["srm_running_requests"] + m["srm_waiting_requests"] == 0
                            and m["srm_slots_busy"] == 0, "the slot to be freed")
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1


# ------------------------------------------------------------------ the other routes
def test_models_health_and_metrics(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    req = urllib.request.Request(served.url + "/health", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    m = served.metrics()
    for name in ("srm_requests_total", "srm_generated_tokens_total", "srm_running_requests", "srm_waiting_requests",
                 "srm_slot_occupancy", "srm_time_to_first_token_seconds_count",
                 "srm_inter_token_latency_seconds_count"):
        assert any(key.split("{")[0] == name for key in m), name
    assert m['srm_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert m["srm_slots"] == SLOTS


def test_chat_with_a_template(served):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    served.app.state.chat_template = template
    try:
        r = served.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "ab"}, {"role": "user", "content": " é"}],
            max_completion_tokens=10, temperature=0.9, seed=4)
        stream = served.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "ab é"}], max_tokens=10, temperature=0.9, seed=4,
            stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    finally:
        served.app.state.chat_template = None
    expected = served.generator.generate("ab é", max_new_tokens=10, temperature=0.9, seed=4)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text == "".join(pieces)


def test_serve_command_line():
    from srm_max.cli import build_parser
    from srm_max.serve.http.run import max_batch_of

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.max_batch, args.model, args.api_key) == ("127.0.0.1", 8000, "auto", None, None)
    assert max_batch_of("auto", TINY) == 256 and max_batch_of("7", TINY) == 7


# ------------------------------------------------------------------ hostile bodies (more in test_server_hostile.py)
@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "ab\xed\xa0\x80"}', None),  # a UTF-8-encoded surrogate: not UTF-8
    (rb'{"prompt": "ab\ud800"}', "prompt"),  # a lone surrogate escaped
    (b'{"a":' * 13_000, None),  # nested deeper than the parser goes, within the body limit
    (b'{"prompt": "ab", "temperature": 1e308}', "temperature"),
])
def test_hostile_bodies_are_400_and_the_server_goes_on(served, raw, param):
    status, _, body = served.post("/v1/completions", None, raw=raw)
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert r.choices[0].token_ids == served.generator.generate(PROMPTS[0], max_new_tokens=3).ids
