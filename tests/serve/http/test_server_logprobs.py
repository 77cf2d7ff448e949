"""`srm-max serve` with log-probabilities: /v1/completions ``logprobs`` and ``echo`` (OpenAI's
legacy shape, streamed too), /v1/chat/completions ``logprobs`` + ``top_logprobs``, and
lm-eval's ``local-completions`` model against the server.

One server for the module (uvicorn in a thread on a loopback port) over the TINY engine
with a word-level tokenizer that has ``<|endoftext|>``, from a checkpoint directory that
``transformers.AutoTokenizer`` loads (lm-eval's client reads the tokenizer from it); a
chat template that joins the messages.
"""

from __future__ import annotations

import json
import os
import urllib.request

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from srm_max import Generator  # noqa: E402
from tests.support.graphs import ENGINE_KINDS, graphs  # noqa: E402
from tests.support.lm_eval_tasks import by_doc, evaluate  # noqa: E402
from tests.support.tiny import TINY  # noqa: E402
from tests.support.uvicorn_server import serving  # noqa: E402

pytestmark = graphs(TINY, ENGINE_KINDS)

MODEL = "tiny"
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"
PROMPT = "w5 w17 w3 w44 w9"


class Served:
    def __init__(self, url: str, generator):
        self.url, self.generator = url, generator

    def post(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, (json.loads(r.read()) if not body.get("stream") else _events(r.read()))
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


def _events(raw: bytes) -> list[dict]:
    data = [line[6:] for line in raw.decode().split("\r\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.fixture(scope="module")
def loaded_tasks(tasks):  # noqa: F811
    """Two loaded copies of the tasks (one per evaluation), read before the server starts:
    the datasets library's JSON reader crashed this process (SIGSEGV) beside the running
    server."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    folder, docs = tasks
    return [list(TaskManager(include_path=str(folder), include_defaults=False).load(sorted(docs))["tasks"].values())
            for _ in range(2)]


@pytest.fixture(scope="module")
def served(engine, checkpoint, loaded_tasks):  # noqa: F811
    from srm_max.serve.http import create_app

    engine.warmup()
    gen = Generator.from_engine(engine, tokenizer=str(checkpoint / "tokenizer.json"))
    app = create_app(gen, model_name=MODEL, max_batch=4, steps_per_call=3, chat_template=TEMPLATE)
    with serving(app) as url:
        yield Served(url, gen)


def test_echo_with_max_tokens_0_scores_the_prompt(served):
    status, body = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 3})
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    want = served.generator.score(PROMPT, top_n=3)
    assert choice["text"] == PROMPT and "".join(lp["tokens"]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:], want.logprobs[1:], atol=1e-6)
    assert lp["text_offset"] == want.text_offset
    for i, top in enumerate(lp["top_logprobs"][1:], 1):
        chosen = served.generator.decode([want.ids[i]])
        assert top[chosen] == lp["token_logprobs"][i] and 3 <= len(top) <= 4  # the chosen token is always there
        assert max(top.values()) == pytest.approx(max(want.top_logprobs[i].values()), abs=1e-6)
    assert body["usage"]["completion_tokens"] == 0


def test_generated_tokens_carry_the_logprobs_of_generate(served):
    options = dict(max_tokens=8, temperature=0.8, seed=3)
    status, body = served.post("/v1/completions", {"prompt": PROMPT, "logprobs": 2} | options)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    want = served.generator.generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=3, logprobs=2)
    assert body["choices"][0]["token_ids"] == want.ids
    np.testing.assert_allclose(lp["token_logprobs"], want.logprobs.logprobs, atol=1e-6)
    # each token's text as it reads after the prompt (this tokenizer joins words with spaces)
    prompt_ids = served.generator.encode(PROMPT)
    after = served.generator.decode(prompt_ids + want.ids)[len(PROMPT):]
    assert lp["text_offset"][0] == len(PROMPT) and "".join(lp["tokens"]) == after
    # with echo: the prompt's tokens first, then the same completion
    status, echoed = served.post("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "echo": True} | options)
    elp = echoed["choices"][0]["logprobs"]
    assert echoed["choices"][0]["text"] == PROMPT + body["choices"][0]["text"]
    n = len(served.generator.encode(PROMPT))
    assert elp["token_logprobs"][n:] == lp["token_logprobs"] and elp["text_offset"][n:] == lp["text_offset"]


def test_streamed_chunks_carry_their_tokens_logprobs(served):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 8, "logprobs": 1, "echo": True}
    status, whole = served.post("/v1/completions", body)
    status, chunks = served.post("/v1/completions", body | {"stream": True})
    assert status == 200
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        assert len(lp["tokens"]) >= len(c["choices"][0]["token_ids"])
        for k in got:
            got[k] += lp[k]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert got == whole["choices"][0]["logprobs"]


def test_chat_logprobs_in_the_chat_shape(served):
    messages = [{"role": "user", "content": PROMPT}]
    status, body = served.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                        "logprobs": True, "top_logprobs": 2})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    want = served.generator.generate(PROMPT + " ", max_new_tokens=6, logprobs=2)
    assert [e["logprob"] for e in content] == pytest.approx(want.logprobs.logprobs, abs=1e-6)
    for e, ids in zip(content, want.logprobs.top_ids):
        assert [t["token"] for t in e["top_logprobs"]] == [served.generator.decode([i]) for i in ids]
        assert e["bytes"] == list(e["token"].encode())
    status, plain = served.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "logprobs": False})
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "w1", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "w1", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "w1", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "w1", "logprobs": "2"}, "logprobs"),
    ("/v1/completions", {"prompt": "w1", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_values_are_400_naming_the_parameter(served, path, body, param):
    status, answer = served.post(path, body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_lm_eval_local_completions_runs_every_request_type(served, checkpoint, tasks, loaded_tasks):  # noqa: F811
    """Every task's answers equal the native model's reading as many tokens: lm-eval's API
    models keep one of ``max_length`` for the generated token and score the echoed input."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    import srm_max.lm_eval_model  # noqa: F401

    os.environ.setdefault("OPENAI_API_KEY", "unused")
    n = TINY.context_length
    remote = evaluate("local-completions", f"base_url={served.url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={checkpoint},model={MODEL},max_length={n},num_concurrent=1,max_retries=1,"
                      "tokenized_requests=True", tasks, loaded_tasks[0])
    native = evaluate(srm_max.lm_eval_model.SRMMaxLM(generator=served.generator, max_length=n - 2), None, tasks,
                      loaded_tasks[1])
    _, docs = tasks
    for task in ("tiny_choice", "tiny_rolling", "tiny_until"):
        assert len(by_doc(remote, task)) == len(docs[task])
        for r, m, doc in zip(by_doc(remote, task), by_doc(native, task), docs[task]):
            if task == "tiny_until":
                # contexts cut alike (the API model leaves max_length - 1 - 6 tokens, the native n - 2 - 6)
                if len(doc["context"].split()) <= n - 2 - 6:
                    assert r["filtered_resps"] == m["filtered_resps"]
            else:
                np.testing.assert_allclose(np.array(r["filtered_resps"], dtype=float).ravel(),
                                           np.array(m["filtered_resps"], dtype=float).ravel(), atol=1e-4)
