"""The reference Transformer (``srm_max.reference.transformer``) served by llama.cpp: a GGUF
exporter and a batched sampling engine over llama-cpp-python's low-level API.

**Export.** The reference is GPT-2 layer for layer (see ``bench.hf_transformer``), so it is
written as llama.cpp's ``gpt2`` architecture, float32, no quantization. ggml's matrices are
[out, in] in numpy order (GGUF lists dimensions innermost first, the reverse of numpy), which
is ``nn.Linear``'s layout: the weights are stored as they are, q|k|v fused in the reference's
order. The vocabulary is declared as ``tokenizer.ggml.model = "none"`` with
``gpt2.vocab_size``: llama.cpp then skips its tokenizer and takes token ids directly.

**What llama.cpp computes.** Its ``gpt2`` graph applies ggml's GELU, the tanh approximation
read from a float16 table (the input rounded to float16, the output stored in float16), not
the exact erf GELU the reference was trained with, and no GGUF key selects another. So
llama.cpp serves a slightly different function: ``with_ggml_gelu`` is the reference with
that GELU (``ggml_gelu``), which llama.cpp matches to float32 rounding on a small model (on a
trained one, rounding can move a GELU input across a float16 step, and flash attention rounds
differently); the difference from the exact reference is measured and reported, not hidden
(``tests/bench/test_accuracy_per_compute.py``, ``bench.accuracy_per_compute``).

**Sampling** (``sample``, the contract of ``bench.kv_decode.sample``): sequences of one prompt
length share a ``llama_batch``, one llama.cpp sequence per row, up to ``n_seq_max`` rows
(llama.cpp allows 256). The prompts run as one prefill; each step then decodes one token per
row still running (a row that produced the stop token leaves the batch), and the next token
is drawn in numpy from ``softmax(logits / temperature)``, the rule of the other engines. The
KV cache is float32, like the weights.

The settings are the fastest on this task's model, one thread: a unified KV cache (one
cache for all sequences, each token masked to its own) with flash attention and batches of
16-32 rows. Per-sequence caches (``kv_unified = false``) pad every sequence to 256 cells and
attend over all of them, and llama.cpp computes a batch in one piece per run of consecutive
sequence ids; with a unified cache the attention covers every sequence's cells, so its cost
grows with the square of the batch, which is why batches stay small.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.common import sample_by_prompt_length
from srm_max.reference.transformer import Transformer

ARCH = "gpt2"
# llama.cpp's limit on sequences per context (LLAMA_MAX_SEQ in src/llama-cparams.h)
MAX_SEQUENCES = 256


# ------------------------------------------------------------------ export
def gguf_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """The reference weights under llama.cpp's ``gpt2`` tensor names, float32, numpy layout."""
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["token_embedding.weight"], "position_embd.weight": sd["position_embedding.weight"],
           "output_norm.weight": sd["final_norm.weight"], "output_norm.bias": sd["final_norm.bias"],
           "output.weight": sd["output_layer.weight"]}
    for i in range(model.config.n_layers):
        for ours, theirs in (("attn_norm", "attn_norm"), ("mlp_norm", "ffn_norm"), ("attn.qkv", "attn_qkv"),
                             ("attn.out_proj", "attn_output"), ("mlp.0", "ffn_up"), ("mlp.2", "ffn_down")):
            for kind in ("weight", "bias"):
                out[f"blk.{i}.{theirs}.{kind}"] = sd[f"blocks.{i}.{ours}.{kind}"]
    return {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in out.items()}


def write_gguf(model: Transformer, path: str | Path) -> Path:
    """Write ``model`` as a float32 GGUF file for llama.cpp (atomically: a reader never sees
    half a file)."""
    import gguf

    cfg = model.config
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, ARCH)
        w.add_name("srm-max reference Transformer")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_context_length(cfg.context_length)
        w.add_embedding_length(cfg.d_model)
        w.add_feed_forward_length(cfg.ffn_dim)
        w.add_block_count(cfg.n_layers)
        w.add_head_count(cfg.n_heads)
        w.add_layer_norm_eps(cfg.layer_norm_eps)
        w.add_vocab_size(cfg.vocab_size)
        w.add_tokenizer_model("none")  # ids in, logits out: llama.cpp's tokenizer is never used
        for name, array in gguf_tensors(model).items():
            w.add_tensor(name, array)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# ------------------------------------------------------------------ the function llama.cpp computes
def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU on float32 (``ggml_vec_gelu_f32``): the tanh approximation looked up in a
    float16 table, so both its input and its output are rounded to float16; exact beyond +-10."""
    h = x.half().float()
    table = (0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * h * (1.0 + 0.044715 * h * h)))).half().float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))


class _GGMLGELU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ggml_gelu(x)


def with_ggml_gelu(model: Transformer) -> Transformer:
    """A copy of ``model`` whose MLPs use ``ggml_gelu``: the function llama.cpp evaluates."""
    twin = Transformer(model.config).eval()
    twin.load_state_dict(model.state_dict())
    for block in twin.blocks:
        block.mlp[1] = _GGMLGELU()
    return twin


# ------------------------------------------------------------------ the engine
def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:  # an optional extra: pip install -e '.[llama]'
        raise ImportError("llama.cpp engine needs llama-cpp-python (pip install -e '.[llama]')") from e
    return llama_cpp


_ERROR_LEVEL = 4  # GGML_LOG_LEVEL_ERROR (CONT, 5, continues any level: the loading dots)


class LlamaCppEngine:
    """A GGUF model and one llama.cpp context of ``n_seq_max`` sequences of up to
    ``context_length`` tokens, ``threads`` CPU threads. ``close()`` frees both."""

    def __init__(self, gguf_path: str | Path, context_length: int, n_seq_max: int = 16, threads: int = 1,
                 flash_attn: bool = True, kv_unified: bool = True):
        lc = self.lc = _import_llama_cpp()
        if not 1 <= n_seq_max <= MAX_SEQUENCES:
            raise ValueError(f"n_seq_max must be 1..{MAX_SEQUENCES}, got {n_seq_max}")
        # llama.cpp logs every load to stderr; keep its errors only
        self._log = lc.llama_log_callback(
            lambda level, text, _: sys.stderr.write(text.decode(errors="replace")) if level == _ERROR_LEVEL else None)
        lc.llama_log_set(self._log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.context_length = context_length
        self.n_seq_max = n_seq_max
        p = lc.llama_context_default_params()
        p.n_seq_max = n_seq_max
        p.n_ctx = n_seq_max * context_length  # room for every sequence's whole context
        # a prefill of every row in one call, each row at most a context long
        p.n_batch = p.n_ubatch = n_seq_max * context_length
        p.n_threads = p.n_threads_batch = threads
        p.kv_unified = kv_unified
        p.type_k = p.type_v = lc.GGML_TYPE_F32
        p.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.no_perf = True
        self.params = {"n_seq_max": n_seq_max, "n_ctx": p.n_ctx, "n_batch": p.n_batch, "n_ubatch": p.n_ubatch,
                       "threads": threads, "kv_unified": kv_unified, "kv_type": "f32", "flash_attn": flash_attn}
        self.ctx = lc.llama_init_from_model(self.model, p)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context with {self.params}")
        self.memory = lc.llama_get_memory(self.ctx)
        self._batch_buffers(p.n_batch)

    def _batch_buffers(self, capacity: int) -> None:
        """A ``llama_batch`` over numpy arrays, so a step fills it with array writes, not a
        Python loop over tokens (one sequence id per token: ``seq_id[i]`` points at ``seq[i]``)."""
        lc = self.lc
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.want = np.zeros(capacity, np.int8)
        base = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *(ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)))
        b = self.batch = lc.llama_batch()
        b.token = self.token.ctypes.data_as(ctypes.POINTER(lc.llama_token))
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(lc.llama_pos))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(lc.llama_seq_id)))
        b.logits = self.want.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.capacity = capacity

    def clear(self) -> None:
        """Forget every sequence's cache."""
        self.lc.llama_memory_clear(self.memory, True)

    def decode(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, want: np.ndarray) -> np.ndarray:
        """One ``llama_decode`` of ``tokens`` at ``positions`` in sequences ``seqs``; the logits
        [sum(want), V] of the tokens flagged in ``want``, in batch order."""
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"{n} tokens exceed the batch capacity {self.capacity}")
        self.token[:n], self.pos[:n], self.seq[:n], self.want[:n] = tokens, positions, seqs, want
        self.batch.n_tokens = n
        rc = self.lc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = int(np.count_nonzero(want))
        out = self.lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(out, shape=(rows, self.n_vocab)).copy()

    def logits(self, ids: list[int]) -> np.ndarray:
        """The logits [T, V] at every position of one sequence (the check against the reference)."""
        self.clear()
        T = len(ids)
        out = self.decode(np.asarray(ids, np.int32), np.arange(T, dtype=np.int32), np.zeros(T, np.int32),
                          np.ones(T, np.int8))
        self.clear()
        return out

    def sample_batch(self, prompt: np.ndarray, max_new_tokens: int, temperature: float, stop_id: int,
                     rng: np.random.Generator) -> np.ndarray:
        """New ids [B, <= max_new_tokens] for ``prompt`` [B, T0] (rows of one length, B <= n_seq_max)."""
        B, T0 = prompt.shape
        if B > self.n_seq_max:
            raise ValueError(f"{B} rows exceed n_seq_max {self.n_seq_max}")
        steps = min(max_new_tokens, self.context_length - T0)
        if steps < 1:
            raise ValueError(f"prompt of {T0} tokens leaves no room in context {self.context_length}")
        self.clear()
        rows = np.arange(B, dtype=np.int32)  # the running rows, which are also their sequence ids
        last = np.zeros(B * T0, np.int8)
        last[T0 - 1::T0] = 1
        logits = self.decode(prompt.reshape(-1).astype(np.int32), np.tile(np.arange(T0, dtype=np.int32), B),
                             np.repeat(rows, T0), last)
        out = np.full((B, steps), stop_id, np.int64)  # after its stop token a row is cut anyway
        for j in range(steps):
            nxt = draw(logits, temperature, rng)
            out[rows, j] = nxt
            going = nxt != stop_id
            rows, nxt = rows[going], nxt[going]
            if len(rows) == 0 or j + 1 == steps:
                return out[:, : j + 1]
            logits = self.decode(nxt.astype(np.int32), np.full(len(rows), T0 + j, np.int32), rows,
                                 np.ones(len(rows), np.int8))
        return out

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lc.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        self.close()


def draw(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """One id per row of ``logits`` [B, V] from ``softmax(logits / temperature)`` (inverse CDF)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=1, keepdims=True))
    cdf = np.cumsum(p, axis=1)
    u = rng.random(len(p)) * cdf[:, -1]
    return np.minimum((cdf < u[:, None]).sum(axis=1), p.shape[1] - 1)


def sample(engine: LlamaCppEngine, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
           stop_id: int, seed: int, max_batch: int = 1024) -> list[list[list[int]]]:
    """``n`` completions of every prompt, result[prompt][sample], each cut after its stop token
    (the contract of ``bench.kv_decode.sample``); batches of at most ``min(max_batch, n_seq_max)``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rng = np.random.default_rng(seed)
    return sample_by_prompt_length(
        prompts, n, min(max_batch, engine.n_seq_max), stop_id,
        lambda rows: engine.sample_batch(np.array(rows, dtype=np.int32), max_new_tokens, temperature, stop_id,
                                         rng).tolist())


__all__ = ["ARCH", "MAX_SEQUENCES", "gguf_tensors", "write_gguf", "ggml_gelu", "with_ggml_gelu",
           "LlamaCppEngine", "draw", "sample"]
