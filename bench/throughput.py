"""Generated tokens per second, SRM against a Transformer and Mamba, one run, one machine.

    python -m bench.throughput --quick          # a subset of the grid, < 10 minutes on 2 cores
    python -m bench.throughput                  # the whole grid (long on a small CPU)

Engines (all randomly initialised, about the same number of parameters):

    srm-max    the SRM on MAX (``srm_max.Generator``, float32). MAX sizes its own thread
               pool once per process, so "all" is MAX's default (every core) and "1" is
               the same engine in a child process pinned to one core
    srm-torch  the PyTorch reference SRM: parallel (chunked-scan) prefill, then the
               recurrent step loop, greedy
    llama-hf   Hugging Face ``LlamaForCausalLM`` (SDPA attention, preallocated "static"
               KV cache; ``--llama-cache dynamic`` for the default DynamicCache),
               ``generate(do_sample=False, min_new_tokens=max_new_tokens=N)``
    mamba-hf   Hugging Face ``MambaForCausalLM``, same ``generate``; on a machine without
               ``mamba_ssm``/``causal_conv1d`` it runs transformers' slow PyTorch path

Every torch engine is run at each of ``--threads`` (``torch.set_num_threads``) and is
reported at its best. Throughput = generated tokens summed over the batch / wall time
of the whole ``generate`` (prefill included); ``decode tok/s`` counts only the tokens
after the first over the time after the first token arrived (the decode phase; for
srm-max the first token's time is that of a generate of one token on the same prompts,
and its prefix-state cache is off, so every call prefills as the other engines do). Both
times are the best of the repeats.

A prompt plus its completion must fit the SRM's context n: a prompt length above
n - new_tokens is run at n - new_tokens (the JSON records the length used).

The greedy tokens of srm-max and srm-torch are compared at every grid point (same
weights): a disagreement means the two do not compute the same model, and is printed.

Results: ``bench/results/throughput[-quick].json`` (with the command line that made it)
and ``.png`` (tokens/s against batch, one line per engine, one panel per prompt
length); a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from bench import common

ENGINES = ("srm-max", "srm-torch", "llama-hf", "mamba-hf", "vllm")
BASELINES = ("srm-torch", "llama-hf", "mamba-hf", "vllm")


# ------------------------------------------------------------------ runners
class Runner:
    """One engine, built once. ``run(prompts [B, P], new) -> (Clock, tokens [B, new])``."""

    name = ""
    threads_settable = True

    def __init__(self, config, device: str = "cpu", dtype: str = "float32"):
        self.config = config
        self.device = device
        self.dtype = dtype
        self.params = 0

    def thread_options(self, threads: list[int]) -> list:
        """The thread counts to run at (None: the engine's own default)."""
        return list(threads) if self.threads_settable else [None]

    def use_threads(self, t) -> None:
        if t is not None:
            common.set_torch_threads(t)

    def describe(self) -> dict:
        return {"engine": self.name, "parameters": self.params}

    def close(self) -> None:
        pass


class SRMMaxRunner(Runner):
    """The SRM on MAX. MAX's CPU runtime sizes its own thread pool (no thread-count option
    can be changed once the runtime exists), so the default variant uses every core; with
    ``pin`` (CPU only) each smaller thread count t runs in a child process pinned to t
    cores (``sched_setaffinity``), which on a busy small machine can beat the default,
    just as one torch thread beats two."""

    name = "srm-max"

    def __init__(self, config, weights, device="cpu", dtype="float32", steps_per_call=32, pin=True):
        super().__init__(config, device, dtype)
        from srm_max.serve.generator import Generator

        t = time.perf_counter()
        # no prefix cache: a repeat of the same prompts would skip their prefill, which no other engine here does
        self.gen = Generator(config, weights, dtype=dtype, device=device, prefix_cache_mb=0)
        self.load_seconds = time.perf_counter() - t
        self.steps_per_call = steps_per_call
        self.params = config.num_parameters()
        self.pin = pin and device == "cpu" and hasattr(os, "sched_setaffinity")
        self.children: dict[int, _PinnedMax] = {}
        self.current = None

    def thread_options(self, threads):
        ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return [None] + (sorted({t for t in threads if t < ncpu}) if self.pin else [])

    def use_threads(self, t):
        self.current = t
        if t is not None and t not in self.children:
            self.children[t] = _PinnedMax(self.config, t, self.dtype, self.steps_per_call)

    def run(self, prompts: np.ndarray, new: int):
        if self.current is not None:
            return self.children[self.current].run(prompts, new)
        return generate_max(self.gen, prompts, new, self.steps_per_call)

    def describe(self):
        eng = self.gen.engine
        return {**super().describe(), "dtype": self.dtype, "device": self.device,
                "threads": ("'all' = MAX runtime default (every core)"
                            + ("; N = a child process pinned to N cores (sched_setaffinity)" if self.pin else "")
                            if self.device == "cpu" else "n/a (GPU)"),
                "steps_per_call": self.steps_per_call, "load_seconds": self.load_seconds,
                "compile_or_cache_load_seconds": dict(eng.compile_seconds)}

    def close(self):
        for c in self.children.values():
            c.close()
        self.children.clear()


def generate_max(gen, prompts: np.ndarray, new: int, steps_per_call: int):
    """The whole generate's time, and the first token's as a generate of one token on the
    same prompts: an engine turn prefills and then runs its first decode call, so no
    callback of one generate marks where its prefill ends (and without a prefix cache
    each call prefills in full)."""
    ids = [row.tolist() for row in prompts]
    first = common.Clock()
    first.start()
    gen.generate(ids, max_new_tokens=1, temperature=0.0)
    first.stop()
    clock = common.Clock()
    clock.start()
    outs = gen.generate(ids, max_new_tokens=new, temperature=0.0, steps_per_call=max(1, min(steps_per_call, new - 1)))
    clock.stop()
    clock.first = clock.t0 + min(first.total, clock.total)
    return clock, np.array([o.ids for o in outs])


def _pinned_max_child(conn, config_dict: dict, cores: int, dtype: str, steps_per_call: int) -> None:
    """Child process: pin to ``cores`` CPUs before MAX starts, then serve ``run`` requests."""
    try:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
        from bench import common as cm

        from srm_max.models.srm.config import SRMConfig
        from srm_max.serve.generator import Generator

        config = SRMConfig(**config_dict)
        # The same seed as the parent: the same weights.
        gen = Generator(config, cm.srm_weights(cm.build_srm_reference(config)), dtype=dtype, device="cpu",
                        prefix_cache_mb=0)
        conn.send(("ready",))
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        try:
            clock, toks = generate_max(gen, msg[1], msg[2], steps_per_call)
            conn.send(("ok", clock.total, clock.prefill, toks))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _PinnedMax:
    def __init__(self, config, cores: int, dtype: str, steps_per_call: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_pinned_max_child, daemon=True,
                                args=(child, config.to_dict(), cores, dtype, steps_per_call))
        self.proc.start()
        msg = self.conn.recv()
        if msg[0] != "ready":
            self.close()
            raise RuntimeError(f"srm-max pinned to {cores} core(s) did not start: {msg[1]}")

    def run(self, prompts, new):
        self.conn.send(("run", prompts, new))
        msg = self.conn.recv()
        if msg[0] != "ok":
            raise RuntimeError(msg[1])
        clock = common.Clock()
        clock.t0, clock.first, clock.end = 0.0, msg[2], msg[1]
        return clock, msg[3]

    def close(self):
        try:
            self.conn.send(("stop",))
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()


class SRMTorchRunner(Runner):
    name = "srm-torch"

    def __init__(self, config, model, device="cpu", dtype="float32"):
        super().__init__(config, device, dtype)
        import torch

        self.model = model.to(device=device, dtype=getattr(torch, dtype))
        self.params = common.num_params(model)
        self.threads_settable = device == "cpu"

    def run(self, prompts, new):
        import torch

        m, clock = self.model, common.Clock()
        with torch.inference_mode():
            ids = torch.from_numpy(prompts).to(self.device)
            B, P = ids.shape
            clock.start()
            x = m.input_layer(ids)
            states = []
            for block in m.mixer_blocks:
                x, st = block(x, "parallel")
                states.append(st)
            states = torch.stack(states)
            tok = m.output_layer(x[:, -1]).argmax(-1)  # logits of the last position only
            out = [tok]
            _sync(self.device)
            clock.mark_first()
            pos = torch.full((B,), P, dtype=torch.long, device=self.device)
            for _ in range(new - 1):
                logits, states = m.step(tok, pos, states)
                tok = logits.argmax(-1)
                out.append(tok)
                pos += 1
            res = torch.stack(out, 1).cpu().numpy()
            clock.stop()
        return clock, res

    def describe(self):
        return {**super().describe(), "dtype": self.dtype, "device": self.device,
                "prefill": "parallel (chunked scan), logits of the last position only",
                "decode": "recurrent step loop", **({} if self.threads_settable else {"threads": "n/a (GPU)"})}


class _FirstToken:
    """A ``generate`` streamer that only timestamps the first new token."""

    def __init__(self, clock):
        self.clock, self.calls = clock, 0

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # call 1 is the prompt
            _sync_any()
            self.clock.mark_first()

    def end(self):
        pass


class HFRunner(Runner):
    def __init__(self, config, model, name, device="cpu", dtype="float32", cache: str | None = None):
        super().__init__(config, device, dtype)
        self.name = name
        self.model = model
        self.cache = cache  # None: the model's default cache; "static": a preallocated KV cache
        self.params = common.num_params(model)
        self.threads_settable = device == "cpu"

    def run(self, prompts, new):
        import torch

        clock = common.Clock()
        with torch.inference_mode():
            ids = torch.from_numpy(prompts).to(self.device)
            clock.start()
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new, min_new_tokens=new, use_cache=True, pad_token_id=0,
                streamer=_FirstToken(clock), **({"cache_implementation": self.cache} if self.cache else {}))
            res = out[:, ids.shape[1]:].cpu().numpy()
            clock.stop()
        return clock, res

    def describe(self):
        c = self.model.config
        d = {**super().describe(), "dtype": str(self.model.dtype).replace("torch.", ""),
             "layers": c.num_hidden_layers, "hidden": c.hidden_size,
             "generate": "generate(do_sample=False, use_cache=True, min_new_tokens=max_new_tokens"
                         + (f", cache_implementation={self.cache!r})" if self.cache else ")"),
             "cache": self.cache or "default (DynamicCache)"}
        if hasattr(c, "intermediate_size"):
            d["intermediate_size"] = c.intermediate_size
        if hasattr(c, "_attn_implementation"):
            d["attention"] = c._attn_implementation
        if not self.threads_settable:
            d["threads"] = "n/a (GPU)"
        return d


class VLLMRunner(Runner):
    """vLLM serving the same-size Llama with random ("dummy") weights; GPU only.

    vLLM schedules prefill and decode itself, so only the whole-generate time is known."""

    name = "vllm"
    threads_settable = False

    def __init__(self, config, dtype="bfloat16", gpu_memory_utilization=0.85):
        super().__init__(config, "cuda", dtype)
        import tempfile

        from vllm import LLM

        lc = common.llama_config_matching(config)
        lc.torch_dtype = dtype
        self.dir = tempfile.mkdtemp(prefix="srm-bench-llama-")
        lc.save_pretrained(self.dir)
        self.llm = LLM(model=self.dir, load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
                       max_model_len=config.context_length + 128, seed=0,
                       gpu_memory_utilization=gpu_memory_utilization)
        self.params = config.num_parameters()  # matched by construction (same LlamaConfig as llama-hf)

    def run(self, prompts, new):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new, ignore_eos=True, detokenize=False)
        reqs = [TokensPrompt(prompt_token_ids=row.tolist()) for row in prompts]
        clock = common.Clock()
        clock.start()
        outs = self.llm.generate(reqs, sp, use_tqdm=False)
        clock.stop()
        return clock, np.array([list(o.outputs[0].token_ids)[:new] for o in outs])

    def describe(self):
        import vllm

        return {**super().describe(), "dtype": self.dtype, "vllm_version": vllm.__version__,
                "threads": "n/a (GPU)", "note": "whole-generate time only (no separate prefill time)"}


OOM_WORDS = ("out of memory", "out_of_memory", "outofmemory", "failed to allocate", "cannot allocate",
             "allocation failed")


def is_oom(e: BaseException) -> bool:
    msg = f"{type(e).__name__} {e}".lower()
    return isinstance(e, MemoryError) or any(w in msg for w in OOM_WORDS)


def _sync(device):
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _empty_cache():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _sync_any():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ------------------------------------------------------------------ the grid
def work(batch, prompt, new):
    return batch * (prompt + new)


def predict(history, batch, prompt, new):
    """Seconds a run should take, from this engine's measured runs (None if none)."""
    if not history:
        return None
    w = work(batch, prompt, new)
    same_prompt = [h for h in history if h[1] == prompt]
    pool = same_prompt or history
    b, p, n, secs = min(pool, key=lambda h: (abs(math.log(work(*h[:3]) / w)), h[0] != batch))
    return secs * w / work(b, p, n)


def dominated(measured: dict, name, t, prompt, batch, factor: float):
    """(other thread count, batch, slowdown) if thread count ``t`` of engine ``name`` was at
    least ``factor`` times slower than another at the largest smaller batch of this prompt."""
    mine = measured.get((name, t, prompt), {})
    for (n2, t2, p2), theirs in measured.items():
        if n2 != name or t2 == t or p2 != prompt:
            continue
        # only a batch at least a quarter of this one says anything about it (batch 1 never
        # predicts large-batch matrix work, where more threads pay off)
        common_b = [b for b in mine if b in theirs and batch / 4 <= b < batch]
        if common_b:
            b = max(common_b)
            if mine[b] >= factor * theirs[b]:
                return t2, b, mine[b] / theirs[b]
    return None


def run_grid(runners: dict, threads: list[int], batches, prompts, new, budget_s, deadline,
             min_time=1.0, log=print, warm_below=3.0, prune: float | None = None):
    """Every (prompt, batch) point, every engine at every thread count.

    A run predicted (from the engine's earlier runs) to take more than ``budget_s`` is
    skipped, and so is everything once ``deadline`` (a perf_counter time) has passed.
    Small runs get a warmup of their own shape and are repeated (best of) up to
    ``min_time`` seconds. With ``prune`` = f, a thread count that was f times slower than
    another of the same engine at the previous batch (same prompt) is not run again.
    """
    rows, tokens_seen = [], {}
    history: dict[tuple, list] = {}
    oom: dict[tuple, list] = {}  # variant -> (batch, prompt) that ran out of memory
    measured: dict[tuple, dict] = {}  # (engine, threads, prompt) -> {batch: seconds}
    variants = []
    for name, r in runners.items():
        for t in r.thread_options(threads):
            variants.append((name, t))
    # Engine-level warmup (lazy init, first allocations); its time seeds the predictions.
    for name, t in variants:
        r = runners[name]
        p0 = common.fixed_prompts(1, 16, r.config.vocab_size)
        try:
            r.use_threads(t)
            clock, _ = r.run(p0, 4)
            history[(name, t)] = [(1, 16, 4, clock.total)]
            log(f"  warmup {name:10s} threads={t or 'all'}: {clock.total:.2f} s")
        except Exception as e:  # noqa: BLE001
            history[(name, t)] = None
            log(f"  warmup {name} threads={t} FAILED: {e!r}")
            rows.append(_row(name, t, 1, 16, 4, status="error", reason=f"warmup failed: {e!r}"))
    for P in prompts:
        for B in batches:
            for name, t in variants:
                r = runners[name]
                Puse = min(P, r.config.context_length - new)
                base = _row(name, t, B, Puse, new, prompt_requested=P)
                hist = history.get((name, t))
                if hist is None:
                    rows.append({**base, "status": "skipped", "reason": "engine failed to start"})
                    continue
                if time.perf_counter() > deadline:
                    rows.append({**base, "status": "skipped", "reason": "time limit of the run reached"})
                    continue
                big = [(b, p) for b, p in oom.get((name, t), []) if b <= B and p <= Puse]
                if big:
                    rows.append({**base, "status": "skipped",
                                 "reason": f"out of memory at batch {big[0][0]}, prompt {big[0][1]}"})
                    continue
                dom = dominated(measured, name, t, Puse, B, prune) if prune else None
                if dom:
                    rows.append({**base, "status": "skipped",
                                 "reason": f"pruned: {dom[2]:.1f}x slower than threads={dom[0] or 'all'} "
                                           f"at batch {dom[1]}"})
                    log(f"  prune  {name:10s} t={t or 'all'} B={B} P={Puse}: {dom[2]:.1f}x slower than "
                        f"t={dom[0] or 'all'} at B={dom[1]}")
                    continue
                est = predict(hist, B, Puse, new)
                if est is not None and est > budget_s:
                    rows.append({**base, "status": "skipped", "predicted_s": est,
                                 "reason": f"predicted {est:.0f} s > budget {budget_s:.0f} s per run"})
                    log(f"  skip   {name:10s} t={t or 'all'} B={B} P={Puse}: predicted {est:.0f} s")
                    continue
                r.use_threads(t)
                prompts_arr = common.fixed_prompts(B, Puse, r.config.vocab_size)
                try:
                    if est is not None and est < warm_below:
                        r.run(prompts_arr, min(new, 2))
                    # the best whole run and the best first token over the repeats: srm-max
                    # times its first token in a generate of its own, which on a busy machine
                    # may take longer than the best whole run (no decode time left to report)
                    best, prefill, reps, spent = None, float("inf"), 0, 0.0
                    while True:
                        clock, toks = r.run(prompts_arr, new)
                        reps += 1
                        spent += clock.total
                        prefill = min(prefill, clock.prefill)
                        if best is None or clock.total < best.total:
                            best = clock
                        if spent >= min_time or reps >= 3:
                            break
                    best.first = best.t0 + min(prefill, best.total)
                except Exception as e:  # noqa: BLE001
                    if is_oom(e):
                        oom.setdefault((name, t), []).append((B, Puse))
                        rows.append({**base, "status": "oom", "reason": f"{type(e).__name__}: {str(e)[:300]}"})
                        log(f"  OOM    {name} t={t} B={B} P={Puse}")
                    else:
                        rows.append({**base, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:500]}"})
                        log(f"  ERROR  {name} t={t} B={B} P={Puse}: {e!r}")
                        traceback.print_exc(limit=3)
                    gc.collect()
                    _empty_cache()
                    continue
                hist.append((B, Puse, new, best.total))
                measured.setdefault((name, t, Puse), {})[B] = best.total
                row = {**base, "status": "ok", "repeats": reps, "seconds": best.total,
                       "prefill_seconds": best.prefill,
                       "tokens_per_s": B * new / best.total,
                       "decode_tokens_per_s": (B * (new - 1) / (best.total - best.prefill)
                                               if new > 1 and best.total > best.prefill else None)}
                if est is not None:
                    row["predicted_s"] = est
                rows.append(row)
                tokens_seen.setdefault((B, Puse), {})[name] = toks
                log(f"  {name:10s} t={t or 'all':>3} B={B:4d} P={Puse:4d} N={new}: {best.total:7.2f} s "
                    f"(prefill {best.prefill:6.2f})  {row['tokens_per_s']:9.1f} tok/s  "
                    f"decode {_f(row['decode_tokens_per_s'])} tok/s")
                gc.collect()
    return rows, tokens_seen


def _f(x):
    return "-" if x is None else f"{x:.1f}"


def _row(engine, threads, batch, prompt, new, **kw):
    return {"engine": engine, "threads": threads if threads is not None else "all",
            "batch": batch, "prompt_len": prompt, "new_tokens": new, **kw}


# ------------------------------------------------------------------ summary
def best_rows(rows):
    """(engine, batch, prompt) -> the ok row with the most tokens/s over thread counts."""
    best = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        k = (r["engine"], r["batch"], r["prompt_len"])
        if k not in best or r["tokens_per_s"] > best[k]["tokens_per_s"]:
            best[k] = r
    return best


def best_decode(rows):
    best = {}
    for r in rows:
        if r["status"] != "ok" or r.get("decode_tokens_per_s") is None:
            continue
        k = (r["engine"], r["batch"], r["prompt_len"])
        if k not in best or r["decode_tokens_per_s"] > best[k]["decode_tokens_per_s"]:
            best[k] = r
    return best


def ratios(rows, metric="tokens_per_s"):
    """Per (batch, prompt): srm-max / each other engine at its best thread count."""
    best = best_rows(rows) if metric == "tokens_per_s" else best_decode(rows)
    out = []
    points = sorted({(b, p) for (_, b, p) in best}, key=lambda x: (x[1], x[0]))
    for b, p in points:
        mx = best.get(("srm-max", b, p))
        entry = {"batch": b, "prompt_len": p}
        for other in BASELINES:
            if not any(e == other for (e, _, _) in best):
                continue
            o = best.get((other, b, p))
            entry[f"srm-max/{other}"] = (mx[metric] / o[metric]) if (mx and o) else None
        out.append(entry)
    return out


def _short(e: str) -> str:
    return {"srm-torch": "torch", "llama-hf": "llama", "mamba-hf": "mamba"}.get(e, e)


def tables(rows, engines, roofline_tps=None):
    """Markdown: tokens/s (best thread count) per engine and srm-max's ratios to each,
    for the whole generate and for the decode phase."""
    out = []
    others = [e for e in engines if e != "srm-max"] if "srm-max" in engines else []
    for metric, title in (("tokens_per_s", "generated tokens/s, whole generate (prefill included)"),
                          ("decode_tokens_per_s", "decode-phase tokens/s (after the first token)")):
        best = best_rows(rows) if metric == "tokens_per_s" else best_decode(rows)
        status = {}
        for r in rows:
            status.setdefault((r["engine"], r["batch"], r["prompt_len"]), set()).add(r["status"])
        rat = {(e["batch"], e["prompt_len"]): e for e in ratios(rows, metric)}
        points = sorted({(r["batch"], r["prompt_len"]) for r in rows if r["batch"] > 0},
                        key=lambda x: (x[1], x[0]))
        headers = ["prompt", "batch", *[f"{e} (threads)" for e in engines],
                   *[f"max/{_short(e)}" for e in others]]
        if metric == "decode_tokens_per_s" and roofline_tps:
            headers.append("max % roofline")
        body = []
        for b, p in points:
            cells = [p, b]
            for e in engines:
                r = best.get((e, b, p))
                if r:
                    cells.append(f"{common.fmt(r[metric])} ({r['threads']})")
                else:
                    st = status.get((e, b, p), set()) - {"ok"}
                    cells.append("/".join(sorted(st)) if st else ("n/a" if (e, b, p) in status else "-"))
            for e in others:
                v = rat.get((b, p), {}).get(f"srm-max/{e}")
                cells.append("-" if v is None else f"{v:.2f}x")
            if metric == "decode_tokens_per_s" and roofline_tps:
                r = best.get(("srm-max", b, p))
                cells.append("-" if not r else f"{100 * r[metric] / roofline_tps:.0f}%")
            body.append(cells)
        out.append(f"**{title}**\n\n" + common.markdown_table(headers, body))
    return "\n\n".join(out)


# ------------------------------------------------------------------ main
def parse_args(argv=None, gpu: bool = False):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="batch 1,16,64 at prompt 16 and 1024, 32 new tokens, 45 s per run, 7.5 min of runs, "
                         "--prune-threads 2")
    ap.add_argument("--engines", default=None,
                    help=f"comma list of {', '.join(ENGINES)} (default: all but vllm on CPU)")
    ap.add_argument("--batches", default=None, help="comma list (default 1,16,64,256,1024)")
    ap.add_argument("--prompts", default=None, help="comma list of prompt lengths (default 16,512,1024)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per sample (default 64)")
    ap.add_argument("--threads", default="1,2", help="torch thread counts to try (comma list; CPU only)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip a run predicted to take longer (default 150; --quick 45)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="skip whatever is left after this long (default none; --quick 7.5)")
    ap.add_argument("--prune-threads", type=float, default=None,
                    help="do not rerun a thread count that was this many times slower than another at the "
                         "previous batch (default off; --quick 2)")
    ap.add_argument("--llama-cache", default="static", choices=("static", "dynamic"),
                    help="the Transformer's KV cache: preallocated (static, the default: no copy of the "
                         "cache per step, unlike the concatenating DynamicCache) or dynamic")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="SRM context n")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps-per-call", type=int, default=32, help="srm-max decode steps per engine call")
    ap.add_argument("--no-max-pin", action="store_true",
                    help="run srm-max only with MAX's default threads (no child pinned to fewer cores)")
    ap.add_argument("--roofline-n", type=int, default=2048, help="size of the square matmul for the roofline")
    ap.add_argument("--out", default=None, help="output path stem (default bench/results/throughput[-quick])")
    ap.add_argument("--no-plot", action="store_true")
    if gpu:
        ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
        ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's share of the GPU")
    a = ap.parse_args(argv)
    a.gpu = gpu
    if not gpu:
        a.dtype = "float32"
    q = a.quick
    a.batches = _ints(a.batches or ("1,16,64" if q else "1,16,64,256,1024"))
    a.prompts = _ints(a.prompts or ("16,1024" if q else "16,512,1024"))
    a.new_tokens = a.new_tokens or (32 if q else 64)
    a.threads = _ints(a.threads) if not gpu else [1]
    a.budget_s = a.budget_s if a.budget_s is not None else (45.0 if q else 150.0)
    a.max_minutes = a.max_minutes if a.max_minutes is not None else (7.5 if q else None)
    a.prune_threads = a.prune_threads if a.prune_threads is not None else (2.0 if q else 0.0)
    default_engines = ENGINES if gpu else tuple(e for e in ENGINES if e != "vllm")
    a.engines = [e.strip() for e in (a.engines or ",".join(default_engines)).split(",") if e.strip()]
    bad = [e for e in a.engines if e not in ENGINES]
    if bad:
        ap.error(f"unknown engine(s) {bad}: expected {', '.join(ENGINES)}")
    if "vllm" in a.engines and not gpu:
        ap.error("vllm runs on a GPU only (bench/h100.py)")
    if a.new_tokens < 2 or a.new_tokens >= a.context:
        ap.error("--new-tokens must be in [2, context)")
    stem = ("h100" if gpu else "throughput") + ("-quick" if q else "")
    a.out = Path(a.out) if a.out else common.RESULTS / stem
    return a


def _ints(s):
    return [int(x) for x in str(s).split(",") if x.strip()]


def build_runners(a, config, log=print):
    import torch

    common.quiet_transformers()
    ref = common.build_srm_reference(config)
    tdev = "cuda" if a.gpu else "cpu"
    tdtype = getattr(torch, a.dtype)
    runners = {}
    for name in a.engines:
        t = time.perf_counter()
        try:
            if name == "srm-max":
                runners[name] = SRMMaxRunner(config, common.srm_weights(ref), device="gpu" if a.gpu else "cpu",
                                             dtype=a.dtype, steps_per_call=a.steps_per_call,
                                             pin=not a.no_max_pin)
            elif name == "srm-torch":
                runners[name] = SRMTorchRunner(config, ref, device=tdev, dtype=a.dtype)
            elif name == "llama-hf":
                runners[name] = HFRunner(config, common.build_llama(config, torch_dtype=tdtype, device=tdev),
                                         "llama-hf", device=tdev, dtype=a.dtype,
                                         cache=None if a.llama_cache == "dynamic" else a.llama_cache)
            elif name == "mamba-hf":
                runners[name] = HFRunner(config, common.build_mamba(config).to(device=tdev, dtype=tdtype),
                                         "mamba-hf", device=tdev, dtype=a.dtype)
            elif name == "vllm":
                runners[name] = VLLMRunner(config, dtype=a.dtype,
                                           gpu_memory_utilization=a.gpu_memory_utilization)
        except Exception as e:  # noqa: BLE001
            log(f"  {name}: could not be built: {type(e).__name__}: {str(e)[:300]}")
            runners.pop(name, None)
            continue
        log(f"  built {name:10s} {runners[name].params / 1e6:6.2f} M parameters in {time.perf_counter() - t:.1f} s")
    return runners


def token_agreement(tokens_seen):
    """Fraction of greedy tokens on which srm-max and srm-torch agree, per grid point
    (random weights give flat logits: near-ties may flip under different summation orders)."""
    out = []
    for (b, p), d in sorted(tokens_seen.items()):
        if "srm-max" in d and "srm-torch" in d and d["srm-max"].shape == d["srm-torch"].shape:
            out.append({"batch": b, "prompt_len": p,
                        "agree": float((d["srm-max"] == d["srm-torch"]).mean()),
                        "first_token_agree": float((d["srm-max"][:, 0] == d["srm-torch"][:, 0]).mean())})
    return out


def roofline_flops(a) -> dict:
    if a.gpu:
        return common.matmul_flops_torch(max(a.roofline_n, 8192), device="cuda", dtype=a.dtype)
    return common.matmul_flops(a.roofline_n)


def main(argv=None, gpu: bool = False) -> int:
    a = parse_args(argv, gpu)
    t_start = time.perf_counter()
    config = common.srm_config(a.d_model, a.layers, a.heads, a.context, a.vocab)
    print(f"# SRM throughput benchmark ({'quick' if a.quick else 'full'}, {'GPU ' if gpu else 'CPU '}{a.dtype}): "
          f"SRM d={config.d_model} L={config.n_layers} H={config.n_heads} n={config.context_length} "
          f"V={config.vocab_size}, {config.num_parameters() / 1e6:.2f} M parameters", flush=True)
    info = common.machine_info()
    if gpu:
        info |= common.gpu_info()
    print(f"# machine: {info['processor']}, {info['cpu_count']} cores, load average {info['load_average_at_start']}"
          + (f"; GPU {info.get('gpu_name')}" if gpu else ""))
    mm = roofline_flops(a)
    p_used = common.srm_matmul_params(config)
    roofline_tps = mm["flops"] / (2 * p_used)
    print(f"# roofline: {mm['flops'] / 1e9:,.1f} GFLOP/s ({mm['what']}, best of {mm['repeats']}); SRM decode "
          f"uses {p_used / 1e6:.2f} M matmul parameters per token -> at most {roofline_tps:,.0f} tok/s", flush=True)
    print("# building engines ...", flush=True)
    runners = build_runners(a, config)
    mx = runners.get("srm-max")
    if mx is not None and sum(mx.gen.engine.compile_seconds.values()) > 30:
        print(f"# note: the MAX graphs were not in the cache and took {mx.load_seconds:.0f} s to compile "
              f"(cached now in ~/.cache/srm-max: later runs load them in seconds)", flush=True)
    # The time limit counts the runs only, not building the engines (a cold MAX compile takes minutes).
    deadline = time.perf_counter() + 60 * a.max_minutes if a.max_minutes else math.inf
    print(f"# grid: batch {a.batches}, prompt {a.prompts}, {a.new_tokens} new tokens"
          + ("" if gpu else f", torch threads {a.threads}")
          + f", budget {a.budget_s:.0f} s per run" + (f", {a.max_minutes:g} min of runs" if a.max_minutes else ""),
          flush=True)
    try:
        rows, seen = run_grid(runners, a.threads, a.batches, a.prompts, a.new_tokens, a.budget_s, deadline,
                              log=lambda m: print(m, flush=True), prune=a.prune_threads or None)
    finally:
        for r in runners.values():
            r.close()
    for name in a.engines:
        if name not in runners:
            rows.append(_row(name, None, 0, 0, a.new_tokens, status="error", reason="could not be built"))
    mm2 = roofline_flops(a)  # again after the runs: the best of both (other load comes and goes)
    if mm2["flops"] > mm["flops"]:
        mm = mm2
    result = summarize(a, config, info, mm, runners, rows, seen, time.perf_counter() - t_start)
    report(result, a.out, gpu=gpu, plot=not a.no_plot)
    return 0


def summarize(a, config, info, mm, runners, rows, seen, elapsed) -> dict:
    p_used = common.srm_matmul_params(config)
    roofline_tps = mm["flops"] / (2 * p_used)
    bd = best_decode(rows)
    max_dec = [r for (e, _, _), r in bd.items() if e == "srm-max"]
    best_max = max(max_dec, key=lambda r: r["decode_tokens_per_s"]) if max_dec else None
    roof = {"matmul": mm, "srm_matmul_params_per_token": p_used, "flops_per_token": 2 * p_used,
            "roofline_tokens_per_s": roofline_tps}
    if best_max:
        roof |= {"best_srm_max_decode_tokens_per_s": best_max["decode_tokens_per_s"],
                 "at": {"batch": best_max["batch"], "prompt_len": best_max["prompt_len"]},
                 "percent_of_roofline": 100 * best_max["decode_tokens_per_s"] / roofline_tps}
    engines = [e for e in a.engines if e in runners]
    return {
        "benchmark": "throughput", "mode": "quick" if a.quick else "full",
        "device": "gpu" if a.gpu else "cpu", "dtype": a.dtype,
        "command": common.command_line(), "elapsed_s": elapsed, "machine": info,
        "srm_config": config.to_dict(),
        "engines": {n: r.describe() for n, r in runners.items()},
        "grid": {"batches": a.batches, "prompts": a.prompts, "new_tokens": a.new_tokens,
                 "torch_threads": None if a.gpu else a.threads, "budget_s": a.budget_s,
                 "max_minutes": a.max_minutes, "prune_threads": a.prune_threads},
        "notes": [
            "tokens_per_s = batch * new_tokens / wall time of the whole generate (prefill included)",
            "decode_tokens_per_s = batch * (new_tokens - 1) / time after the first new token",
            "best = the thread count with the most tokens/s; srm-max 'all' = MAX's own thread pool on every "
            "core, srm-max N = a child process pinned to N cores",
            "prompt_len is min(requested, n - new_tokens): a sequence never passes the SRM context",
            "random weights; greedy; the same fixed prompts for every engine",
            "roofline = matmul FLOP/s (best of a measurement before and one after the runs) / "
            "(2 * SRM matmul parameters per token), output layer included",
        ],
        "roofline": roof,
        "ratios_tokens_per_s": ratios(rows), "ratios_decode_tokens_per_s": ratios(rows, "decode_tokens_per_s"),
        "srm_max_vs_torch_token_agreement": token_agreement(seen), "runs": rows,
        "markdown": tables(rows, engines, roofline_tps),
    }


def report(result: dict, out: Path, gpu: bool = False, plot: bool = True) -> None:
    json_path = common.write_json(out.with_suffix(".json"), result)
    cfg, g = result["srm_config"], result["grid"]
    where = result["machine"].get("gpu_name") if gpu else f"{result['machine']['cpu_count']} cores"
    png = common.plot_throughput(
        result["runs"], out.with_suffix(".png"),
        f"SRM vs baselines ({cfg['d_model']}d x {cfg['n_layers']}, {result['dtype']}), {g['new_tokens']} new "
        f"tokens, {where}" + ("" if gpu else " (best thread count per engine)")) if plot else None
    print()
    print(result["markdown"])
    print()
    roof = result["roofline"]
    if "percent_of_roofline" in roof:
        print(f"Roofline: {roof['matmul']['flops'] / 1e9:,.1f} GFLOP/s / (2 x "
              f"{roof['srm_matmul_params_per_token'] / 1e6:.2f} M) = {roof['roofline_tokens_per_s']:,.0f} tok/s; "
              f"srm-max best decode {roof['best_srm_max_decode_tokens_per_s']:,.0f} tok/s "
              f"(batch {roof['at']['batch']}, prompt {roof['at']['prompt_len']}) = {roof['percent_of_roofline']:.0f}%")
    for e in result["srm_max_vs_torch_token_agreement"]:
        print(f"srm-max vs srm-torch greedy tokens agree: {100 * e['agree']:.1f}% "
              f"(first token {100 * e['first_token_agree']:.0f}%; batch {e['batch']}, prompt {e['prompt_len']})")
    bad = [e for e in result["srm_max_vs_torch_token_agreement"] if e["first_token_agree"] < 0.9]
    if bad:
        print("WARNING: srm-max and the PyTorch reference disagree on the first greedy token at prompt "
              f"{sorted({e['prompt_len'] for e in bad})}: the two do not compute the same model there, "
              "so those srm-max numbers are not trustworthy (see tests/models/srm/test_engine.py)")
    thr = g["torch_threads"]
    print("Threads: " + "; ".join(
        f"{n}: {d.get('threads') or ('torch ' + ','.join(map(str, thr)) + ', best shown')}"
        for n, d in result["engines"].items()))
    for r in result["runs"]:
        if r["status"] != "ok":
            print(f"{r['status']}: {r['engine']} threads={r['threads']} batch={r['batch']} "
                  f"prompt={r['prompt_len']}: {r.get('reason')}")
    print(f"\nwrote {json_path}" + (f" and {png}" if png else "") + f" in {result['elapsed_s'] / 60:.1f} min")


if __name__ == "__main__":
    sys.exit(main())
