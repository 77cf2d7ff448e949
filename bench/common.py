"""Shared helpers of the benchmarks in ``bench/``.

Model builders at equal parameter counts (SRM, Llama-style Transformer, Mamba),
the fixed prompts, thread control, wall-clock timing, the verdict of an A/B timed in
interleaved rounds, machine facts, and the JSON + PNG writers. Every model is randomly
initialised: the benchmarks measure speed and memory, which depend only on shapes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from srm_max.runtime.cpu_target import host_x86_level

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

GiB = 1 << 30
MiB = 1 << 20


# ------------------------------------------------------------------ configs
def srm_config(d_model=256, n_layers=8, n_heads=4, context_length=1024, vocab_size=4096):
    from srm_max.models.srm.config import SRMConfig

    return SRMConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                     context_length=context_length)


def srm_matmul_params(config) -> int:
    """Parameters a decode step multiplies with: every matmul weight, the output layer
    included (the embedding is a gather, the mixer vectors are elementwise)."""
    d, f, L, V = config.d_model, config.ffn_dim, config.n_layers, config.vocab_size
    return L * (2 * d * f + d * d + d * d) + V * d


def num_params(model) -> int:
    return int(sum(p.numel() for p in model.parameters()))


# ------------------------------------------------------------------ builders
def build_srm_reference(config, seed: int = 0):
    """The PyTorch reference SRM, random weights with decays in [0.9, 1) and small biases."""
    from srm_max.reference.srm import random_srm

    return random_srm(config, seed, decay_low=0.9, bias_scale=0.02)


def srm_weights(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().float().numpy() for k, v in model.state_dict().items()}


def unfused_engine(config, weights, dtype: str = "float32"):
    """An SRM Engine with the Mojo mixer ops whose decode graph is plain MAX ops (matmuls,
    norms, adds) instead of the whole-step op of mojo/decode_step.mojo: the graph before it."""
    from srm_max.graphs.srm.decode import build_decode_graph
    from srm_max.models.srm import schema
    from srm_max.models.srm.build import GRAPH_SALT
    from srm_max.models.srm.engine import Engine
    from srm_max.runtime.compile_cache import load_compiled
    from srm_max.runtime.device import DTYPES
    from srm_max.runtime.kernels import kernel_library

    class Unfused(Engine):
        steps_in_one_op = False  # decode runs the unfused loop

        def _load(self, kind):
            if kind != "decode":
                return super()._load(kind)
            dt = "f32" if dtype == "float32" else "bf16"
            graph = build_decode_graph(self.config, schema, DTYPES[dtype], kernel_library=kernel_library(),
                                       name=f"srm_decode_{dt}_kernels_unfused")
            return load_compiled(self.session, graph, self.weights, graph_salt=GRAPH_SALT)

    return Unfused(config, weights, dtype, kernels=True)


def loop_engine(config, weights, dtype: str = "float32"):
    """The CPU SRM Engine, but decode runs its decode graph's loop (one whole-step op and
    MAX's sampler per step) instead of every step in one op."""
    from srm_max.models.srm.engine import Engine

    class Loop(Engine):
        steps_in_one_op = False

    return Loop(config, weights, dtype, kernels=True)


def llama_config_matching(config, torch_dtype=None):
    """A Llama (RoPE, SwiGLU MLP, RMSNorm, untied output) with the SRM's vocab, width,
    depth and heads; the MLP width is chosen so the parameter counts agree."""
    from transformers import LlamaConfig

    d, L, V = config.d_model, config.n_layers, config.vocab_size
    target = config.num_parameters()
    # Llama: 2 V d + L (4 d^2 + 3 d I + 2 d) + d
    inter = (target - 2 * V * d - d - L * (4 * d * d + 2 * d)) / (3 * d * L)
    inter = max(8, int(round(inter / 8)) * 8)
    kw = {}
    if torch_dtype is not None:
        kw["dtype"] = torch_dtype
    return LlamaConfig(
        vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads, intermediate_size=inter,
        max_position_embeddings=max(2048, config.context_length + 128), tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, **kw)


def build_llama(config, seed: int = 0, attn: str = "sdpa", torch_dtype=None, device="cpu"):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    lc = llama_config_matching(config)
    lc._attn_implementation = attn
    model = LlamaForCausalLM(lc).eval()
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    return model.to(device)


def mamba_config_matching(config):
    """A Mamba with the SRM's width and vocab (untied output); layers chosen to match params."""
    from transformers import MambaConfig

    d, V = config.d_model, config.vocab_size
    e = 2 * d  # expand 2
    rank = math.ceil(d / 16)
    state, kernel = 16, 4
    per_layer = (d * 2 * e + e * kernel + e + e * (rank + 2 * state) + rank * e + e
                 + e * state + e + e * d + d)
    layers = max(1, round((config.num_parameters() - 2 * V * d - d) / per_layer))
    return MambaConfig(vocab_size=V, hidden_size=d, num_hidden_layers=layers, state_size=state,
                       conv_kernel=kernel, expand=2, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=0)


def build_mamba(config, seed: int = 0):
    import torch
    from transformers import MambaForCausalLM

    torch.manual_seed(seed)
    return MambaForCausalLM(mamba_config_matching(config)).eval()


def quiet_transformers() -> None:
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging

        logging.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass


# ------------------------------------------------------------------ prompts
def fixed_prompts(batch: int, length: int, vocab: int, seed: int = 1234) -> np.ndarray:
    """[batch, length] int64 token ids; the same for every engine (ids 1 .. vocab-1)."""
    rng = np.random.default_rng(seed + 7919 * length)
    return rng.integers(1, vocab, size=(batch, length), dtype=np.int64)


# ------------------------------------------------------------------ threads, timing
def set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(int(n))


class Clock:
    """Wall-clock marks: start, first token (end of prefill), end."""

    def __init__(self):
        self.t0 = self.first = self.end = None

    def start(self):
        self.t0 = time.perf_counter()

    def mark_first(self):
        if self.first is None:
            self.first = time.perf_counter()

    def stop(self):
        self.end = time.perf_counter()

    @property
    def total(self) -> float:
        return self.end - self.t0

    @property
    def prefill(self) -> float:
        return (self.first or self.end) - self.t0


def rounds_verdict(ratios) -> dict:
    """The verdict of two things timed in interleaved rounds, from each round's ratio (above 1
    where the second thing, the change or the engine, came out ahead): the median of the
    ratios, and in how many of the rounds it was above 1. Ratios of timings seconds apart,
    not a ratio of bests minutes apart: a shared host's speed drifts by tens of percent over
    minutes, and both timings of a round share the drift."""
    ratios = list(ratios)
    if not ratios:
        raise ValueError("no rounds to summarize")
    return {"median": float(np.median(ratios)), "above_1": sum(r > 1 for r in ratios), "rounds": len(ratios)}


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": _cpu_model(),
        "x86_level": host_x86_level(),  # x86-64-v4: AVX-512; x86-64-v3: AVX2 + FMA; None elsewhere
        "mem_total_gib": round(_mem_total() / GiB, 1) if _mem_total() else None,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    for mod in ("max", "torch", "transformers", "numpy"):
        with contextlib.suppress(Exception):
            info[f"{mod}_version"] = __import__(mod).__version__
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _mem_total() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def matmul_flops(n: int = 2048, repeats: int = 5) -> dict:
    """float32 FLOP/s of a large square numpy matmul, best of ``repeats``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up (thread pool, pages)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return {"what": f"numpy float32 {n}x{n} matmul", "n": n, "repeats": repeats, "best_seconds": best,
            "flops": 2.0 * n ** 3 / best}


def matmul_flops_torch(n: int = 8192, device: str = "cuda", dtype: str = "bfloat16", repeats: int = 10) -> dict:
    """FLOP/s of a large square torch matmul on ``device`` (the GPU roofline), best of ``repeats``."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    a @ b
    best = math.inf
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return {"what": f"torch {dtype} {n}x{n} matmul on {device}", "n": n, "repeats": repeats,
            "best_seconds": best, "flops": 2.0 * n ** 3 / best}


def gpu_info() -> dict:
    out = {}
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out = {"gpu_name": p.name, "gpu_memory_gib": round(p.total_memory / GiB, 1),
                   "cuda_version": torch.version.cuda}
    return out


# ------------------------------------------------------------------ output
def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def write_json(path: Path, data: dict) -> Path:
    """Writes ``data`` to ``path`` atomically: an interrupted run leaves the old results."""
    from srm_max.files import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def sample_by_prompt_length(prompts: list[list[int]], n: int, max_batch: int, stop_id: int,
                            sample_batch) -> list[list[list[int]]]:
    """``n`` completions of every prompt, result[prompt][sample], each cut after its stop
    token: the rows grouped by prompt length (a batch needs no padding) in batches of at most
    ``max_batch``; ``sample_batch(rows)`` gets a batch's prompts (equal-length id lists) and
    returns each row's new ids (a list per row)."""
    by_length: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for p in range(len(prompts)):
        for s in range(n):
            by_length[len(prompts[p])].append((p, s))
    out: list[list[list[int]]] = [[[] for _ in range(n)] for _ in prompts]
    for _, group in sorted(by_length.items()):
        for start in range(0, len(group), max_batch):
            chunk = group[start:start + max_batch]
            new = sample_batch([prompts[p] for p, _ in chunk])
            for (p, s), row in zip(chunk, new):
                out[p][s] = row[: row.index(stop_id) + 1] if stop_id in row else row
    return out


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def plot_throughput(rows: list[dict], path: Path, title: str) -> Path | None:
    """tokens/s against batch, one line per engine (its best thread count), one column per
    prompt length; top row the whole generate, bottom row the decode phase."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    metrics = [("tokens_per_s", "generated tokens/s (whole generate)"),
               ("decode_tokens_per_s", "decode-phase tokens/s")]
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        for m, _ in metrics:
            if r.get(m) is None:
                continue
            k = (m, r["engine"], r["prompt_len"], r["batch"])
            if k not in best or r[m] > best[k][m]:
                best[k] = r
    prompts = sorted({k[2] for k in best})
    if not prompts:
        return None
    fig, axes = plt.subplots(2, len(prompts), figsize=(5 * len(prompts), 8), squeeze=False)
    engines = sorted({k[1] for k in best})
    for row, (m, label) in enumerate(metrics):
        for ax, p in zip(axes[row], prompts):
            for e in engines:
                pts = sorted((k[3], r[m]) for k, r in best.items() if k[0] == m and k[1] == e and k[2] == p)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=e)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            xs = sorted({k[3] for k in best if k[0] == m and k[2] == p})
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("batch")
            ax.set_ylabel(label)
            ax.set_title(f"prompt {p}")
            ax.grid(True, which="both", alpha=0.3)
        axes[row][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, float):
        if x >= 100:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return str(x)
