"""``srm-max serve`` as a command: it binds its port before the model loads and prints the
URL only once the port listens (the port bound, with ``--port 0``); a host or port it cannot
bind is one line on stderr naming both, exit status 2; an explicit ``--max-batch`` above what
the device's memory holds is refused naming the option.

The engine here never runs (every route used answers without it): nothing compiles a graph.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.request

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from srm_max import Generator  # noqa: E402
from srm_max.cli import main  # noqa: E402
from srm_max.errors import GenerationError  # noqa: E402
from srm_max.serve.http.run import MAX_BATCH, SERVE_MAX_BATCH, max_batch_of  # noqa: E402
from srm_max.serve.sample_many import plan_max_batch  # noqa: E402
from tests.support.tiny import TINY  # noqa: E402
from tests.support.tokenizers import byte_level_tokenizer  # noqa: E402


class Unrun:
    """The engine of a server whose routes under test never run it: its config only."""

    config = TINY


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.delenv("SRM_MAX_API_KEY", raising=False)
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))


def cannot_listen(capsys, argv: list[str], host: str, port: int) -> str:
    assert main(["--quiet", "serve", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"srm-max serve: error: cannot listen on --host {host!r} --port {port}: "), err
    assert "http://" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("host", ["999.1.1.1", "no such host name", "a..b"])
def test_a_host_that_cannot_be_bound_is_one_line_before_the_model_loads(no_model, capsys, host):
    cannot_listen(capsys, ["--host", host, "--port", "0"], host, 0)


def test_a_busy_port_is_one_line_before_the_model_loads(no_model, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cannot_listen(capsys, ["--port", str(port)], "127.0.0.1", port)


def test_port_0_prints_the_port_bound_which_already_listens(monkeypatch, capsys):
    monkeypatch.delenv("SRM_MAX_API_KEY", raising=False)
    gen = Generator.from_engine(Unrun(), tokenizer=byte_level_tokenizer())
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda *a, **k: gen))
    run, seen = uvicorn.Server.run, {}

    def run_and_ask(server, sockets=None):
        # the URL is printed before uvicorn runs: a client that read it connects now and is
        # answered once uvicorn serves the socket
        seen["printed"] = capsys.readouterr().err
        seen["port"] = sockets[0].getsockname()[1]

        def ask():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{seen['port']}/v1/models", timeout=60) as r:
                    seen["models"] = json.loads(r.read())
            finally:
                server.should_exit = True

        asker = threading.Thread(target=ask)
        asker.start()
        run(server, sockets=sockets)
        asker.join()

    monkeypatch.setattr(uvicorn.Server, "run", run_and_ask)
    assert main(["--quiet", "serve", "--port", "0", "--model-name", "tiny", "--max-batch", "4"]) == 0
    assert seen["port"] != 0
    assert f"srm-max serve: tiny on http://127.0.0.1:{seen['port']}/v1 (max batch 4)" in seen["printed"]
    assert [m["id"] for m in seen["models"]["data"]] == ["tiny"]


def test_an_explicit_max_batch_above_what_memory_holds_is_refused():
    memory = 1 << 20
    fits = plan_max_batch(TINY, memory, max_batch=MAX_BATCH)
    assert 1 < fits < MAX_BATCH
    assert max_batch_of(str(fits), TINY, memory) == fits
    with pytest.raises(GenerationError, match=f"^--max-batch {fits + 1} does not fit the device's 1 MiB "
                                              f"of memory: at most {fits} samples"):
        max_batch_of(str(fits + 1), TINY, memory)
    assert max_batch_of("auto", TINY, memory) == min(SERVE_MAX_BATCH, plan_max_batch(TINY))  # auto: its own plan
