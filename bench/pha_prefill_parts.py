"""Where a PHA prefill's time goes on a CPU: each Mojo op of the prefill graph alone, at the
shapes of one prompt of n tokens, beside the whole prefill timed in the same run.

The CPU prefill graph (graphs/pha/prefill.py, the Mojo ops on) runs every dense layer through
the packed-weight linear op (mojo/linear_packed.mojo: with the GELU of the GSS's input
projections and the FFNs' first layers, and the GSS gate's product by u, in the op), the
attention's queries and keys through the qk-rope op, the causal attention through the tiled
attention op and the GSS scan across chunks through the scan op; the rest are plain ops
(norms, residuals, reshapes, the placement of the states, the output layer at the last token).
Per model and context this times, each the best of ``--rounds`` calls after a warm-up, one call
of each per round (so that every best comes from the same minutes of the machine):

  - the whole prefill of one random prompt of n tokens (the engine's ``prefill``, as
    bench/pha_long_context.py times it);
  - each op alone, in one graph holding the four ops side by side (tests/support's pieces:
    the others idle), on random data of a block's shapes, less an idle call of that graph
    (the execute's own cost, which the ops inside the prefill graph do not pay); every
    block has the same shapes, so a block's parts count n_layers times, but the dense layers
    the last block applies to the last token alone (``pha_long_context.dense_layers``'
    every_row) and the attention n_layers - 1 times;
  - the placement of every layer's state (``PrefillStates`` by its op, in a graph of its own
    on random inputs of the prefill's shapes, less the same idle call);
  - ``rest_ms``: the whole prefill less the parts' sum: the other plain ops and what the
    graph spends between its ops;
  - each dense layer with an activation (the GELU) once more without it, right after it in
    every round: ``activations`` gives per such layer the median of the rounds' ratios of the
    two calls, less 1 (what the activation in the op's epilogue adds to the layer), which
    the machine's drift moves far less than two bests a few minutes apart.

Each dense layer and the attention also against the FMA peak measured in the same run
(bench/fma_peak.py): 2 T N K FLOPs per dense layer, the attention's causal scores and
weighted values as ``pha_long_context.prefill_flops`` counts them.

    python -m bench.pha_prefill_parts                          # pha and pha-attn at 512
    python -m bench.pha_prefill_parts --models pha pha-gss pha-ffn --contexts 512 2048
Writes bench/results/pha_prefill_parts.json (``--append`` keeps the earlier runs).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, command_line, machine_info, rounds_verdict, write_json
from bench.pha_long_context import attention_flops, configs, dense_layers, engine_of, spread
from srm_max.graphs.ops import ACT_NONE

OUT = RESULTS / "pha_prefill_parts.json"
# the ops' graph: its pieces in this order (a call's inputs are the pieces' one after the other)
OPS = ("dense", "attention", "gss_scan", "qk_rope")
NOT_DENSE = OPS[1:] + ("state_placement",)


def summarize(whole_s: float, parts: list[dict], peak: float) -> dict:
    """The whole prefill's seconds beside ``parts`` (each: name, seconds for one call, the
    calls of it the prefill makes, ``blocks``, and FLOPs per call or None): per part its
    milliseconds in the prefill, share of the whole and, with FLOPs, GFLOP/s and share of
    the FMA ``peak``; the dense layers' and the rest's totals."""
    rows, total = [], 0.0
    for p in parts:
        ms = 1e3 * p["blocks"] * p["seconds"]
        total += ms
        row = {"name": p["name"], "ms": ms, "percent_of_prefill": 100 * ms / (1e3 * whole_s)}
        if p.get("flops") and p["seconds"] > 0:
            row |= {"gflop_per_s": p["flops"] / p["seconds"] / 1e9,
                    "percent_of_fma_peak": 100 * p["flops"] / p["seconds"] / peak}
        rows.append(row)
    dense = [p for p in parts if p["name"] not in NOT_DENSE]
    dense_s = sum(p["blocks"] * p["seconds"] for p in dense)
    dense_flops = sum(p["blocks"] * p["flops"] for p in dense)
    whole_ms = 1e3 * whole_s
    return {"prefill_ms": whole_ms, "parts": rows, "parts_ms": total, "rest_ms": whole_ms - total,
            "rest_percent_of_prefill": 100 * (whole_ms - total) / whole_ms,
            "dense_ms": 1e3 * dense_s, "dense_percent_of_prefill": 100e3 * dense_s / whole_ms,
            "dense_percent_of_fma_peak": 100 * dense_flops / dense_s / peak if dense_s else None}


def activation_costs(seconds: dict[str, list[float]], activated: dict[str, str]) -> list[dict]:
    """Per dense layer with an activation (``activated``: its name -> the name of its call
    without it): the median over the rounds of (with / without) - 1, in percent, and how
    many rounds the activation cost time in (the two calls ran one after the other)."""
    out = []
    for name, plain in activated.items():
        verdict = rounds_verdict(a / b for a, b in zip(seconds[name], seconds[plain]))
        out.append({"name": name, "percent_of_layer": 100 * (verdict["median"] - 1),
                    "rounds_slower": verdict["above_1"], "rounds": verdict["rounds"]})
    return out


def ops_graph():
    """The four ops side by side in one graph (``OPS``' order), compiled and loaded (one
    compile serves every shape: their dimensions are symbolic), and each op's idle inputs."""
    from max.driver import CPU
    from max.engine import InferenceSession
    from max.graph import DeviceRef

    from tests.support.op_graph_builders import LINEAR_PACKED, PHA_ATTENTION, PHA_GSS_SCAN, PHA_QK_ROPE, together

    pieces = dict(zip(OPS, (LINEAR_PACKED, PHA_ATTENTION, PHA_GSS_SCAN, PHA_QK_ROPE)))
    model = InferenceSession(devices=[CPU()]).load(together("pha_prefill_parts", list(pieces.values()),
                                                            DeviceRef.CPU()))
    return model, {op: piece.idle_inputs() for op, piece in pieces.items()}


def in_rounds(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each of ``calls`` (name -> a callable) ``rounds`` times, one call of each
    per round after a warm-up call of each: every call's best comes from the same minutes of
    the machine, whose speed drifts by tens of percent over a few minutes on a shared VM."""
    for call in calls.values():
        call()
    seconds = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - t0)
    return seconds


def executes(model, inputs: list):
    """A call of ``model`` on ``inputs`` (buffers, or arrays copied into buffers once)."""
    from max.driver import Buffer

    buffers = [a if isinstance(a, Buffer) else Buffer.from_numpy(np.ascontiguousarray(a)) for a in inputs]
    return lambda: model.execute(*buffers)


def op_inputs(config, n: int, rng) -> dict[str, list]:
    """Random inputs of one block's ops for a prompt of n tokens: per dense layer, then the
    attention, the GSS scan and the qk-rope op."""
    from srm_max.graphs.pha.gss import CHUNK, gss_table_shapes
    from srm_max.models.srm.packing import pack_matrix

    c, T = config, n
    r = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    dense = {}
    for d in dense_layers(c):
        scale = r(T, d["N"]) if d["times_u"] else np.zeros((0, 0), np.float32)
        dense[d["name"]] = [r(T, d["K"]), pack_matrix(r(d["N"], d["K"])).ravel(), np.array([0, d["act"]], np.int64),
                            r(d["N"]), scale]
    Hq, Hkv, dh = c.n_q_heads, c.n_kv_heads, c.head_dim
    lengths = np.array([T], np.int64)
    out = {"dense": dense,
           "attention": [r(1, T, Hq, dh), r(1, T, Hkv, dh), r(1, T, Hkv, dh), lengths,
                         np.arange(T, dtype=np.int64).reshape(1, T)],
           "qk_rope": [r(1, T, Hq * dh), r(1, T, Hkv * dh), np.arange(T, dtype=np.int64), r(dh // 2), r(Hq * dh)]}
    if "gss" in c.branches:
        shapes = gss_table_shapes(c)
        H = c.gss_hidden_dim
        out["gss_scan"] = [r(1, math.ceil(T / CHUNK), CHUNK, H), r(*shapes["taps"]), r(*shapes["long_taps"]), r(H),
                           r(*shapes["p_end"]), r(*shapes["p_out_t"]), r(*shapes["p_step"]), r(*shapes["ct_rows"]),
                           lengths]
    return out


def state_placement(config, n: int):
    """A call of the prefill's placement of every layer's state (``PrefillStates`` by the op,
    as the CPU prefill graph places them: the GSS state and the keys and values at the n
    prompt positions into the state's layout, rows past them zero; then the layers stacked),
    on random inputs; None for a model with neither branch (its state is a zero)."""
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType

    from srm_max.graphs.pha.model import PrefillStates
    from srm_max.runtime.kernels import kernel_library

    c, dev, F32 = config, DeviceRef.CPU(), DType.float32
    if "attn" not in c.branches and "gss" not in c.branches:
        return None
    gss = [2 * c.gss_hidden_dim * c.dss_state_size] if "gss" in c.branches else []
    kv = c.n_kv_heads * c.head_dim
    per_layer = [TensorType(F32, [1, w], dev) for w in gss] \
        + ([TensorType(F32, [1, n, kv], dev)] * 2 if "attn" in c.branches else [])
    with Graph("pha_prefill_state_placement", input_types=[TensorType(DType.int64, [n], dev)]
               + per_layer * c.n_layers, custom_extensions=[kernel_library()]) as g:
        values = [v.tensor for v in g.inputs]
        states = PrefillStates(c, values[0], 1, dev, by_op=True)
        found = []
        for l in range(c.n_layers):
            mine = values[1 + l * len(per_layer): 1 + (l + 1) * len(per_layer)]
            found.append(({"attn": (mine[-2], mine[-1])} if "attn" in c.branches else {})
                         | ({"gss": mine[0]} if gss else {}))
        g.output(states.stacked(found))
    model = InferenceSession(devices=[CPU()]).load(g)
    rng = np.random.default_rng(1)
    inputs = [np.arange(n, dtype=np.int64)] + [rng.standard_normal([int(d) for d in t.shape]).astype(np.float32)
                                               for t in per_layer * c.n_layers]
    return executes(model, inputs)


def measure(name: str, n: int, rounds: int, peak: float, graph) -> dict:
    model, idle = graph
    config = configs(name, n, False)
    engine = engine_of(name, config)
    prompt = [np.random.default_rng(n).integers(0, config.vocab_size, n).tolist()]
    inputs = op_inputs(config, n, np.random.default_rng(0))

    def alone(op: str, args: list):
        """A call of ``op`` of the graph on ``args``, the others idle."""
        return executes(model, [a for other in OPS for a in (args if other == op else idle[other])])

    calls = {"prefill": lambda: engine.prefill(prompt), "idle": executes(model, [a for op in OPS for a in idle[op]])}
    flops, activated = {}, {}
    # the ops over every row of each block; the last block applies the attention and the
    # layers its state does not need to the last token alone, calls of a few rows left to
    # ``rest_ms``
    blocks = {"attention": config.n_layers - 1, "qk_rope": config.n_layers, "gss_scan": config.n_layers,
              "state_placement": 1}
    for d in dense_layers(config):
        args = inputs["dense"][d["name"]]
        calls[d["name"]], flops[d["name"]] = alone("dense", args), 2.0 * n * d["N"] * d["K"]
        blocks[d["name"]] = config.n_layers - (not d["every_row"])
        if d["act"]:  # the same product without its activation, timed right after it
            activated[d["name"]] = f"{d['name']} without activation"
            offset = args[2][0]
            calls[activated[d["name"]]] = alone("dense", [*args[:2], np.array([offset, ACT_NONE], np.int64), *args[3:]])
    if "attn" in config.branches:
        calls["attention"], flops["attention"] = alone("attention", inputs["attention"]), attention_flops(config, n)
        calls["qk_rope"] = alone("qk_rope", inputs["qk_rope"])
    if "gss" in config.branches:
        calls["gss_scan"] = alone("gss_scan", inputs["gss_scan"])
    placement = state_placement(config, n)
    if placement is not None:
        calls["state_placement"] = placement
    seconds = in_rounds(calls, rounds)
    best = {name: min(times) for name, times in seconds.items()}
    # each op's call less an idle call's: the execute's own cost, which the prefill's ops do not pay
    not_parts = {"prefill", "idle", *activated.values()}
    parts = [{"name": name, "seconds": max(0.0, best[name] - best["idle"]), "flops": flops.get(name),
              "blocks": blocks[name]} for name in calls if name not in not_parts]
    runs = seconds["prefill"]
    row = {"model": name, "context": n, "prefill_seconds_runs": runs, "prefill_spread": spread(runs),
           "idle_call_ms": 1e3 * best["idle"], **summarize(min(runs), parts, peak),
           "activations": activation_costs(seconds, activated)}
    print(f"{name:9s} n={n:5d}: prefill {row['prefill_ms']:6.1f} ms = dense {row['dense_ms']:5.1f} "
          f"({row['dense_percent_of_fma_peak']:.0f} % of the FMA peak) + other ops "
          f"{row['parts_ms'] - row['dense_ms']:5.1f} + rest {row['rest_ms']:5.1f} "
          f"({row['rest_percent_of_prefill']:.0f} %)", flush=True)
    if row["activations"]:
        print(" " * 18 + "the activations add " + ", ".join(f"{a['percent_of_layer']:.0f} % to {a['name']}"
                                                          for a in row["activations"]), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["pha", "pha-attn"],
                    choices=["pha", "pha-attn", "pha-gss", "pha-ffn"])
    ap.add_argument("--contexts", type=int, nargs="*", default=[512])
    ap.add_argument("--rounds", type=int, default=20, help="calls of the prefill and of each op, interleaved")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--append", action="store_true", help="add this run to the JSON's earlier ones")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)

    from bench.fma_peak import fma_peak

    peak = fma_peak()
    graph = ops_graph()
    run = {"command": command_line(), "machine": machine_info(), "note": args.note, "rounds": args.rounds,
           "fma_peak": peak, "rows": [measure(name, n, args.rounds, peak["flops"], graph)
                                      for n in args.contexts for name in args.models]}
    runs = json.loads(args.out.read_text())["runs"] if args.append and args.out.is_file() else []
    print(f"wrote {write_json(args.out, {'runs': runs + [run]})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
