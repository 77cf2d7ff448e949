"""Rebuild the compiled graphs shipped for the embedded model, and their known answer.

    .venv/bin/python scripts/build_shipped_graphs.py [--targets x86-64-v3 ...] [--workers N]

Writes ``python/srm_max/model/compiled/``:

* ``known_answer.npz``: what the float64 PyTorch reference computes for the
  embedded model on a fixed prompt (prefill logits and states, then greedy
  decode tokens and states), which a shipped graph must reproduce before it is
  used (``srm_max.shipped_graphs``);
* ``max-<MAX version>/<target>/<graph>-<key>.mef`` for each target: the
  prefill, sample, regroup and decode_steps graphs (float32, CPU, Mojo ops), each
  compiled in a fresh cache by a ``srm_max.runtime.precompile`` child compiling
  for ``<target>`` (a job's ``cpu_target``). Graphs shipped for other MAX versions are
  removed.

Run it after any change to graphs/, mojo/, the graph-building code or MAX:
tests/runtime/test_shipped_graphs.py fails until the shipped files match again. Each
target takes minutes per graph on a small CPU. The files are then checked
against the known answer where this CPU can run them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# a passage longer than one prefill chunk (graphs/srm/prefill.py CHUNK = 32 tokens), so the
# check crosses a chunk boundary
PROMPT = ("To be, or not to be, that is the question:\n"
          "Whether 'tis nobler in the mind to suffer\n"
          "The slings and arrows of outrageous fortune,\n")
DECODE_STEPS = 8
# a greedy choice whose lead over the runner-up is below this (relative to the logit
# scale) could flip between float32 and float64: such a known answer would be fragile
MIN_MARGIN = 1e-3


def known_answer() -> dict[str, np.ndarray]:
    """The float64 reference's outputs for the embedded model on ``PROMPT``."""
    import torch

    from srm_max.checkpoints.format import load_checkpoint
    from srm_max.embedded import EMBEDDED_MODEL_DIR
    from srm_max.graphs.srm.prefill import CHUNK
    from srm_max.checkpoints.parity import reference_model
    from tokenizers import Tokenizer

    ckpt = load_checkpoint(EMBEDDED_MODEL_DIR)
    prompt = Tokenizer.from_file(str(ckpt.tokenizer_path)).encode(PROMPT).ids
    assert len(prompt) > CHUNK, f"the prompt has {len(prompt)} tokens; it should span two prefill chunks"
    model = reference_model(ckpt.config, ckpt.weights)

    def greedy(logits: torch.Tensor) -> int:
        top = torch.topk(logits, 2).values
        scale = max(1.0, float(logits.abs().max()))
        margin = float(top[0] - top[1]) / scale
        if margin < MIN_MARGIN:
            raise SystemExit(f"a greedy choice leads by {margin:.2g} only: pick another PROMPT")
        return int(logits.argmax())

    with torch.no_grad():
        logits, states = model.prefill(torch.tensor([prompt]))
        tokens = [greedy(logits[0, -1])]
        decode_states = states
        for i in range(DECODE_STEPS):
            step_logits, decode_states = model.step(torch.tensor([tokens[-1]]), torch.tensor([len(prompt) + i]),
                                                    decode_states)
            tokens.append(greedy(step_logits[0]))
    weights = (EMBEDDED_MODEL_DIR / "model.safetensors").read_bytes()
    return {
        "prompt_ids": np.array(prompt, np.int64),
        "logits": logits[0, -1].numpy().astype(np.float32),
        "states": states.numpy().astype(np.float32),
        "tokens": np.array(tokens, np.int64),
        "decode_states": decode_states.numpy().astype(np.float32),
        "weights_sha256": np.array(hashlib.sha256(weights).hexdigest()),
    }


def build_target(target: str, workers: int) -> list[Path]:
    """Compile the shipped graphs for ``target`` in a fresh cache; -> the shipped files."""
    from srm_max import shipped_graphs
    from srm_max.runtime.precompile import compile_in_workers

    # each job's child compiles for its own target (GraphJob.cpu_target)
    jobs = [dataclasses.replace(job, cpu_target=target) for job in shipped_graphs.embedded_jobs()]
    saved = os.environ.get("SRM_MAX_CACHE")
    with tempfile.TemporaryDirectory(prefix="srm-shipped-") as cache:
        os.environ["SRM_MAX_CACHE"] = cache  # the children inherit it: a cold compile
        try:
            compile_in_workers([(job,) for job in jobs], workers)  # one file per graph
            out = shipped_graphs.version_dir() / target
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            files = []
            for job in jobs:
                shipped = shipped_graphs.shipped_file(job, target)
                shutil.copyfile(job.mef_path(), shipped)  # keyed for the same target: the same name
                files.append(shipped)
        finally:
            if saved is None:
                os.environ.pop("SRM_MAX_CACHE", None)
            else:
                os.environ["SRM_MAX_CACHE"] = saved
    return files


def main(argv: list[str] | None = None) -> int:
    from srm_max.runtime import cpu_target
    from srm_max import shipped_graphs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(shipped_graphs.DEFAULT_TARGETS),
                        choices=cpu_target.X86_LEVELS[1:], help="CPU targets to compile for")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="compiles at once (default: one per core)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    shipped_graphs.SHIPPED_DIR.mkdir(parents=True, exist_ok=True)
    np.savez(shipped_graphs.KNOWN_ANSWER, **known_answer())
    print(f"wrote {shipped_graphs.KNOWN_ANSWER}")
    for stale in shipped_graphs.SHIPPED_DIR.glob("max-*"):
        if stale != shipped_graphs.version_dir():
            shutil.rmtree(stale)
            print(f"removed {stale} (another MAX version)")

    host = cpu_target.host_x86_level()
    failed = False
    for target in args.targets:
        t = time.perf_counter()
        files = build_target(target, args.workers)
        print(f"{target}: compiled in {time.perf_counter() - t:.0f} s")
        for f in files:
            print(f"  {f.relative_to(shipped_graphs.SHIPPED_DIR)}  {f.stat().st_size / 2**20:.1f} MiB")
        if cpu_target.runs_on(target, host):
            problem = shipped_graphs.check(dict(zip(shipped_graphs.embedded_jobs(), files)))
            print(f"  known answer: {problem or 'ok'}")
            failed |= problem is not None
        else:
            print(f"  known answer: not checked, this CPU ({host}) cannot run {target} code")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
