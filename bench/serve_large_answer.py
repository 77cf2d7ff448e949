"""One large non-streamed answer from ``srm-max serve``, and how fast the server answers
others meanwhile.

    python -m bench.serve_large_answer [--n 512] [--max-tokens 500] [--logprobs 20] [--repeats 2]

The server runs in a child process with the embedded model (``bench.serve_load.start_server``).
Each repeat sends one /v1/completions request for ``--n`` samples of ``--max-tokens`` tokens
with ``echo`` and ``--logprobs`` alternatives per token (about 144 MB of JSON at the
defaults) from a thread, while the main thread asks GET /health again ``--poll-ms`` after
each answer until the large one has arrived. What the server does on its event loop while
it makes the large answer shows in /health's slowest latency. Writes
bench/results/serve_large_answer.json: per repeat the large answer's seconds and bytes, and
/health's polls, slowest, 99th-percentile and median latency.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.common import RESULTS, command_line, machine_info, write_json
from bench.serve_load import free_port, start_server

OUT = RESULTS / "serve_large_answer.json"


def health_latencies(url: str, while_alive: threading.Thread, poll_s: float) -> list[float]:
    """Seconds of each GET /health, asked again ``poll_s`` after each answer, while the thread runs."""
    seconds = []
    while while_alive.is_alive():
        t = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=600) as r:
            r.read()
        seconds.append(time.perf_counter() - t)
        time.sleep(poll_s)
    return seconds


def summarize(answer_s: float, answer_bytes: int, health_s: list[float]) -> dict:
    """One repeat: the large answer and /health's latencies meanwhile (milliseconds)."""
    if not health_s:
        raise ValueError("no /health answer was timed while the large answer was made")
    ms = np.asarray(health_s) * 1e3
    return {"answer_s": round(answer_s, 2), "answer_bytes": answer_bytes, "health_polls": len(ms),
            "health_slowest_ms": round(float(ms.max()), 1), "health_p99_ms": round(float(np.percentile(ms, 99)), 1),
            "health_median_ms": round(float(np.median(ms)), 1)}


def large_answer(url: str, body: dict, poll_s: float) -> dict:
    """One repeat: the large request from a thread, /health polled meanwhile."""
    got = {}

    def send():
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as r:
            got["bytes"] = len(r.read())
        got["seconds"] = time.perf_counter() - t

    sender = threading.Thread(target=send)
    sender.start()
    health = health_latencies(url, sender, poll_s)
    sender.join()
    if "bytes" not in got:
        raise RuntimeError("the large request failed (see the server's error output)")
    return summarize(got["seconds"], got["bytes"], health)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=512, help="samples in the one request")
    ap.add_argument("--max-tokens", type=int, default=500)
    ap.add_argument("--logprobs", type=int, default=20, help="alternatives per token (0-20)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--poll-ms", type=float, default=50.0, help="the pause after each /health answer")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    if min(args.n, args.max_tokens, args.repeats) < 1 or not 0 <= args.logprobs <= 20 or args.poll_ms < 0:
        ap.error("--n, --max-tokens and --repeats must be >= 1, --logprobs 0-20, --poll-ms >= 0")
    body = {"prompt": "Hi", "n": args.n, "max_tokens": args.max_tokens, "echo": True, "logprobs": args.logprobs,
            "temperature": 2.0, "seed": 1}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, max_batch=256, steps_per_call=8)
    try:
        repeats = []
        for _ in range(args.repeats):
            repeats.append(large_answer(url, body, args.poll_ms / 1e3))
            print(f"answer {repeats[-1]['answer_s']} s, {repeats[-1]['answer_bytes'] / 1e6:.0f} MB; /health "
                  f"{repeats[-1]['health_polls']} polls, slowest {repeats[-1]['health_slowest_ms']} ms, median "
                  f"{repeats[-1]['health_median_ms']} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    result = {"command": command_line(), "machine": machine_info(), "note": args.note,
              "model": "embedded (srm-max default model)", "request": body, "poll_ms": args.poll_ms,
              "repeats": repeats}
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
