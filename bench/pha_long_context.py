"""PHA at long context on the MAX engines against llama.cpp: the PHA, the same model
without its GSS branch (attention alone) and the SRM, at contexts 512 .. 8,192
(docs/pha_engine.md). ``--models pha-gss pha-ffn``: the PHA without its attention, and
with its FFNs alone, for what each branch costs (``--prefill-lengths`` per chunk of tokens).

Per model and context n (each engine built at context n, random weights: speed and
memory depend only on shapes):
  - decode state bytes per sample (the engine's state tensor for one sample),
  - prefill tokens/s at batch 1 (one prompt of n tokens) on each of ``--paths``: "op", the
    engine's default on a CPU, whose attention is one tiled Mojo op
    (mojo/pha_prefill_attention.mojo), and "graph", plain ops with a [T, T] score matrix,
  - decode tokens/s at batch 1 and 16: ``--steps`` tokens per call from states at
    position n - steps - 1 (zero states from ``empty_states``: a step's cost does not
    depend on what the state holds), for the PHA models on each ``--paths``: "op", every
    step of a call in one Mojo op (mojo/pha_decode_step.mojo, the engine's default on a
    CPU), and "graph", one plain-op decode graph call per step (graphs/pha/decode.py);
    each in every weight dtype of ``--dtypes`` (float32 by default; bfloat16 halves the
    matrices' bytes, the states stay float32);
  - against the memory-streaming limit: the bytes a step must read (every matrix it
    multiplies by once per call, i.e. 1 / steps of them per step; per sample its GSS
    state, read and written, and the KV rows before its position) over the read
    bandwidth measured in the same run (the best 2-thread torch sum over a 256 MiB
    array, before and after each context's engines): ``percent_of_streaming_b{B}``;
  - against what a step touches: a token depends on the one before, so every step
    multiplies by every matrix again; the matrices each step at the best 2-thread
    re-read bandwidth of an array of their size (served from the last-level cache where
    it fits), plus the per-sample state at the streaming bandwidth:
    ``percent_of_reread_b{B}``; with ``--donated`` also for the decode into the states
    themselves (the slot pool's calls, and llama.cpp's: no copy of the caches per call):
    ``donated_percent_of_streaming_b{B}``, ``donated_percent_of_reread_b{B}``; the JSON's
    ``streaming_target`` puts each cell's share of the streaming limit beside the shares a
    step at the re-read limit would reach and one reading all it touches at the matrices'
    re-read rate (a floor no step beats);
  - with ``--refill``, what the slot pool pays when one row of a batch of B finishes and a
    fresh prompt's state takes its place (the engine's ``regroup``): the B - 1 kept rows and
    the fresh one gathered into a new batch on the device (``refill_ms_b{B}``, the refill when
    rows move), and the fresh row written into the donated states in the finished row's slot
    (``refill_in_place_ms_b{B}``, the slot pool's refill when the new rows fill every freed
    slot, on a CPU), beside a decode step;
  - against the FMA peak measured in the same run (bench/fma_peak.py): the FLOPs a
    prefill of one n-token prompt must do (``prefill_flops``: every matrix once per token,
    the output head once, the attention's causal scores and weighted values; the GSS scan's
    own arithmetic left out, so a lower bound for the PHA) over its time and the peak:
    ``prefill_percent_of_fma_peak``; llama.cpp's prompt the same way
    (``llama_cpp_prefill_flops``), and ``prefill_per_flop``: the prefill ratio to llama.cpp
    times the ratio of the FLOPs per prompt, above 1 where the engine does its FLOPs faster;
  - llama.cpp (bench/pha_llama_cpp.py): a Llama of the attention branch's shape, f32
    GGUF, ``llama-batched-bench`` on both cores at the same contexts and batches (prompt
    n - steps tokens, then ``steps`` decode steps), and the PHA's ratios to it; timed at
    each context right after the MAX engines; with ``--paired-rounds R``, also each engine's
    prefill against llama.cpp's prompt and its decode into the states against llama.cpp's
    at each batch in R rounds of timings seconds apart, the order alternating
    (``paired_prefill``, ``paired_decode``: a verdict the host's drift does not move).
Every timing is run ``--repeats`` times after one warm-up; the JSON keeps every run
(``*_runs``), the best, and the spread (slowest / fastest - 1). Graphs are compiled (or
loaded from the cache) before anything is timed, per context (the KV cache length is a
static shape). ``--append`` adds this run to the JSON's earlier ones (a run of other
contexts or parts), each with its own machine load. Writes
bench/results/pha_long_context[-quick].json.

    python -m bench.pha_long_context            # d 256, 4 blocks, contexts 512, 2048, 8192
    python -m bench.pha_long_context --quick    # d 64, 2 blocks, context 128: a smoke run
    python -m bench.pha_long_context --state-only   # state bytes only: no compile, no timing
    python -m bench.pha_long_context --models pha --no-prefill --no-llama-cpp --paths op graph
    python -m bench.pha_long_context --no-decode --batches 1 --paths op graph   # prefill against llama.cpp
    python -m bench.pha_long_context --no-decode --batches 1 --paired-rounds 10 --contexts 512   # drift-proof
    python -m bench.pha_long_context --no-prefill --paired-rounds 6 --contexts 512 2048   # decode, drift-proof
    python -m bench.pha_long_context --summarize    # the comparisons recomputed from the JSON's runs
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from bench import pha_llama_cpp
from bench.fma_peak import fma_peak
from bench.common import RESULTS, command_line, machine_info, rounds_verdict, write_json  # noqa: E402

MODELS = ("pha", "pha-attn", "pha-gss", "pha-ffn", "srm")
# the PHA's blocks with some branches left out: what each branch costs
BRANCHES = {"pha-attn": ("attn", "ffn"), "pha-gss": ("gss", "ffn"), "pha-ffn": ("ffn",)}
PATHS = ("op", "graph")
STREAM_BYTES = 256 << 20  # far beyond the caches


def configs(name: str, n: int, quick: bool):
    from srm_max.models.pha.config import PHAConfig
    from srm_max.models.srm.config import SRMConfig

    d, layers, vocab = (64, 2, 512) if quick else (256, 4, 4096)
    # PHA: the paper's block (GSS + GQA + Dual-FFN), PHAConfig defaults (F 4d, H d/4, N 512
    # or 64 in quick mode); pha-attn, pha-gss, pha-ffn: the same with fewer branches (BRANCHES).
    pha = dict(vocab_size=vocab, d_model=d, n_layers=layers, context_length=n, n_q_heads=4, n_kv_heads=2,
               dss_state_size=64 if quick else 512)
    if name == "pha":
        return PHAConfig(**pha)
    if name in BRANCHES:
        return PHAConfig(**pha, branches=BRANCHES[name])
    return SRMConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=4, context_length=n)


def engine_of(name: str, config, path: str = "op", dtype: str = "float32"):
    """A MAX engine with random weights (the PyTorch references' initialisation); a PHA
    one decodes on ``path`` (see the module docs) with ``dtype`` weights."""
    import torch

    if name == "srm":
        from srm_max.models.srm.engine import Engine
        from srm_max.reference.srm import random_srm

        model = random_srm(config, 0, decay_low=0.9, bias_scale=0.02)
        return Engine(config, {k: v.detach().float().numpy() for k, v in model.state_dict().items()}, dtype=dtype)
    from srm_max.models.pha.engine import PHAEngine
    from srm_max.reference.pha import PHA

    torch.manual_seed(0)
    weights = {k: v.detach().float().numpy() for k, v in PHA(config).state_dict().items()}
    # "op": the engine's default on a CPU
    engine = PHAEngine(config, weights, dtype=dtype, device="cpu", kernels=None if path == "op" else False)
    assert engine.steps_in_one_op == (path == "op")
    return engine


def weight_bytes_of(dtype: str) -> int:
    """Bytes per matrix element of an engine's weight dtype (``--dtypes``)."""
    from srm_max.runtime.device import DTYPES

    return DTYPES[dtype].size_in_bytes


def matrix_bytes(name: str, config, weight_bytes: int = 4) -> int:
    """Bytes of every matrix a decode step multiplies by, ``weight_bytes`` each (4: float32,
    2: bfloat16; the output head included, the embedding row is a gather)."""
    c = config
    if name == "srm":
        d, f, L, V = c.d_model, c.ffn_dim, c.n_layers, c.vocab_size
        return weight_bytes * (L * (2 * d * f + 2 * d * d) + V * d)
    per_block = sum(d["N"] * d["K"] for d in dense_layers(c))
    return weight_bytes * (c.n_layers * per_block + c.vocab_size * c.d_model)


def dense_layers(config) -> list[dict]:
    """A PHA block's matrices as its prefill graph multiplies by them: name, outputs N, inputs
    K, the activation its product applies (the linear op's: 0 none, 1 the GELU), whether it
    multiplies by u (the GSS gate, ``linear(..., times=u)``) and whether the last block
    applies it to every row (``every_row``: what the state needs; the rest it applies at the
    last token alone, graphs/pha/prefill.py ``pha_layers``' ``out_at``: in parallel mode all
    but the GSS's DSS input and attention's queries, keys and values, in sequential mode the
    FFNs, which come after the branches that carry state)."""
    c = config
    E, F, H = c.d_model, c.gss_expansion_dim, c.gss_hidden_dim
    dq, dk = c.n_q_heads * c.head_dim, c.n_kv_heads * c.head_dim
    whole = c.mode != "parallel"  # the branches with a state run on every row in sequential mode
    layers = []
    if "gss" in c.branches:
        layers += [dict(name="gss.to_u", N=F, K=E, act=1, times_u=False, every_row=whole),
                   dict(name="gss.to_v", N=H, K=E, act=1, times_u=False, every_row=True),
                   dict(name="gss.to_gate", N=F, K=H, act=0, times_u=True, every_row=whole),
                   dict(name="gss.to_out", N=E, K=F, act=0, times_u=False, every_row=whole)]
    if "attn" in c.branches:
        layers += [dict(name=f"attn.{m}_proj", N=n, K=k, act=0, times_u=False, every_row=m != "o" or whole)
                   for m, n, k in (("q", dq, E), ("k", dk, E), ("v", dk, E), ("o", E, dq))]
    for i, f in enumerate(c.ffn_dims):
        layers += [dict(name=f"ffn_{i}.fc", N=f, K=E, act=1, times_u=False, every_row=False),
                   dict(name=f"ffn_{i}.proj", N=E, K=f, act=0, times_u=False, every_row=False)]
    return layers


def attention_flops(config, n: int, last_query_only: bool = False) -> float:
    """One PHA block's causal attention over a prompt of n tokens: the scores and the
    weighted values, n (n + 1) / 2 rows each per query head (0 without the branch); with
    ``last_query_only`` (a prefill's last block) the last token's query alone, n rows."""
    c = config
    rows = n if last_query_only else n * (n + 1) / 2
    return 4.0 * c.n_q_heads * c.head_dim * rows if "attn" in c.branches else 0.0


def sample_bytes(name: str, config, position: int) -> int:
    """float32 bytes one sample's step reads of its state at ``position``: the SRM's and
    the GSS state read and written, the KV rows before it."""
    c = config
    if name == "srm":
        return 4 * 2 * c.n_layers * c.d_model
    gss = 2 * c.gss_hidden_dim * c.dss_state_size if "gss" in c.branches else 0  # real and imaginary parts
    kv = 2 * c.n_kv_heads * min(position, c.context_length) * c.head_dim if "attn" in c.branches else 0
    return 4 * c.n_layers * (2 * gss + kv)


def step_bytes(name: str, config, batch: int, start: int, steps: int, weight_bytes: int = 4) -> float:
    """The bytes one step of a ``steps``-step call from ``start`` must read: the matrices
    once per call, each sample's state every step (KV rows before start .. start + steps - 1)."""
    per_sample = sum(sample_bytes(name, config, start + s) for s in range(steps)) / steps
    return matrix_bytes(name, config, weight_bytes) / steps + batch * per_sample


def reread_step_bytes(name: str, config, batch: int, start: int, steps: int, weight_bytes: int = 4) -> float:
    """The bytes one step reads when it multiplies by every matrix again (a token needs the
    one before; ``reread_limit_ms``), and each sample's state, averaged over the call."""
    per_sample = sum(sample_bytes(name, config, start + s) for s in range(steps)) / steps
    return matrix_bytes(name, config, weight_bytes) + batch * per_sample


def llama_cpp_step_bytes(config, batch: int, start: int, steps: int, parameters: int) -> float:
    """The same for llama.cpp's Llama of ``config``'s attention shape: its ``parameters``
    float32 matrices every step (the tied embedding read whole as the output head) and
    each sequence's float16 keys and values of the rows before, averaged over the steps."""
    c = config
    kv_row = 2 * 2 * c.n_layers * c.n_kv_heads * c.head_dim  # keys and values, 2 bytes each
    return 4 * parameters + batch * sum(kv_row * (start + s) for s in range(steps)) / steps


def prefill_flops(name: str, config, n: int) -> float:
    """The FLOPs of the products a prefill of one ``n``-token prompt must do: every matrix
    a decode step multiplies by (``matrix_bytes``) once per token, but the output head once
    (a prefill's logits are its last token's) and, in the PHA's last block, the matrices
    whose output only the last token's logits read once too (``dense_layers``' every_row),
    and the attention's scores and weighted values over the causal rows, n (n + 1) / 2 per
    query head and block, but the last token's query alone in the last block. The GSS
    scan's own arithmetic and the SRM's token mixing are left out: a lower bound for those
    models."""
    c = config
    head = c.vocab_size * c.d_model
    if name == "srm":
        return 2.0 * ((matrix_bytes(name, c, 1) - head) * n + head)
    last_token_only = sum(d["N"] * d["K"] for d in dense_layers(c) if not d["every_row"])
    flops = 2.0 * ((matrix_bytes(name, c, 1) - head) * n + head - last_token_only * (n - 1))
    return flops + (c.n_layers - 1) * attention_flops(c, n) + attention_flops(c, n, last_query_only=True)


def llama_cpp_prefill_flops(config, tokens: int, parameters: int) -> float:
    """The same for llama.cpp's Llama of ``config``'s attention shape and ``parameters``
    (its tied embedding, the output head, once: ``llama-batched-bench`` asks for the
    logits of each sequence's last prompt token only, and its last layer's FFN runs on
    that token's row alone, the rows ``inp_out_ids`` keeps)."""
    c = config
    head = c.vocab_size * c.d_model
    ffn = 3 * c.d_model * pha_llama_cpp.llama_config(c).intermediate_size  # gate, up and down
    macs = ((parameters - head) * tokens + head - ffn * (tokens - 1)
            + c.n_layers * c.n_q_heads * c.head_dim * tokens * (tokens + 1))
    return 2.0 * macs


def read_bytes_per_s(nbytes: int, repeats: int) -> float:
    """The best read bandwidth of ``repeats`` 2-thread torch sums over one ``nbytes`` array."""
    import torch

    torch.set_num_threads(2)
    a = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = max(best, 4 * a.numel() / (time.perf_counter() - t))
    return best


def stream_bytes_per_s(repeats: int = 5) -> float:
    """The streaming bandwidth: an array of STREAM_BYTES, far beyond the caches."""
    return read_bytes_per_s(STREAM_BYTES, repeats)


def reread_bytes_per_s(nbytes: int, repeats: int = 20) -> float:
    """The bandwidth of reading the same ``nbytes`` again and again (a decode step's
    matrices: cache-resident if they fit; the first sums bring them in)."""
    return read_bytes_per_s(nbytes, repeats)


def reread_key(name: str, dtype: str) -> str:
    """The key of a model's matrices in a run's ``reread_bytes_per_s`` (per context)."""
    return f"{name}/{dtype}"


def reread_limit_ms(bytes_per_step: float, matrix_bytes: int, steps: int, reread: float, stream: float) -> float:
    """The fewest milliseconds a step can take when it multiplies by every matrix again
    (at the ``reread`` bandwidth) and reads its samples' state (``bytes_per_step``
    less the matrices' 1 / ``steps`` share, at the ``stream`` bandwidth)."""
    return 1e3 * (matrix_bytes / reread + (bytes_per_step - matrix_bytes / steps) / stream)


def percent_of_peak(flops: float, seconds: float, peak: dict) -> float:
    """``flops`` done in ``seconds`` as a percentage of the FMA ``peak`` (``fma_peak``:
    every core, per CPU-second)."""
    return 100 * flops / seconds / peak["flops"]


def graphs_used(engine, prefill: bool = True, decode: bool = True, refill: bool = False) -> list:
    """The graphs ``measure`` loads: prefill, the one a greedy decode runs, and with
    ``refill`` the regroup (each cold compile takes minutes here, so the sampler graph and
    the unused decode are left out)."""
    greedy = "decode_steps" if engine.steps_in_one_op else "decode"
    return ([engine.graph_job("prefill")] if prefill else []) + ([engine.graph_job(greedy)] if decode else []) \
        + ([engine.graph_job("regroup")] if refill else [])


def timed(repeats: int, run) -> list[float]:
    """Seconds of ``repeats`` calls of ``run`` after a warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def spread(values: list[float]) -> float:
    """Slowest over fastest, minus 1."""
    return max(values) / min(values) - 1


def measure(name: str, engine, n: int, steps: int, batches, repeats: int, rng, timed_run: bool = True,
            prefill: bool = True, path: str = "op", start: int | None = None, donated: bool = False,
            prefill_lengths=(), refill: bool = False) -> dict:
    """One row: state size, prefill and decode timings; decode calls from position
    ``start`` (default n - steps - 1: the last steps before the context's end), on a copy
    of the states and, with ``donated``, also into the states themselves; with
    ``prefill_lengths``, also the prefill of one prompt of each of those lengths (what a
    prefill costs whatever its length, and per chunk of tokens); with ``refill``, the
    regroup of a batch of B whose first row is replaced by a fresh state."""
    from srm_max.runtime.call_types import SamplingArrays

    c = engine.config
    start = n - steps - 1 if start is None else start
    row = {"model": name, "path": path, "dtype": engine.dtype, "context": n, "decode_from": start,
           "state_bytes_per_sample": int(engine.host(engine.empty_states(1)).nbytes)}
    if not timed_run:
        return row
    if prefill:
        prompt = [rng.integers(0, c.vocab_size, n).tolist()]
        runs = timed(repeats, lambda: engine.prefill(prompt))
        for length in prefill_lengths:
            short = [rng.integers(0, c.vocab_size, length).tolist()]
            row[f"prefill_seconds_t{length}"] = min(timed(repeats, lambda: engine.prefill(short)))
        row |= {"prefill_seconds_runs": runs, "prefill_seconds": min(runs), "prefill_spread": spread(runs),
                "prefill_tokens_per_s": n / min(runs), "prefill_flops": prefill_flops(name, c, n)}
    for B in batches:
        ids = rng.integers(0, c.vocab_size, B).astype(np.int64)
        pos = np.full(B, start, np.int64)
        states = engine.empty_states(B)
        greedy = SamplingArrays.greedy(B)
        runs = timed(repeats, lambda: engine.decode(ids, pos, states, greedy, steps))
        row[f"step_ms_runs_b{B}"] = [1e3 * t / steps for t in runs]
        row[f"step_ms_b{B}"] = 1e3 * min(runs) / steps
        row[f"spread_b{B}"] = spread(runs)
        row[f"decode_tokens_per_s_b{B}"] = B * steps / min(runs)
        row[f"bytes_per_step_b{B}"] = int(step_bytes(name, c, B, start, steps, weight_bytes_of(engine.dtype)))
        row[f"reread_bytes_per_step_b{B}"] = int(reread_step_bytes(name, c, B, start, steps,
                                                                    weight_bytes_of(engine.dtype)))
        if donated:  # as the slot pool decodes: into its own states, no copy of the caches per call
            runs = timed(repeats, lambda: engine.decode(ids, pos, states, greedy, steps, donate_states=True))
            row[f"donated_step_ms_runs_b{B}"] = [1e3 * t / steps for t in runs]
            row[f"donated_step_ms_b{B}"] = 1e3 * min(runs) / steps
            row[f"donated_spread_b{B}"] = spread(runs)
            row[f"donated_decode_tokens_per_s_b{B}"] = B * steps / min(runs)
        if refill:  # rows 1 .. B-1 kept, the fresh row last: what the slot pool asks when row 0 finishes
            fresh = engine.empty_states(1)
            runs = timed(repeats, lambda: engine.regroup(states, fresh, list(range(1, B)) + [B]))
            row[f"refill_ms_runs_b{B}"] = [1e3 * t for t in runs]
            row[f"refill_ms_b{B}"] = 1e3 * min(runs)
            row[f"refill_spread_b{B}"] = spread(runs)
            runs = timed(repeats, lambda: engine.regroup(states, fresh, [B] + list(range(1, B)), donate_pool=True))
            row[f"refill_in_place_ms_runs_b{B}"] = [1e3 * t for t in runs]
            row[f"refill_in_place_ms_b{B}"] = 1e3 * min(runs)
    return row


def llama_cpp_rows(contexts, batches, steps: int, repeats: int, workdir: Path, pha_config_of,
                   threads: int = 2) -> list[dict]:
    """llama.cpp's same-shape Llama at each context: best decode and prompt tokens/s of
    ``repeats`` runs, per batch, every run kept."""
    binary = pha_llama_cpp.build()
    rows = []
    for n in contexts:
        gguf, params = pha_llama_cpp.write_gguf(pha_config_of(n), workdir / str(n))
        runs = [pha_llama_cpp.run(gguf, n, steps, batches, threads=threads, binary=binary) for _ in range(repeats)]
        for i, B in enumerate(batches):
            decode = [r[i]["decode_tokens_per_s"] for r in runs]
            prompt = [r[i]["prompt_tokens_per_s"] for r in runs]
            rows.append({"model": "llama.cpp", "threads": threads, "context": n, "batch": B, "parameters": params,
                         "prompt_tokens": runs[0][i]["pp"], "decode_steps": steps,
                         "decode_tokens_per_s_runs": decode, "decode_tokens_per_s": max(decode),
                         "decode_spread": spread(decode), "prompt_tokens_per_s_runs": prompt,
                         "prompt_tokens_per_s": max(prompt), "step_ms": 1e3 * B / max(decode),
                         "reread_bytes_per_step": int(llama_cpp_step_bytes(pha_config_of(n), B, n - steps, steps,
                                                                           params)),
                         "prompt_flops": B * llama_cpp_prefill_flops(pha_config_of(n), runs[0][i]["pp"], params)})
            print(rows[-1], flush=True)
    return rows


def paired_summary(ratios: list[float]) -> dict:
    """The verdict of ``paired_prefill``'s or ``paired_decode``'s rounds (their ratios,
    engine over llama.cpp, in the order run: even rounds timed the engines first). On a
    shared host llama.cpp timed right after the engines can run slower than after itself
    while the engines' rate does not move with the order (docs/pha_engine.md), so each
    order's rounds get their own median, and ``ratio`` is the lower of the two: a ratio no
    order of the timings favours."""
    first, second = ratios[0::2], ratios[1::2]
    by_order = {"median_ratio_engines_first": rounds_verdict(first)["median"]}
    if second:
        by_order["median_ratio_llama_cpp_first"] = rounds_verdict(second)["median"]
    verdict = rounds_verdict(ratios)
    return {"median_ratio": verdict["median"], **by_order, "ratio": min(by_order.values()),
            "rounds_won": verdict["above_1"]}


def alternating_rounds(rounds: int, ours, theirs) -> list[tuple[bool, object, object]]:
    """``rounds`` rounds of the engines' timing (``ours()``) and llama.cpp's (``theirs()``)
    seconds apart, the engines first in even rounds and second in odd ones: (engines first,
    ours, theirs) per round."""
    got = []
    for i in range(rounds):
        if i % 2 == 0:
            mine = ours()
            other = theirs()
        else:
            other = theirs()
            mine = ours()
        got.append((i % 2 == 0, mine, other))
    return got


def paired_prefill(engines: dict, n: int, rounds: int, repeats: int, rng, llama_prompt_rate) -> list[dict]:
    """Each engine's prefill of one n-token prompt against llama.cpp's prompt, side by side
    in ``rounds`` rounds: a round times the engines (best of ``repeats`` calls after a
    warm-up) and llama.cpp (``llama_prompt_rate()``: its prompt tokens/s, in ``main`` the
    best of as many runs), the engines first in even rounds and second in odd ones, and
    takes their ratio. This host's speed drifts by tens of percent within minutes, more than
    the ratio sought, so a best against a best minutes apart can fall either side of 1;
    ratios of timings seconds apart do not move with the drift (``paired_summary`` gives the
    verdict). One row per engine (``engines``: (name, path, dtype) -> engine)."""
    prompts = {key: [rng.integers(0, e.config.vocab_size, n).tolist()] for key, e in engines.items()}
    per_round: dict = {key: [] for key in engines}

    def engines_rate() -> dict:
        return {key: n / min(timed(repeats, lambda: e.prefill(prompts[key]))) for key, e in engines.items()}

    for first, ours, theirs in alternating_rounds(rounds, engines_rate, llama_prompt_rate):
        for key, rate in ours.items():
            per_round[key].append({"engines_first": first, "prefill_tokens_per_s": rate,
                                   "llama_cpp_prompt_tokens_per_s": theirs, "ratio": rate / theirs})
    return [{"model": name, "path": path, "dtype": dtype, "context": n, "rounds": got,
             **paired_summary([r["ratio"] for r in got])}
            for (name, path, dtype), got in per_round.items()]


def paired_decode(engines: dict, n: int, rounds: int, repeats: int, steps: int, batches, rng,
                  llama_decode_rates) -> list[dict]:
    """Each engine's decode at each batch against llama.cpp's, in rounds as
    ``paired_prefill``'s: a round times every engine's decode into its states (``steps``
    tokens a call from position n - steps - 1, best of ``repeats`` calls after a warm-up:
    the slot pool's calls, and llama.cpp's, which decodes into its KV cache) and llama.cpp
    at every batch (``llama_decode_rates()``: batch -> its decode tokens/s, in ``main`` the
    best of as many runs). One row per engine and batch."""
    from srm_max.runtime.call_types import SamplingArrays

    calls = {}
    for key, e in engines.items():
        for B in batches:
            ids = rng.integers(0, e.config.vocab_size, B).astype(np.int64)
            pos = np.full(B, n - steps - 1, np.int64)
            states, greedy = e.empty_states(B), SamplingArrays.greedy(B)
            calls[key, B] = partial(e.decode, ids, pos, states, greedy, steps, donate_states=True)

    def engines_rate() -> dict:
        return {(key, B): B * steps / min(timed(repeats, call)) for (key, B), call in calls.items()}

    per_round: dict = {cell: [] for cell in calls}
    for first, ours, theirs in alternating_rounds(rounds, engines_rate, llama_decode_rates):
        for (key, B), rate in ours.items():
            per_round[key, B].append({"engines_first": first, "decode_tokens_per_s": rate,
                                      "llama_cpp_decode_tokens_per_s": theirs[B], "ratio": rate / theirs[B]})
    return [{"model": name, "path": path, "dtype": dtype, "context": n, "batch": B, "steps_per_call": steps,
             "rounds": got, **paired_summary([r["ratio"] for r in got])}
            for ((name, path, dtype), B), got in per_round.items()]


def best_by_batch(runs: list[list[dict]], rate: str) -> dict:
    """llama.cpp's best ``rate`` per batch over its ``runs`` (each a list of
    ``pha_llama_cpp.run`` rows): its side of a paired round, as the engines' side is each
    the best of as many calls."""
    return {row["batch"]: max(r[i][rate] for r in runs) for i, row in enumerate(runs[0])}


def print_paired(paired: list[dict], what: str):
    """One line per ``paired_prefill`` or ``paired_decode`` row: its verdict and the rounds'."""
    for p in paired:
        at = f"context {p['context']:5d}" + (f" batch {p['batch']:3d}" if "batch" in p else "")
        print(f"{p['model']:8s} {p['path']:5s} {p['dtype']:8s} {at}: {what} {p['ratio']:.2f}x (the medians of "
              f"{len(p['rounds'])} alternating rounds: {p['median_ratio_engines_first']:.2f}x with the engines "
              f"first, {p.get('median_ratio_llama_cpp_first', float('nan')):.2f}x second), faster in "
              f"{p['rounds_won']}", flush=True)


def at_context_end(row: dict) -> bool:
    """Whether a row's decode ran from the default position, the last steps before n (rows
    of ``--decode-from`` runs did not)."""
    return "decode_from" not in row or row["decode_from"] == row["context"] - row.get("steps_per_call", 16) - 1


NOT_MEASURED = ("context", "run", "steps_per_call", "decode_from")  # a row's settings, not its numbers


def pha_vs_attention(rows: list[dict], n: int) -> list[dict]:
    """At context n, PHA over attention alone for every measured number (the paper's
    claims at 8,192: state 0.78x, throughput 1.239x), each from the latest run (a row's
    ``run``) that measured it for both models: a run of one model alone, or of other
    settings, leaves the ratio as it was."""
    by_run: dict = {}
    for r in rows:  # a model's rows of one run (decode, prefill, state) together
        float32 = r.get("dtype", "float32") == "float32"
        if r["context"] == n and r.get("path") == "op" and float32 and at_context_end(r):
            by_run.setdefault(r.get("run"), {}).setdefault(r["model"], {}).update(r)
    ratios: dict = {}
    for models in by_run.values():  # in the rows' order: a later run's ratio wins
        pha, attn = models.get("pha"), models.get("pha-attn")
        if pha and attn:
            ratios |= {k: pha[k] / attn[k] for k in pha if k not in NOT_MEASURED and isinstance(pha[k], (int, float))
                       and isinstance(attn.get(k), (int, float)) and attn[k]}
    return [{"context": n} | ratios] if ratios else []


def against_llama_cpp(rows: list[dict], llama: list[dict]) -> list[dict]:
    """The MAX engines' decode (per batch) and prefill (batch 1) over llama.cpp's best at
    the same context and batch, whatever its thread count: > 1 is faster than llama.cpp.
    Where both rows give the bytes a step re-reads, also their ratio and the decode per
    byte (> 1: the engine reads its bytes faster than llama.cpp reads its own); where both
    give a prefill's FLOPs, their ratio per token and the prefill per FLOP (the same for
    the FLOPs)."""
    best: dict[tuple, dict] = {}
    for ll in llama:
        # with each rate, what it is weighed by: the bytes a decode step re-reads, the FLOPs per prompt token
        flops_per_token = ll["prompt_flops"] / (ll["batch"] * ll["prompt_tokens"]) if "prompt_flops" in ll else None
        for key, weight in (("decode_tokens_per_s", ll.get("reread_bytes_per_step")),
                            ("prompt_tokens_per_s", flops_per_token)):
            at = best.setdefault((ll["context"], ll["batch"]), {})
            if key not in at or ll[key] > at[key][0]:
                at[key] = (ll[key], ll.get("threads", 2), weight)
    out = []
    for r in rows:
        for (n, B), ll in sorted(best.items()):
            if n != r["context"]:
                continue
            entry = {"model": r["model"], "path": r.get("path"), "dtype": r.get("dtype", "float32"), "context": n,
                     "batch": B, "decode_from": r.get("decode_from")}
            if f"decode_tokens_per_s_b{B}" in r:
                rate, threads, llama_bytes = ll["decode_tokens_per_s"]
                entry |= {"decode": r[f"decode_tokens_per_s_b{B}"] / rate, "llama_cpp_decode_threads": threads}
                if f"donated_decode_tokens_per_s_b{B}" in r:  # into the states, as llama.cpp's cache
                    entry["decode_donated"] = r[f"donated_decode_tokens_per_s_b{B}"] / rate
                if llama_bytes and f"reread_bytes_per_step_b{B}" in r:
                    more = r[f"reread_bytes_per_step_b{B}"] / llama_bytes
                    entry |= {"bytes_per_step_over_llama_cpp": more, "decode_per_byte": entry["decode"] * more}
            if B == 1 and "prefill_tokens_per_s" in r:
                rate, threads, llama_flops = ll["prompt_tokens_per_s"]
                entry |= {"prefill": r["prefill_tokens_per_s"] / rate, "llama_cpp_prefill_threads": threads}
                if llama_flops and "prefill_flops" in r:
                    more = r["prefill_flops"] / r["context"] / llama_flops
                    entry |= {"prefill_flops_per_token_over_llama_cpp": more,
                              "prefill_per_flop": entry["prefill"] * more}
            if len(entry) > 6:
                out.append(entry)
    return out


STREAMING_TARGET = 60.0  # percent of the streaming limit a decode step should reach (docs/pha_engine.md)


def streaming_reach(run: dict) -> list[dict]:
    """Per decode cell of ``run`` that has both limits, the share of the streaming limit it
    reached (into the states where timed so, as llama.cpp decodes) and the most its bytes
    allow. A token depends on the one before, so every step multiplies by every matrix
    again. ``reachable``: the streaming limit over the re-read limit (the matrices at
    their re-read rate, the samples' state at the streaming rate). ``reachable_at_best``:
    over every byte a step touches, matrices and state, at the matrices' re-read rate, a
    floor no step beats (it touches both every step, and a larger array re-reads no
    faster). Below ``STREAMING_TARGET`` at best, the target is out of this machine's reach
    at that cell whatever the code; the FLOPs may allow less than either."""
    out = []
    for r in run["rows"]:
        rate = run.get("reread_bytes_per_s", {}).get(str(r["context"]), {}).get(
            reread_key(r["model"], r.get("dtype", "float32")))
        for key in sorted(k for k in r if k.startswith("reread_limit_ms_b")):
            B = int(key.removeprefix("reread_limit_ms_b"))
            reached = r.get(f"donated_percent_of_streaming_b{B}", r.get(f"percent_of_streaming_b{B}"))
            if reached is None or f"streaming_limit_ms_b{B}" not in r:
                continue
            limit = r[f"streaming_limit_ms_b{B}"]
            cell = {"model": r["model"], "path": r.get("path"), "dtype": r.get("dtype", "float32"),
                    "context": r["context"], "batch": B, "percent_of_streaming": reached,
                    "reachable_percent_of_streaming": 100 * limit / r[key], "target_met": reached >= STREAMING_TARGET}
            cell["target_reachable"] = cell["reachable_percent_of_streaming"] >= STREAMING_TARGET
            if rate and f"reread_bytes_per_step_b{B}" in r:
                at_best = 100 * limit / (1e3 * r[f"reread_bytes_per_step_b{B}"] / rate)
                cell |= {"reachable_at_best_percent_of_streaming": at_best,
                         "target_reachable_at_best": at_best >= STREAMING_TARGET}
            out.append(cell)
    return out


def streaming_target_by_cell(entries: list[dict]) -> list[str]:
    """``streaming_target`` entries of the op path gathered per cell over the runs: in how
    many runs the cell met the target and could have (by the re-read limit, and at best),
    the best share reached and reachable."""
    cells: dict[tuple, list] = {}
    for e in entries:
        if e["path"] in ("op", None):
            cells.setdefault((e["model"], e["dtype"], e["context"], e["batch"]), []).append(e)
    return [f"{m:8s} {dt:8s} context {n:5d} batch {B:3d}: {len(es):2d} runs, target met in "
            f"{sum(e['target_met'] for e in es):2d}, reachable in {sum(e['target_reachable'] for e in es):2d} "
            f"(at best {sum(e.get('target_reachable_at_best', False) for e in es):2d}); "
            f"best {max(e['percent_of_streaming'] for e in es):5.1f} % of streaming, "
            f"best reachable {max(e['reachable_percent_of_streaming'] for e in es):5.1f} % "
            f"(at best {max(e.get('reachable_at_best_percent_of_streaming', 0) for e in es):5.1f} %)"
            for (m, dt, n, B), es in sorted(cells.items())]


def summarized(result: dict) -> dict:
    """``result`` with its comparisons: PHA over attention alone (over all its runs), and
    the MAX engines over llama.cpp's best within each run that timed both (the machine's
    speed drifts between runs, so a ratio is only taken side by side; ``run`` counts
    from 1 in ``runs``), and each decode cell's share of the streaming limit beside the
    most it could reach in its run (``streaming_reach``)."""
    rows = [r | {"steps_per_call": past["steps_per_call"], "run": i}
            for i, past in enumerate(result["runs"], 1) for r in past["rows"]]
    result["pha_vs_attention"] = [x for n in sorted({r["context"] for r in rows}) for x in pha_vs_attention(rows, n)]
    result["against_llama_cpp"] = [{"run": i} | e for i, past in enumerate(result["runs"], 1)
                                   for e in against_llama_cpp(past["rows"], past["llama_cpp"])]
    result["streaming_target"] = [{"run": i} | e for i, past in enumerate(result["runs"], 1)
                                  for e in streaming_reach(past)]
    for past in result["runs"]:  # the verdict of paired rounds as ``paired_summary`` gives it now
        for p in past.get("paired_prefill", []) + past.get("paired_decode", []):
            p |= paired_summary([r["ratio"] for r in p["rounds"]])
    return result


def main(argv=None) -> dict:
    from srm_max.runtime.device import DTYPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, context 128")
    ap.add_argument("--contexts", type=int, nargs="*", help="default: 512 2048 8192")
    ap.add_argument("--models", nargs="*", default=["pha", "pha-attn"], choices=MODELS)
    ap.add_argument("--paths", nargs="*", default=["op"], choices=PATHS,
                    help="the PHA models' decode paths (the SRM has one)")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--dtypes", nargs="*", default=["float32"], choices=list(DTYPES),
                    help="the engines' weight dtypes, each measured on every path")
    ap.add_argument("--no-prefill", action="store_true", help="time decode only")
    ap.add_argument("--prefill-lengths", type=int, nargs="*", default=[],
                    help="also time the prefill of one prompt of each of these lengths (at most the context)")
    ap.add_argument("--no-decode", action="store_true",
                    help="time prefill only (llama.cpp still runs --batches, for its prompt tokens/s)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--llama-cpp-threads", type=int, default=2,
                    help="llama.cpp's threads (2: both cores; they meet at a barrier after every op, so a loaded "
                         "machine slows it more than the MAX engines)")
    ap.add_argument("--steps", type=int, default=16, help="decode tokens per call")
    ap.add_argument("--decode-from", type=int, nargs="*",
                    help="positions the decode calls start from (default: n - steps - 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paired-rounds", type=int, default=0,
                    help="also time each engine's prefill against llama.cpp's prompt, and its decode into the "
                         "states at each batch against llama.cpp's, in this many rounds, the order alternating, each "
                         "a ratio of timings seconds apart: the verdict is the lower of the two orders' medians, "
                         "which the host's drift does not move")
    ap.add_argument("--donated", action="store_true",
                    help="also time the decode into donated states (the slot pool's calls: no copy of the caches)")
    ap.add_argument("--refill", action="store_true",
                    help="also time the slot pool's refill of one row in each batch (the engine's regroup)")
    ap.add_argument("--state-only", action="store_true",
                    help="only the decode state per sample (nothing compiled or timed)")
    ap.add_argument("--out", type=Path, help="the JSON path")
    ap.add_argument("--append", action="store_true", help="add this run to the JSON's earlier runs")
    ap.add_argument("--summarize", action="store_true", help="only recompute the JSON's comparisons from its runs")
    ap.add_argument("--note", default="", help="a remark stored in the JSON (e.g. why repeats were reduced)")
    args = ap.parse_args(argv)
    contexts = args.contexts or ([128] if args.quick else [512, 2048, 8192])
    batches = tuple(args.batches)
    suffix = ("-quick" if args.quick else "") + ("-state" if args.state_only else "")
    out = args.out or RESULTS / f"pha_long_context{suffix}.json"
    if args.summarize:
        result = summarized(json.loads(out.read_text()))
        print(f"decode against {STREAMING_TARGET:g} % of the streaming limit (the op's cells, every run):")
        print("\n".join(streaming_target_by_cell(result["streaming_target"])))
        write_json(out, result)
        print(f"wrote {out}")
        return result
    from srm_max.runtime.precompile import precompile

    rng = np.random.default_rng(0)
    run = {"command": command_line(), "machine": machine_info(), "quick": args.quick,
           "steps_per_call": args.steps, "repeats": args.repeats, "note": args.note,
           "state_only": args.state_only, "batches": list(batches), "configs": {}, "compile_seconds": {},
           "stream_bytes_per_s": {}, "reread_bytes_per_s": {}, "rows": [], "llama_cpp": [], "paired_prefill": [],
           "paired_decode": []}
    if not (args.state_only or args.no_prefill):
        run["fma_peak"] = fma_peak()
        print(f"FMA peak: {run['fma_peak']['flops'] / 1e9:.0f} GFLOP/s", flush=True)
    earlier = json.loads(out.read_text())["runs"] if args.append and out.exists() else []
    result = {"runs": earlier + [run]}
    prefill = not args.no_prefill
    decode_batches = () if args.no_decode else batches
    for n in contexts:
        engines = {(name, path, dtype): engine_of(name, configs(name, n, args.quick), path, dtype)
                   for name in args.models for path in (["op"] if name == "srm" else args.paths)
                   for dtype in args.dtypes}
        if not args.state_only:
            t0 = time.perf_counter()
            precompile([job for e in engines.values()
                        for job in graphs_used(e, prefill, not args.no_decode, args.refill)])
            run["compile_seconds"][str(n)] = round(time.perf_counter() - t0, 1)
            print(f"context {n}: graphs ready in {time.perf_counter() - t0:.0f} s", flush=True)
        bandwidth = 0.0 if args.state_only else stream_bytes_per_s()
        rows = []
        for (name, path, _dtype), engine in engines.items():
            run["configs"][name] = {k: v for k, v in vars(engine.config).items()}
            for i, start in enumerate(args.decode_from or [None]):
                # each path prefills through its own graph (the op's tiled attention or plain ops)
                rows.append(measure(name, engine, n, args.steps, decode_batches, args.repeats, rng,
                                    timed_run=not args.state_only, prefill=prefill and i == 0,
                                    path=path, start=start, donated=args.donated, refill=args.refill,
                                    prefill_lengths=[t for t in args.prefill_lengths if 0 < t <= n]))
                print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()
                       if not k.endswith("_runs")}, flush=True)
        if not args.state_only:
            # the best bandwidth of the minutes around the engines
            bandwidth = max(bandwidth, stream_bytes_per_s())
            run["stream_bytes_per_s"][str(n)] = bandwidth
            for row in rows:
                for B in decode_batches:
                    limit = 1e3 * row[f"bytes_per_step_b{B}"] / bandwidth
                    row[f"streaming_limit_ms_b{B}"] = limit
                    for kind in ("", "donated_"):  # decode on a copy of the states, and into them
                        if f"{kind}step_ms_b{B}" in row:
                            row[f"{kind}percent_of_streaming_b{B}"] = 100 * limit / row[f"{kind}step_ms_b{B}"]
            for (name, _path, dtype), engine in engines.items():
                mats = matrix_bytes(name, engine.config, weight_bytes_of(dtype))
                reread = reread_bytes_per_s(mats)
                run["reread_bytes_per_s"].setdefault(str(n), {})[reread_key(name, dtype)] = reread
                for row in rows:
                    if row["model"] != name or row["dtype"] != dtype:
                        continue
                    for B in decode_batches:
                        limit = reread_limit_ms(row[f"bytes_per_step_b{B}"], mats, args.steps, reread, bandwidth)
                        row[f"reread_limit_ms_b{B}"] = limit
                        for kind in ("", "donated_"):
                            if f"{kind}step_ms_b{B}" in row:
                                row[f"{kind}percent_of_reread_b{B}"] = 100 * limit / row[f"{kind}step_ms_b{B}"]
            for row in rows:
                if "prefill_flops" in row:
                    row["prefill_percent_of_fma_peak"] = percent_of_peak(row["prefill_flops"], row["prefill_seconds"],
                                                                         run["fma_peak"])
        run["rows"] += rows
        llama_cpp = not (args.state_only or args.no_llama_cpp)
        # one folder for the context's same-shape Llama: its GGUF is written once, for the
        # paired rounds and the runs below
        with tempfile.TemporaryDirectory() as tmp:
            if llama_cpp and args.paired_rounds and (prefill or decode_batches):
                gguf, _ = pha_llama_cpp.write_gguf(configs("pha", n, args.quick), Path(tmp) / str(n))
                binary = pha_llama_cpp.build()

                def llama_best(batches_run, rate: str) -> dict:
                    return best_by_batch([pha_llama_cpp.run(gguf, n, args.steps, batches_run, binary=binary,
                                                            threads=args.llama_cpp_threads)
                                          for _ in range(args.repeats)], rate)

                if prefill:
                    paired = paired_prefill(engines, n, args.paired_rounds, args.repeats, rng,
                                            lambda: llama_best([1], "prompt_tokens_per_s")[1])
                    print_paired(paired, "prefill over llama.cpp's prompt")
                    run["paired_prefill"] += paired
                if decode_batches:
                    paired = paired_decode(engines, n, args.paired_rounds, args.repeats, args.steps, decode_batches,
                                           rng, lambda: llama_best(list(decode_batches), "decode_tokens_per_s"))
                    print_paired(paired, "decode into the states over llama.cpp's")
                    run["paired_decode"] += paired
            del engines
            if llama_cpp:
                # right after the MAX engines at this context: the host's speed drifts within
                # minutes, so each ratio compares timings taken as close together as they can be
                llama = llama_cpp_rows([n], batches, args.steps, args.repeats, Path(tmp),
                                       lambda context: configs("pha", context, args.quick), args.llama_cpp_threads)
        if llama_cpp:
            if "fma_peak" in run:
                for ll in llama:
                    seconds = ll["batch"] * ll["prompt_tokens"] / ll["prompt_tokens_per_s"]
                    ll["prompt_percent_of_fma_peak"] = percent_of_peak(ll["prompt_flops"], seconds, run["fma_peak"])
            run["llama_cpp"] += llama
        run["load_average_after"] = list(os.getloadavg())
        write_json(out, result)  # partial results survive an interrupted run
    write_json(out, summarized(result))
    print(json.dumps(result["against_llama_cpp"], indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
