"""bench/serve_large_answer.py without a model: its /health polling and its summary (the
large answer from a running server is the benchmark: not here)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import serve_large_answer


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the standard library's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_health_is_polled_until_the_large_answer_has_arrived():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answer = threading.Thread(target=time.sleep, args=(0.3,))
        answer.start()
        seconds = serve_large_answer.health_latencies(f"http://127.0.0.1:{server.server_port}", answer, 0.02)
        assert not answer.is_alive() and 3 <= len(seconds) <= 16 and all(0 < s < 0.3 for s in seconds)
    finally:
        server.shutdown()


def test_a_repeat_is_summarized_in_milliseconds():
    s = serve_large_answer.summarize(12.345, 1000, [0.002, 0.004, 0.5])
    assert (s["answer_s"], s["answer_bytes"], s["health_polls"]) == (12.35, 1000, 3)
    assert (s["health_slowest_ms"], s["health_median_ms"]) == (500.0, 4.0)
    assert 4.0 < s["health_p99_ms"] <= 500.0
    with pytest.raises(ValueError, match="no /health answer"):
        serve_large_answer.summarize(1.0, 10, [])


@pytest.mark.parametrize("bad", [["--n", "0"], ["--logprobs", "21"], ["--poll-ms", "-1"], ["--repeats", "0"]])
def test_bad_options_are_refused_before_a_server_starts(bad):
    with pytest.raises(SystemExit) as e:
        serve_large_answer.main(bad)
    assert e.value.code == 2
