"""Load test of ``srm-max serve`` on loopback, against ``Generator.generate`` at the same batch.

    python -m bench.serve_load [--quick] [--clients 256] [--requests 2] [--max-tokens 64]

1. ``Generator.generate`` on the embedded model: one batch of ``--clients``
   prompts, ``--max-tokens`` new tokens each, sampled (the best of two runs before
   and two after the load test): the engine's tokens/s with no server in the way.
2. ``srm-max serve`` in a child process (so the clients do not share its
   interpreter), ``--max-batch`` = ``--clients``.
3. ``--clients`` concurrent streaming clients (a minimal HTTP/1.1 client on
   asyncio: light enough that hundreds of them leave the CPU to the server),
   each sending ``--requests`` requests one after the other.

Records requests/s, tokens/s, p50/p99 time to first token and inter-token latency
(the gap between two chunks spread over the tokens of the later one), the
server's tokens/s as a ratio of generate's, and the server's own metrics; writes
``bench/results/serve_load.json`` (``serve_load-quick.json`` with ``--quick``) and
a plot beside it. Both sides run on the same CPUs, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from bench.common import RESULTS, command_line, machine_info, write_json  # noqa: E402

PROMPTS = ["ROMEO:\n", "To be, or not to be, that is the question:\n", "KING HENRY:\nOnce more unto the breach,",
           "First Citizen:\nBefore we proceed any further, hear me speak.\n", "JULIET:\n", "HAMLET:\nO, that this",
           "MACBETH:\nIs this a dagger which I see before me,", "Enter the Duke, attended.\n"]
TEMPERATURE = 0.8


def prompts_for(clients: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(clients)]


# ------------------------------------------------------------------ the baseline
def measure_generate(gen, clients: int, max_tokens: int, times: list[float]) -> dict:
    """Two timed runs added to ``times``; the best of all runs so far (the machine may be shared)."""
    prompts = prompts_for(clients)
    gen.generate(prompts, max_new_tokens=4, temperature=TEMPERATURE, seed=0)  # warm-up
    for r in range(2):
        t = time.perf_counter()
        out = gen.generate(prompts, max_new_tokens=max_tokens, temperature=TEMPERATURE, seed=r)
        times.append(time.perf_counter() - t)
    tokens = sum(len(c.ids) for c in out)
    return {"batch": clients, "tokens": tokens, "steps_per_call": 8, "seconds": min(times), "times": times,
            "tokens_per_s": tokens / min(times)}


# ------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, max_batch: int, steps_per_call: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "srm_max.cli", "-q", "serve", "--port", str(port), "--max-batch", str(max_batch),
           "--max-waiting", str(max(1024, 2 * max_batch)), "--steps-per-call", str(steps_per_call)]
    env = os.environ | {"PYTHONPATH": str(ROOT / "python")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not come up")


def server_metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "_created" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# ------------------------------------------------------------------ the clients
async def one_request(port: int, body: dict) -> dict:
    """One streamed completion: when it was sent, when each chunk with tokens came, and how many."""
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    arrivals, counts, reason = [], [], None
    # each SSE event is one HTTP chunk: its "data:" line is whole, the chunk-size lines are skipped
    while line := await reader.readline():
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        choice = json.loads(data)["choices"][0]
        if choice["token_ids"]:
            arrivals.append(time.perf_counter())
            counts.append(len(choice["token_ids"]))
        reason = choice.get("finish_reason") or reason
    writer.close()
    return {"status": status, "start": t0, "arrivals": arrivals, "counts": counts, "reason": reason}


async def client(port: int, index: int, requests: int, max_tokens: int, prompt: str) -> list[dict]:
    out = []
    for r in range(requests):
        body = {"model": "srm-max", "prompt": prompt, "max_tokens": max_tokens, "temperature": TEMPERATURE,
                "seed": index * requests + r, "stream": True}
        out.append(await one_request(port, body))
    return out


async def load(port: int, clients: int, requests: int, max_tokens: int) -> tuple[list[dict], float]:
    prompts = prompts_for(clients)
    t = time.perf_counter()
    per_client = await asyncio.gather(*(client(port, i, requests, max_tokens, prompts[i]) for i in range(clients)))
    return [r for rs in per_client for r in rs], time.perf_counter() - t


def summarize(results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["arrivals"]]
    ttft = np.array([r["arrivals"][0] - r["start"] for r in ok])
    itl = np.array([(b - a) / k for r in ok
                    for a, b, k in zip(r["arrivals"], r["arrivals"][1:], r["counts"][1:]) for _ in range(k)])
    tokens = int(sum(sum(r["counts"]) for r in ok))
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else None  # noqa: E731
    return {"requests": len(results), "ok": len(ok), "seconds": seconds, "requests_per_s": len(ok) / seconds,
            "tokens": tokens, "tokens_per_s": tokens / seconds,
            "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99), "mean": float(ttft.mean()) if len(ttft) else None},
            "itl_s": {"p50": pct(itl, 50), "p99": pct(itl, 99), "mean": float(itl.mean()) if len(itl) else None},
            "_ttft": ttft, "_itl": itl}


def plot(summary: dict, baseline: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in (("time to first token", summary["_ttft"]), ("inter-token latency", summary["_itl"])):
        v = np.sort(values * 1000)
        a.plot(v, np.arange(1, len(v) + 1) / max(1, len(v)), label=name)
    a.set_xscale("log")
    a.set_xlabel("ms")
    a.set_ylabel("fraction")
    a.set_title("latency CDF")
    a.legend()
    b.bar(["Generator.generate", "srm-max serve"], [baseline["tokens_per_s"], summary["tokens_per_s"]],
          color=["tab:gray", "tab:blue"])
    b.set_ylabel("tokens/s")
    b.set_title(f"batch {baseline['batch']}: serve / generate = "
                f"{summary['tokens_per_s'] / baseline['tokens_per_s']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 clients, 1 request each, 32 tokens")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps-per-call", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.requests, args.max_tokens = 32, 1, 32
    out = args.out or RESULTS / ("serve_load-quick.json" if args.quick else "serve_load.json")

    from srm_max import Generator

    gen, times = Generator.from_pretrained(), []
    print(f"generate: batch {args.clients}, {args.max_tokens} tokens ...", flush=True)
    baseline = measure_generate(gen, args.clients, args.max_tokens, times)
    print(f"  {baseline['tokens_per_s']:.0f} tokens/s", flush=True)
    port = free_port()
    proc = start_server(port, args.clients, args.steps_per_call)
    try:
        asyncio.run(load(port, min(8, args.clients), 1, 4))  # warm-up: graphs loaded, connections made
        before = server_metrics(port)
        print(f"serve: {args.clients} clients x {args.requests} requests ...", flush=True)
        results, seconds = asyncio.run(load(port, args.clients, args.requests, args.max_tokens))
        after = server_metrics(port)
    finally:
        proc.terminate()
        proc.wait(30)
    baseline = measure_generate(gen, args.clients, args.max_tokens, times)  # again, after: the best of both
    summary = summarize(results, seconds)
    engine_calls = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("srm_engine_calls_total")}
    result = {
        "command": command_line(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": "embedded (srm-max default model)", "temperature": TEMPERATURE,
        "generate": baseline,
        "serve": {k: v for k, v in summary.items() if not k.startswith("_")},
        "serve_over_generate": summary["tokens_per_s"] / baseline["tokens_per_s"],
        "server_engine_calls": engine_calls,
    }
    write_json(out, result)
    png = plot(summary, baseline, out.with_suffix(".png"))
    s = result["serve"]
    print(f"  {s['ok']}/{s['requests']} ok, {s['requests_per_s']:.1f} requests/s, {s['tokens_per_s']:.0f} tokens/s "
          f"({result['serve_over_generate']:.2f} x generate)")
    print(f"  TTFT p50 {s['ttft_s']['p50'] * 1000:.0f} ms, p99 {s['ttft_s']['p99'] * 1000:.0f} ms; "
          f"inter-token p50 {s['itl_s']['p50'] * 1000:.1f} ms, p99 {s['itl_s']['p99'] * 1000:.1f} ms")
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0 if s["ok"] == s["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
