"""The decode op's per-row draw (mojo/row_sampler.mojo) alone: microseconds per row.

    python -m bench.row_sampler [--rows 64] [--repeats 7]

Runs the test op ``srm_sample_rows`` (mojo/sample_rows.mojo: one thread, row after row,
each row copied before it is drawn from, as the decode op's draw phase does per worker)
on two kinds of rows of 4,096 logits:

    model    the benchmark SRM's logits (bench/common.py: d 256, 8 layers, random weights)
             after random prompts of 100 tokens: peaked, as a language model's are
    flat     standard normal logits: the nucleus of top-p 0.9 holds most of the row

at each parameter set of ``CASES`` (temperature 1 unless greedy). The greedy row is the
first argmax: the floor the draw adds to. Every row is drawn ``--repeats`` times; the best
call counts. Writes bench/results/row_sampler.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, build_srm_reference, command_line, machine_info, markdown_table, srm_config, write_json
from srm_max.graphs.op_names import OP_SAMPLE_ROWS

PROMPT_TOKENS = 100
# name -> (temperature, top_k, top_p, graphs/sampler.py's mode)
CASES = {
    "greedy": (0.0, 0, 1.0, 0),
    "plain": (1.0, 0, 1.0, 1),
    "top-k 50": (1.0, 50, 1.0, 2),
    "top-k 50 + top-p 0.9": (1.0, 50, 0.9, 2),
    "top-k 200": (1.0, 200, 1.0, 2),
    "top-k 1000 + top-p 0.95": (1.0, 1000, 0.95, 2),
    "top-p 0.9": (1.0, 0, 0.9, 2),
    "top-p 0.99": (1.0, 0, 0.99, 2),
    "top-p 0.9999": (1.0, 0, 0.9999, 2),
}


def model_logits(rows: int) -> np.ndarray:
    import torch

    config = srm_config()
    model = build_srm_reference(config).eval()
    ids = torch.randint(0, config.vocab_size, (rows, PROMPT_TOKENS + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    out = out[0] if isinstance(out, tuple) else out
    return out[:, -1].float().numpy()


def sample_rows_model(V: int):
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, ops

    from srm_max.runtime.kernels import kernel_library

    dev = DeviceRef.CPU()
    types = [TensorType(DType.float32, ["b", V], dev), TensorType(DType.float32, ["b"], dev),
             TensorType(DType.int64, ["b"], dev), TensorType(DType.float32, ["b"], dev),
             TensorType(DType.uint64, ["b"], dev), TensorType(DType.int64, ["b"], dev),
             TensorType(DType.int64, [1], dev)]
    with Graph("row_sampler_bench", input_types=types, custom_extensions=[kernel_library()]) as g:
        values = [v.tensor for v in g.inputs]
        (op,) = ops.custom(OP_SAMPLE_ROWS, device=dev, values=values,
                           out_types=[TensorType(DType.int64, [values[0].shape[0]], dev)])
        g.output(op.tensor)
    return InferenceSession(devices=[CPU()]).load(g)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256, help="rows of each kind")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS / "row_sampler.json")
    args = ap.parse_args(argv)
    from max.driver import Buffer

    from srm_max.runtime.cpu_target import current

    kinds = {"model": model_logits(args.rows),
             "flat": np.random.default_rng(0).normal(0, 1, (args.rows, srm_config().vocab_size))}
    V = kinds["model"].shape[1]
    model = sample_rows_model(V)
    results, table = [], []
    for kind, logits in kinds.items():
        n = len(logits)
        for name, (t, k, p, mode) in CASES.items():
            inputs = [logits.astype(np.float32), np.full(n, t, np.float32), np.full(n, k, np.int64),
                      np.full(n, p, np.float32), np.arange(n, dtype=np.uint64), np.full(n, PROMPT_TOKENS + 1, np.int64),
                      np.array([mode], np.int64)]
            buffers = [Buffer.from_numpy(x) for x in inputs]
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                model.execute(*buffers)
                best = min(best, time.perf_counter() - t0)
            us = best / n * 1e6
            results.append({"rows": kind, "case": name, "us_per_row": round(us, 2)})
            table.append([kind, name, f"{us:.1f}"])
    print(markdown_table(["rows", "case", "us per row"], table))
    out = write_json(args.out, {
        "command": command_line(), "machine": machine_info(), "cpu_target": current(), "vocab_size": V,
        "rows_per_kind": args.rows, "repeats": args.repeats,
        "cases": {k: {"temperature": v[0], "top_k": v[1], "top_p": v[2]} for k, v in CASES.items()},
        "results": results,
    })
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
