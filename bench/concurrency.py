"""Concurrency: the largest batch whose decode state fits a memory budget, SRM vs Transformer.

    python -m bench.concurrency                       # 4 GiB, contexts 1024 and 2048
    python -m bench.concurrency --budget-gib 8 --contexts 2048

For each model and context T the benchmark really allocates the weights plus the
structures a decode step keeps per sample, and finds the largest batch B within the
budget by doubling, then bisection:

    srm-max    the engine's own state ``Buffer`` [L, B, H, hd] (``Engine.empty_states``),
               the ids and positions [B] and the per-sample sampling buffers;
               weights = the arrays the engine binds (its weight registry)
    srm-torch  the reference's ``empty_state(B)`` [L, B, H, hd] plus ids and positions [B]
    llama-hf   a transformers ``DynamicCache`` filled with K and V [B, kv_heads, T, head_dim]
               for every layer, plus ids and positions
    mamba-hf   the transformers Mamba cache (conv and SSM states of every layer), plus ids

The per-layer cache tensors of the Hugging Face models are found by running the model
on a small probe batch and reading the cache it returns (so their real layout is used,
not a formula); then for batch B each is allocated at batch B (and, for the KV cache,
length T). Bytes are counted from the allocated tensors (``nbytes``); the growth of the
process's resident memory is recorded next to it as a cross-check. The SRM's state does
not depend on T: its context only bounds T (the SRM is built with n = max context).

Two numbers per model: the cache/state alone (the ratio this benchmark is about) and the
same plus one decode step's logits [B, V] float32, which every model materialises.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import numpy as np

from bench import common

MODELS = ("srm-max", "srm-torch", "llama-hf", "mamba-hf")
TORCH_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


class DoesNotFit(Exception):
    pass


class Tally:
    """Allocated bytes so far; refuses an allocation that would pass the budget."""

    def __init__(self, budget: int, base: int):
        self.budget, self.bytes, self.keep = budget, base, []

    def check(self, nbytes: int):
        if self.bytes + nbytes > self.budget:
            raise DoesNotFit

    def add(self, obj, nbytes: int):
        self.bytes += int(nbytes)
        self.keep.append(obj)
        return obj


def _torch_zeros(tally: Tally, shape, dtype):
    import torch

    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    tally.check(n)
    t = torch.zeros(shape, dtype=dtype)  # zero-filled: the pages are touched
    return tally.add(t, t.nbytes)


def _buffer_bytes(buf) -> int:
    return int(buf.num_elements) * int(buf.element_size)


def _touch(buf):
    """Write the pages of a host Buffer (numpy zeros may be lazily mapped)."""
    if buf.is_host:
        buf.to_numpy().fill(0)


# ------------------------------------------------------------------ models
class Model:
    name = ""

    def weight_bytes(self) -> int:
        raise NotImplementedError

    def allocate(self, tally: Tally, batch: int, context: int) -> None:
        raise NotImplementedError

    def per_sample_note(self) -> str:
        return ""


class SRMMax(Model):
    name = "srm-max"

    def __init__(self, config, weights):
        from srm_max.models.srm.engine import Engine

        # Building an Engine compiles nothing (graphs are loaded on first use).
        self.engine = Engine(config, weights, dtype="float32", device="cpu")
        self.config = config

    def weight_bytes(self):
        total = 0
        for v in self.engine.weights.values():
            total += v.nbytes if isinstance(v, np.ndarray) else _buffer_bytes(v)
        return total

    def allocate(self, tally, batch, context):
        from srm_max.runtime.call_types import SamplingArrays

        c, eng = self.config, self.engine
        tally.check(4 * c.n_layers * batch * c.d_model)
        st = eng.empty_states(batch)
        _touch(st)
        tally.add(st, _buffer_bytes(st))
        for arr in (np.zeros(batch, np.int64), np.full(batch, context - 1, np.int64)):  # ids, positions
            tally.check(arr.nbytes)
            b = eng.to_device(arr)
            tally.add(b, _buffer_bytes(b))
        s = SamplingArrays.greedy(batch)
        tally.check(batch * 24)
        for b in eng.sampling_buffers(s):
            tally.add(b, _buffer_bytes(b))

    def per_sample_note(self):
        c = self.config
        return f"state [L={c.n_layers}, H={c.n_heads}, hd={c.head_dim}] f32 + id, position, sampling params"


class SRMTorch(Model):
    name = "srm-torch"

    def __init__(self, config, model):
        self.config, self.model = config, model

    def weight_bytes(self):
        return sum(p.nbytes for p in self.model.parameters())

    def allocate(self, tally, batch, context):
        import torch

        c = self.config
        tally.check(4 * c.n_layers * batch * c.d_model)
        st = self.model.empty_state(batch)
        tally.add(st, st.nbytes)
        _torch_zeros(tally, (batch,), torch.long)  # ids
        _torch_zeros(tally, (batch,), torch.long)  # positions

    def per_sample_note(self):
        c = self.config
        return f"state [L={c.n_layers}, H={c.n_heads}, hd={c.head_dim}] f32 + id, position"


def _cache_tensors(cache) -> list:
    """Every tensor a transformers Cache holds, in order (KV layers and linear-attention layers)."""
    import torch

    out = []
    for layer in getattr(cache, "layers", []):
        for attr in ("keys", "values"):
            t = getattr(layer, attr, None)
            if isinstance(t, torch.Tensor) and t.numel():
                out.append(t)
        for attr in ("conv_states", "recurrent_states"):
            d = getattr(layer, attr, None)
            if isinstance(d, dict):
                out += [t for t in d.values() if isinstance(t, torch.Tensor)]
    return out


class HFModel(Model):
    """Probe the model's real cache at batch PB, length PT; allocate it at batch B, length T."""

    PROBES = ((5, 7), (11, 13), (17, 19))

    def __init__(self, name, model, grows_with_context: bool):
        import torch

        self.name, self.model, self.grows = name, model, grows_with_context
        for pb, pt in self.PROBES:
            ids = torch.randint(1, model.config.vocab_size, (pb, pt))
            with torch.inference_mode():
                out = model(input_ids=ids, use_cache=True)
            cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None) or \
                getattr(out, "cache_params", None)
            tensors = _cache_tensors(cache)
            if not tensors:
                raise RuntimeError(f"{name}: the model returned no cache tensors")
            specs = []
            ok = True
            for t in tensors:
                bdims = [i for i, s in enumerate(t.shape) if s == pb]
                tdims = [i for i, s in enumerate(t.shape) if s == pt]
                if len(bdims) != 1 or (grows_with_context and len(tdims) != 1):
                    ok = False
                    break
                specs.append((tuple(t.shape), bdims[0], tdims[0] if grows_with_context else None, t.dtype))
            if ok:
                self.specs = specs
                break
        else:
            raise RuntimeError(f"{name}: could not identify the batch/length dims of the cache")
        self.probe_shapes = [list(s[0]) for s in self.specs]

    def weight_bytes(self):
        return sum(p.nbytes for p in self.model.parameters())

    def allocate(self, tally, batch, context):
        import torch

        for shape, bd, td, dtype in self.specs:
            s = list(shape)
            s[bd] = batch
            if td is not None:
                s[td] = context
            _torch_zeros(tally, tuple(s), dtype)
        _torch_zeros(tally, (batch,), torch.long)  # ids
        if self.grows:
            _torch_zeros(tally, (batch,), torch.long)  # positions

    def allocate_dynamic_cache(self, tally, batch, context):
        """The Llama KV cache as a real ``DynamicCache``: ``update`` per layer, then the
        bytes the cache holds are counted (``update`` stores its own copy)."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        tally.add(cache, 0)
        pairs = [self.specs[i:i + 2] for i in range(0, len(self.specs), 2)]
        for layer, (k, v) in enumerate(pairs):
            shapes = []
            for shape, bd, td, dtype in (k, v):
                s = list(shape)
                s[bd], s[td] = batch, context
                shapes.append((tuple(s), dtype))
            need = sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in shapes)
            tally.check(need)
            before = sum(t.nbytes for t in _cache_tensors(cache))
            cache.update(*(torch.zeros(s, dtype=dt) for s, dt in shapes), layer)
            tally.add(None, sum(t.nbytes for t in _cache_tensors(cache)) - before)
        _torch_zeros(tally, (batch,), torch.long)
        _torch_zeros(tally, (batch,), torch.long)

    def per_sample_note(self):
        return "cache tensors (probe shapes at batch/length %s): %s" % (
            "B/T" if self.grows else "B", self.probe_shapes[:2] + (["..."] if len(self.probe_shapes) > 2 else []))


class Llama(HFModel):
    def __init__(self, model):
        super().__init__("llama-hf", model, grows_with_context=True)

    def allocate(self, tally, batch, context):
        self.allocate_dynamic_cache(tally, batch, context)


# ------------------------------------------------------------------ search
def fits(model: Model, batch: int, context: int, budget: int, weights: int, logits_vocab: int | None):
    """-> (fits?, measured bytes incl. weights, resident memory held by the structures).

    The resident figure is RSS while holding the structures minus RSS once they are freed
    (a cross-check of the counted bytes; small allocations can hide in the allocator)."""
    tally = Tally(budget, weights)
    try:
        model.allocate(tally, batch, context)
        if logits_vocab:
            import torch

            _torch_zeros(tally, (batch, logits_vocab), torch.float32)
        ok = True
    except (DoesNotFit, MemoryError, RuntimeError) as e:
        if not isinstance(e, DoesNotFit) and "alloc" not in str(e).lower():
            raise
        ok = False
    held = common.rss_bytes()
    used = tally.bytes
    tally.keep.clear()
    del tally
    return ok, used, held - common.rss_bytes()


def largest_batch(model, context, budget, logits_vocab=None, rel_tol=0.002, log=print):
    """Doubling, then bisection; returns a dict with the batch and the measured bytes."""
    weights = model.weight_bytes()
    if weights > budget:
        return {"batch": 0, "weights_bytes": weights, "reason": "weights alone exceed the budget"}
    gc.collect()
    t0 = time.perf_counter()
    lo, lo_info, hi = 0, None, None
    b = 1
    steps = 0
    while hi is None:
        ok, used, rss = fits(model, b, context, budget, weights, logits_vocab)
        steps += 1
        if ok:
            lo, lo_info = b, (used, rss)
            b *= 2
        else:
            hi = b
    while hi - lo > max(1, int(lo * rel_tol)):
        mid = (lo + hi) // 2
        ok, used, rss = fits(model, mid, context, budget, weights, logits_vocab)
        steps += 1
        if ok:
            lo, lo_info = mid, (used, rss)
        else:
            hi = mid
    res = {"batch": lo, "weights_bytes": weights, "steps": steps, "seconds": time.perf_counter() - t0,
           "search_precision": "exact" if hi - lo <= 1 else f"within {hi - lo} (rel {rel_tol})"}
    if lo_info:
        used, rss = lo_info
        res |= {"allocated_bytes": used, "state_bytes": used - weights,
                "state_bytes_per_sample": (used - weights) / lo, "rss_held_bytes": rss}
    return res


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gib", type=float, default=4.0)
    ap.add_argument("--contexts", default="1024,2048")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--no-logits", action="store_true", help="skip the 'state + logits' variant")
    ap.add_argument("--out", default=None, help="output path stem (default bench/results/concurrency)")
    a = ap.parse_args(argv)
    a.contexts = [int(x) for x in a.contexts.split(",") if x.strip()]
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in a.models if m not in MODELS]
    if bad:
        ap.error(f"unknown model(s) {bad}: expected {', '.join(MODELS)}")
    a.out = Path(a.out) if a.out else common.RESULTS / "concurrency"
    return a


def build(a, config, log=print):
    common.quiet_transformers()
    ref = common.build_srm_reference(config)
    models = {}
    for name in a.models:
        try:
            if name == "srm-max":
                models[name] = SRMMax(config, common.srm_weights(ref))
            elif name == "srm-torch":
                models[name] = SRMTorch(config, ref)
            elif name == "llama-hf":
                models[name] = Llama(common.build_llama(config))
            elif name == "mamba-hf":
                models[name] = HFModel("mamba-hf", common.build_mamba(config), grows_with_context=False)
        except Exception as e:  # noqa: BLE001
            log(f"  {name}: could not be built: {e!r}")
    return models


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    budget = int(a.budget_gib * common.GiB)
    config = common.srm_config(a.d_model, a.layers, a.heads, max(a.contexts), a.vocab)
    print(f"# concurrency: budget {a.budget_gib:g} GiB, contexts {a.contexts}; SRM d={config.d_model} "
          f"L={config.n_layers} H={config.n_heads} n={config.context_length} V={config.vocab_size} "
          f"({config.num_parameters() / 1e6:.2f} M parameters)")
    models = build(a, config)
    params = {}
    for n, m in models.items():
        params[n] = config.num_parameters() if n.startswith("srm") else common.num_params(m.model)
        print(f"  {n:10s} {params[n] / 1e6:6.2f} M parameters, weights {m.weight_bytes() / common.MiB:7.1f} MiB; "
              f"{m.per_sample_note()}")
    variants = [("state", None)] + ([] if a.no_logits else [("state+logits", config.vocab_size)])
    results = []
    for T in a.contexts:
        for name, m in models.items():
            for vname, vocab in variants:
                try:
                    r = largest_batch(m, T, budget, vocab)
                except Exception as e:  # noqa: BLE001
                    r = {"batch": None, "error": f"{type(e).__name__}: {e}"}
                r = {"model": name, "context": T, "variant": vname, **r}
                results.append(r)
                print(f"  T={T:5d} {name:10s} {vname:13s} largest batch {r.get('batch')!s:>9}  "
                      f"({common.fmt(r.get('state_bytes_per_sample', math.nan) / 1024)} KiB/sample, "
                      f"resident {common.fmt(r.get('rss_held_bytes', math.nan) / common.MiB)} MiB of {common.fmt(r.get('state_bytes', math.nan) / common.MiB)} MiB, "
                      f"{r.get('steps', 0)} allocations)", flush=True)
    by = {(r["model"], r["context"], r["variant"]): r.get("batch") for r in results}
    ratios = []
    for T in a.contexts:
        for vname, _ in variants:
            for srm in ("srm-max", "srm-torch"):
                for other in ("llama-hf", "mamba-hf"):
                    s, o = by.get((srm, T, vname)), by.get((other, T, vname))
                    if s and o:
                        ratios.append({"context": T, "variant": vname, "ratio": f"{srm}/{other}", "value": s / o})
    headers = ["context", "what is allocated", *[f"{n} batch" for n in models],
               *[f"srm-max/{o}" for o in ("llama-hf", "mamba-hf") if o in models and "srm-max" in models]]
    body = []
    for T in a.contexts:
        for vname, _ in variants:
            cells = [T, "state/cache" if vname == "state" else "state/cache + logits [B, V]"]
            cells += [f"{by.get((n, T, vname)):,}" if by.get((n, T, vname)) else "-" for n in models]
            for o in ("llama-hf", "mamba-hf"):
                if o in models and "srm-max" in models:
                    s, v = by.get(("srm-max", T, vname)), by.get((o, T, vname))
                    cells.append(f"{s / v:,.0f}x" if s and v else "-")
            body.append(cells)
    table = common.markdown_table(headers, body)
    elapsed = time.perf_counter() - t_start
    out = {
        "benchmark": "concurrency", "command": common.command_line(), "elapsed_s": elapsed,
        "machine": common.machine_info(), "budget_bytes": budget, "contexts": a.contexts,
        "srm_config": config.to_dict(), "parameters": params,
        "per_sample": {n: m.per_sample_note() for n, m in models.items()},
        "notes": [
            "allocated bytes = weights + every per-sample structure, counted from the allocated tensors",
            "rss_held_bytes = resident set while the structures are held minus after they are freed (cross-check of state_bytes)",
            "the SRM state is constant in the context; the Transformer KV cache grows 2*d*T per layer",
            "state+logits adds one decode step's logits [B, V] float32 for every model",
        ],
        "results": results, "ratios": ratios, "markdown": table,
    }
    path = common.write_json(a.out.with_suffix(".json"), out)
    print()
    print(table)
    print()
    for r in ratios:
        print(f"context {r['context']:5d} {r['variant']:13s} {r['ratio']:20s} {r['value']:10,.1f}x")
    print(f"\nwrote {path} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
