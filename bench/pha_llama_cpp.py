"""llama.cpp's decode and prefill of a Llama of the PHA attention branch's shape, the
baseline of bench/pha_long_context.py.

The Llama: d 256, 4 blocks, GQA 4 query / 2 KV heads of 64, SwiGLU 1024, RMSNorm, RoPE,
tied embeddings, the PHA's vocabulary; random weights (``torch.manual_seed(0)``: speed
depends only on shapes), written with transformers' ``save_pretrained`` and converted to
a float32 GGUF by llama.cpp's own ``convert_hf_to_gguf.py``.

llama.cpp is built from the ``llama-cpp-python`` source distribution's
``vendor/llama.cpp`` (the version the optional ``llama`` extra installs), only its
``llama-batched-bench`` (about 4 minutes on 2 cores; once per machine, in
``SRM_MAX_BENCH_CACHE``, default ``~/.cache/srm-max-bench``). ``llama-batched-bench``
runs the prompts of every sequence as one prefill, then ``ntg`` decode steps of all of
them; it reports prompt tokens/s (``S_PP``) and decode tokens/s over all sequences
(``S_TG``). Flash attention is on by default on a CPU; the KV cache is float16.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp is the build
CACHE = Path(os.environ.get("SRM_MAX_BENCH_CACHE", Path.home() / ".cache" / "srm-max-bench"))
BENCH_BINARY = "llama-batched-bench"


def llama_cpp_dir(cache: Path = CACHE) -> Path:
    return cache / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def build(cache: Path = CACHE) -> Path:
    """The ``llama-batched-bench`` binary, built on first use -> its path."""
    src = llama_cpp_dir(cache)
    binary = src / "build" / "bin" / BENCH_BINARY
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        sdist = cache / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={VERSION}", "-d", str(cache)], check=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    t0 = time.perf_counter()
    subprocess.run(["cmake", "-S", ".", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"], cwd=src, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", BENCH_BINARY, f"-j{os.cpu_count() or 1}"], cwd=src,
                   check=True)
    print(f"built {binary} in {time.perf_counter() - t0:.0f} s", flush=True)
    return binary


def llama_config(pha_config):
    """transformers' LlamaConfig of ``pha_config``'s attention branch and model size."""
    from transformers import LlamaConfig

    c = pha_config
    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                       num_attention_heads=c.n_q_heads, num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
                       intermediate_size=4 * c.d_model, max_position_embeddings=c.context_length,
                       tie_word_embeddings=True, rms_norm_eps=1e-5)


def tokenizer_of_vocab(tokenizer_file: Path, vocab_size: int) -> dict:
    """The BPE tokenizer in ``tokenizer_file`` cut to its first ``vocab_size`` ids (a JSON dict).

    A BPE vocabulary grows one merge at a time, so the ids below ``vocab_size`` with the
    merges that make them are a complete tokenizer of their own. A tokenizer no larger than
    ``vocab_size`` comes back unchanged."""
    spec = json.loads(Path(tokenizer_file).read_text())
    model = spec["model"]
    if model["type"] != "BPE":
        raise ValueError(f"{tokenizer_file}: a BPE tokenizer is needed, not {model['type']}")
    kept = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    model["vocab"] = kept
    merges = [m if isinstance(m, list) else m.split(" ", 1) for m in model["merges"]]
    model["merges"] = [[a, b] for a, b in merges if a in kept and b in kept and a + b in kept]
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] < vocab_size]
    return spec


def write_gguf(pha_config, out_dir: Path, cache: Path = CACHE) -> tuple[Path, int]:
    """The same-shape Llama as a float32 GGUF in ``out_dir`` -> (its path, parameters)."""
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from srm_max.embedded import EMBEDDED_MODEL_DIR

    gguf = out_dir / f"llama-pha-shape-{pha_config.context_length}.gguf"
    hf = out_dir / "hf"
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(pha_config))
    params = sum(p.numel() for p in model.parameters())
    if gguf.exists():
        return gguf, params
    model.save_pretrained(hf)
    # any tokenizer of the vocabulary's size: the timing never tokenizes text, but the converter
    # refuses a tokenizer with ids the model's embedding does not have
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "vocab-tokenizer.json").write_text(json.dumps(tokenizer_of_vocab(EMBEDDED_MODEL_DIR / "tokenizer.json",
                                                                           pha_config.vocab_size)))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(hf / "vocab-tokenizer.json"))
    tokenizer.save_pretrained(hf)
    src = llama_cpp_dir(cache)
    # the converter tries sentencepiece first (not installed), then stops at a BPE
    # tokenizer whose pre-tokenizer hash it does not know: taking the tokenizer as GPT-2's
    # byte-level BPE gets past both (no text is tokenized here)
    script = (f"import sys, runpy; sys.path[:0] = [{str(src)!r}, {str(src / 'gguf-py')!r}]\n"
              "import conversion.base as base, conversion.llama as llama\n"
              "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
              "llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()\n"
              f"sys.argv = ['convert_hf_to_gguf.py', {str(hf)!r}, '--outtype', 'f32', '--outfile', {str(gguf)!r}]\n"
              f"runpy.run_path({str(src / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return gguf, params


# Runs of llama-batched-bench per timed call: a run now and then ends with its table's header
# alone and exit status 0 (seen beside the MAX engines' benchmark, not reproduced alone); it is
# run again, and the failure printed, rather than losing the whole benchmark's run.
ATTEMPTS = 3

ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


def parse_batched_bench(text: str) -> list[dict]:
    """``llama-batched-bench``'s table -> one dict per row (PP, TG, B, N_KV, times and rates)."""
    keys = ("pp", "tg", "batch", "n_kv", "t_pp_s", "prompt_tokens_per_s", "t_tg_s", "decode_tokens_per_s", "t_s",
            "tokens_per_s")
    rows = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            vals = m.groups()
            rows.append({k: (int(v) if i < 4 else float(v)) for i, (k, v) in enumerate(zip(keys, vals))})
    return rows


def run(gguf: Path, context: int, new_tokens: int, batches, threads: int = 2, binary: Path | None = None) -> list[dict]:
    """Prefill ``context - new_tokens`` tokens per sequence, then ``new_tokens`` decode steps,
    at each batch -> the parsed rows (one per batch)."""
    binary = binary or build()
    prompt = context - new_tokens
    cells = max(batches) * context + 256  # every sequence's prompt and new tokens, with llama.cpp's padding
    cmd = [str(binary), "-m", str(gguf), "-c", str(cells), "-npp", str(prompt), "-ntg", str(new_tokens),
           "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads)]
    for attempt in range(1, ATTEMPTS + 1):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows = parse_batched_bench(proc.stdout)
        if proc.returncode == 0 and len(rows) == len(batches):
            return rows
        failure = f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        if attempt < ATTEMPTS:
            print(f"llama-batched-bench attempt {attempt} of {ATTEMPTS} gave no table; again:\n{failure}", flush=True)
    raise RuntimeError(failure)


__all__ = ["build", "llama_config", "parse_batched_bench", "run", "tokenizer_of_vocab", "write_gguf"]
