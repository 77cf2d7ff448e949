"""Load test of ``srm-max serve`` on loopback, against ``Generator.generate`` at the same batch.

    python -m bench.serve_load [--quick] [--clients 256] [--requests 2] [--max-tokens 64] [--steps-per-call 8]

1. ``Generator.generate`` on the embedded model: one batch of ``--clients``
   prompts, ``--max-tokens`` new tokens each, sampled, ``--steps-per-call`` decode
   steps per engine call: the engine's tokens/s with no server in the way.
2. ``srm-max serve`` in a child process (so the clients do not share its
   interpreter), ``--max-batch`` = ``--clients``, the same ``--steps-per-call``.
3. A load run: ``--clients`` concurrent streaming clients, each sending
   ``--requests`` requests one after the other. A client is a plain asyncio
   protocol on its connection (``StreamedCompletion``): it sends the request, and
   from each read it counts the token ids of every complete ``data:`` event and
   notes the read's time; it does not parse the JSON. So the clients cost the
   shared CPUs little, and the server is what is measured.

Generate runs and ``--repeats`` load runs alternate (G L G L ... G), the server
frozen (SIGSTOP) while generate runs, so that both see the same machine even when
it is shared and its speed drifts: each load run's ratio is its tokens/s over the
mean of the generate runs just before and after it, and the result is the load
run with the median ratio. Records requests/s, tokens/s, p50/p99 time to first
token and inter-token latency (the gap between two chunks spread over the tokens
of the later one), the ratio, the server's engine calls, and where the CPU time
of a load run went: the server's event loop (HTTP, JSON, SSE), its other threads
(the engine loop and the engine's workers), and the clients. Writes
``bench/results/serve_load.json`` (``serve_load-quick.json`` with ``--quick``) and
a plot beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
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
def generate_tokens_per_s(gen, clients: int, max_tokens: int, steps_per_call: int, seed: int) -> float:
    """One timed ``generate`` of the benchmark's batch."""
    t = time.perf_counter()
    out = gen.generate(prompts_for(clients), max_new_tokens=max_tokens, temperature=TEMPERATURE, seed=seed,
                       steps_per_call=steps_per_call)
    return sum(len(c.ids) for c in out) / (time.perf_counter() - t)


@contextmanager
def frozen(proc: subprocess.Popen):
    """The server stopped (SIGSTOP) while the baseline runs, where POSIX signals exist."""
    if not hasattr(signal, "SIGSTOP"):
        yield
        return
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


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


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of process ``pid``: its main thread (the server's
    event loop) and all its other threads (Linux /proc; empty elsewhere)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {"main_thread": 0.0, "other_threads": 0.0}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out["main_thread" if int(t) == pid else "other_threads"] += (int(fields[11]) + int(fields[12])) / tick
    return out


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
class StreamedCompletion(asyncio.Protocol):
    """One streamed completion read straight off its connection (no stream reader, no
    task wake-up per chunk, no JSON parsing): it records the status, when each event
    with tokens arrived (the time of the read that completed it) and how many token
    ids it carried, and the last finish reason. It relies on what the server's
    events are: one compact JSON object per ``data:`` line, its ``token_ids`` the last
    array (a quote inside the text is escaped, so the markers below cannot occur in it)."""

    def __init__(self, request: bytes):
        self.request, self.buffer = request, b""
        self.status, self.arrivals, self.counts, self.reason = None, [], [], None
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        lines = (self.buffer + data).split(b"\n")
        self.buffer = lines.pop()
        for line in lines:
            if self.status is None:
                self.status = int(line.split()[1])
            elif line.startswith(b"data: "):
                self._event(line.rstrip(), now)

    def _event(self, line: bytes, now: float) -> None:
        if line == b"data: [DONE]":
            self._finish()
            return
        ids = line[line.rindex(b'"token_ids":[') + 13: line.rindex(b"]")]
        if ids:
            self.arrivals.append(now)
            self.counts.append(ids.count(b",") + 1)
        at = line.find(b'"finish_reason":"')
        if at >= 0:
            self.reason = line[at + 17: line.index(b'"', at + 17)].decode()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        self.transport.close()

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def one_request(port: int, body: dict) -> dict:
    """One streamed completion: when it was sent, when each event with tokens came, and how many."""
    payload = json.dumps(body).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    t0 = time.perf_counter()
    _, stream = await asyncio.get_running_loop().create_connection(lambda: StreamedCompletion(request),
                                                                   "127.0.0.1", port)
    await stream.done
    return {"status": stream.status, "start": t0, "arrivals": stream.arrivals, "counts": stream.counts,
            "reason": stream.reason}


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
    b.set_title(f"batch {baseline['batch']}, {baseline['steps_per_call']} steps per call: serve / generate = "
                f"{summary['tokens_per_s'] / baseline['tokens_per_s']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def load_run(port: int, pid: int, args) -> dict:
    """One load run: its summary, the server's engine calls and where the CPU time went."""
    before, cpu0, own0 = server_metrics(port), cpu_seconds(pid), os.times()
    results, seconds = asyncio.run(load(port, args.clients, args.requests, args.max_tokens))
    after, cpu1, own1 = server_metrics(port), cpu_seconds(pid), os.times()
    summary = summarize(results, seconds)
    summary["engine_calls"] = {k.split('"')[1]: after[k] - before.get(k, 0) for k in after
                               if k.startswith("srm_engine_calls_total")}
    summary["cpu_s"] = {"server_event_loop": cpu1.get("main_thread", 0) - cpu0.get("main_thread", 0),
                        "server_engine_threads": cpu1.get("other_threads", 0) - cpu0.get("other_threads", 0),
                        "clients": own1.user + own1.system - own0.user - own0.system}
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 clients, 1 request each, 32 tokens")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after the other")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps-per-call", type=int, default=8, help="decode steps per engine call, both sides")
    ap.add_argument("--repeats", type=int, default=3, help="load runs, each between two generate runs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.clients, args.requests, args.max_tokens = 32, 1, 32
    if min(args.clients, args.requests, args.max_tokens, args.steps_per_call, args.repeats) < 1:
        ap.error("--clients, --requests, --max-tokens, --steps-per-call and --repeats must be >= 1")
    out = args.out or RESULTS / ("serve_load-quick.json" if args.quick else "serve_load.json")

    from srm_max import Generator

    gen = Generator.from_pretrained()
    gen.generate(prompts_for(args.clients), max_new_tokens=4, temperature=TEMPERATURE, seed=0)  # warm-up

    def baseline_run() -> float:
        tps = generate_tokens_per_s(gen, args.clients, args.max_tokens, args.steps_per_call, len(generate))
        print(f"generate: batch {args.clients}, {args.max_tokens} tokens, {args.steps_per_call} steps per call: "
              f"{tps:.0f} tokens/s", flush=True)
        return tps

    generate, runs = [], []
    generate.append(baseline_run())
    port = free_port()
    proc = start_server(port, args.clients, args.steps_per_call)
    try:
        asyncio.run(load(port, min(8, args.clients), 1, 4))  # warm-up: graphs loaded, connections made
        for i in range(args.repeats):
            runs.append(load_run(port, proc.pid, args))
            print(f"serve: {args.clients} clients x {args.requests} requests: {runs[-1]['tokens_per_s']:.0f} "
                  f"tokens/s, CPU seconds {runs[-1]['cpu_s']}", flush=True)
            with frozen(proc):
                generate.append(baseline_run())
    finally:
        proc.terminate()
        proc.wait(30)
    ratios = [r["tokens_per_s"] / ((generate[i] + generate[i + 1]) / 2) for i, r in enumerate(runs)]
    median = sorted(range(len(runs)), key=ratios.__getitem__)[(len(runs) - 1) // 2]
    summary = runs[median]
    baseline = {"batch": args.clients, "max_tokens": args.max_tokens, "steps_per_call": args.steps_per_call,
                "tokens_per_s": (generate[median] + generate[median + 1]) / 2, "runs_tokens_per_s": generate}
    result = {
        "command": command_line(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": "embedded (srm-max default model)", "temperature": TEMPERATURE,
        "client": "asyncio protocol per connection: counts the token ids of each data: event, no JSON parsing",
        "ratio": "a load run's tokens/s over the mean of the generate runs before and after it; the median run",
        "generate": baseline,
        "serve": {k: v for k, v in summary.items() if not k.startswith("_")},
        "serve_runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
        "serve_runs_over_generate": ratios,
        "serve_runs_cpu_s": [r["cpu_s"] for r in runs],
        "serve_over_generate": ratios[median],
    }
    write_json(out, result)
    png = plot(summary, baseline, out.with_suffix(".png"))
    s = result["serve"]
    print(f"  {s['ok']}/{s['requests']} ok, {s['requests_per_s']:.1f} requests/s, {s['tokens_per_s']:.0f} tokens/s "
          f"({result['serve_over_generate']:.2f} x generate at {baseline['tokens_per_s']:.0f}; all runs: "
          f"{', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  TTFT p50 {s['ttft_s']['p50'] * 1000:.0f} ms, p99 {s['ttft_s']['p99'] * 1000:.0f} ms; "
          f"inter-token p50 {s['itl_s']['p50'] * 1000:.1f} ms, p99 {s['itl_s']['p99'] * 1000:.1f} ms")
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return 0 if all(r["ok"] == r["requests"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
