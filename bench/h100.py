"""bench-h100: the throughput benchmark on a GPU, bfloat16, at the paper's size.

    python -m bench.h100            # batch 1 .. 65536 (until memory runs out), prompt 16/512/1024
    python -m bench.h100 --quick    # batch 1, 64, 1024, 16384 at prompt 16 and 1024

SRM d=1024, 16 layers, 4 heads, n=1024, vocab 8000 (about 184 M parameters) on MAX
(``Generator(dtype="bfloat16", device="gpu")``) against a Llama of the same size
(transformers, SDPA attention, KV cache) and, when it is installed, vLLM serving that
Llama; the PyTorch reference SRM (bf16, CUDA) runs too. Each engine runs in its own
process (it gets the whole GPU, and an out-of-memory error cannot spoil the next
engine); a batch that runs out of memory ends that engine's larger batches. The
results are merged into ``bench/results/h100[-quick].json`` and ``.png`` with the same
layout as ``throughput.py``; the roofline uses a bf16 torch matmul on the GPU.

Without a GPU it stops at once: exit code 2, "no GPU found".
Any option of ``throughput.py`` can be passed (e.g. ``--batches``, ``--new-tokens``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common

PAPER_SIZE = ["--d-model", "1024", "--layers", "16", "--heads", "4", "--context", "1024", "--vocab", "8000"]
GPU_ENGINES = ("srm-max", "llama-hf", "vllm", "srm-torch")
NO_GPU_EXIT = 2


def find_gpu() -> str | None:
    """A description of the GPU that torch (CUDA) or MAX can use, or None."""
    found = []
    try:
        import torch

        if torch.cuda.is_available():
            found.append(f"torch: {torch.cuda.get_device_name(0)}")
    except Exception:  # noqa: BLE001
        pass
    try:
        from max.driver import accelerator_count

        if accelerator_count() > 0:
            found.append(f"MAX: {accelerator_count()} accelerator(s)")
    except Exception:  # noqa: BLE001
        pass
    return "; ".join(found) or None


def _opt(argv: list[str], name: str, default=None):
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def _without(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out


def gpu_defaults(argv: list[str]) -> list[str]:
    quick = "--quick" in argv
    extra = []
    if _opt(argv, "--batches") is None:
        extra += ["--batches", "1,64,1024,16384" if quick else "1,16,64,256,1024,4096,16384,65536"]
    if _opt(argv, "--budget-s") is None:
        extra += ["--budget-s", "120" if quick else "300"]
    if _opt(argv, "--max-minutes") is None and quick:
        extra += ["--max-minutes", "5"]
    sizes = [PAPER_SIZE[i:i + 2] for i in range(0, len(PAPER_SIZE), 2)]
    for name, value in sizes:
        if _opt(argv, name) is None:
            extra += [name, value]
    return extra + argv


def child(argv: list[str]) -> int:
    """One engine, in this process (called by the parent with --child ENGINE)."""
    from bench import throughput

    return throughput.main(argv, gpu=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    gpu = find_gpu()
    if gpu is None:
        print("bench-h100: no GPU found (torch.cuda.is_available() is False and MAX sees no accelerator). "
              "This benchmark needs an NVIDIA GPU such as an H100; on a CPU run bench/throughput.py.",
              file=sys.stderr)
        return NO_GPU_EXIT
    if "--child" in argv:
        return child([x for x in argv if x != "--child"])
    from bench import throughput

    argv = gpu_defaults(argv)
    a = throughput.parse_args(argv, gpu=True)  # validates every option before any run
    engines = a.engines
    print(f"# bench-h100 on {gpu}: engines {', '.join(engines)}, each in its own process", flush=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="srm-bench-h100-"))
    base = _without(argv, ("--engines", "--out"))
    children = {}
    for e in engines:
        out = tmp / e
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *base, "--engines", e,
               "--out", str(out), "--no-plot"]
        print(f"# --- {e}: {' '.join(cmd[2:])}", flush=True)
        rc = subprocess.run(cmd).returncode
        path = out.with_suffix(".json")
        children[e] = json.loads(path.read_text()) if path.exists() else {"error": f"exit code {rc}"}
    result = merge(a, children, time.perf_counter() - t0)
    throughput.report(result, a.out, gpu=True, plot=not a.no_plot)
    return 0


def merge(a, children: dict, elapsed: float) -> dict:
    """One result in the layout of throughput.py from the per-engine results."""
    from bench import throughput

    ok = {e: c for e, c in children.items() if "runs" in c}
    first = next(iter(ok.values()), None)
    rows, engines_desc = [], {}
    for e, c in children.items():
        if "runs" in c:
            rows += c["runs"]
            engines_desc |= c.get("engines", {})
        else:
            rows.append({"engine": e, "threads": "all", "batch": 0, "prompt_len": 0,
                         "new_tokens": a.new_tokens, "status": "error", "reason": c["error"]})
    roof = (first or {}).get("roofline", {})
    roofline_tps = roof.get("roofline_tokens_per_s")
    if roofline_tps:
        bd = throughput.best_decode(rows)
        mx = [r for (e, _, _), r in bd.items() if e == "srm-max"]
        roof = {k: v for k, v in roof.items() if k in ("matmul", "srm_matmul_params_per_token",
                                                      "flops_per_token", "roofline_tokens_per_s")}
        if mx:
            best = max(mx, key=lambda r: r["decode_tokens_per_s"])
            roof |= {"best_srm_max_decode_tokens_per_s": best["decode_tokens_per_s"],
                     "at": {"batch": best["batch"], "prompt_len": best["prompt_len"]},
                     "percent_of_roofline": 100 * best["decode_tokens_per_s"] / roofline_tps}
    engines = [e for e in a.engines if e in engines_desc]
    machine = (first or {}).get("machine") or common.machine_info()
    return {
        "benchmark": "throughput", "mode": ("quick" if a.quick else "full"), "device": "gpu", "dtype": a.dtype,
        "command": common.command_line(), "elapsed_s": elapsed, "machine": machine,
        "srm_config": (first or {}).get("srm_config") or common.srm_config(
            a.d_model, a.layers, a.heads, a.context, a.vocab).to_dict(),
        "engines": engines_desc,
        "grid": {"batches": a.batches, "prompts": a.prompts, "new_tokens": a.new_tokens, "torch_threads": None,
                 "budget_s": a.budget_s, "max_minutes": a.max_minutes},
        "notes": ((first or {}).get("notes") or []) + ["each engine ran in its own process"],
        "roofline": roof,
        "ratios_tokens_per_s": throughput.ratios(rows),
        "ratios_decode_tokens_per_s": throughput.ratios(rows, "decode_tokens_per_s"),
        "srm_max_vs_torch_token_agreement": [], "runs": rows,
        "markdown": throughput.tables(rows, engines, roofline_tps),
    }


if __name__ == "__main__":
    sys.exit(main())
