"""What one cold MAX graph compile costs on this CPU, and what it grows with: the
measurements behind the test suite's compile budget (docs/testing.md).

    python -m bench.compile_cost [--models] [--out bench/results/compile_cost.json]
    python -m bench.compile_cost --units [--out bench/results/compile_units.json]
    python -m bench.compile_cost --constant-subgraphs [--out bench/results/constant_subgraphs.json]
    python -m bench.compile_cost --families [--out bench/results/compile_families.json]

Each graph compiles in a child process with a fresh, empty ``HOME`` (so MAX's own caches
under ``~/.cache/modular`` start empty, as on a clean CI machine) and its CPU seconds are
read from the child's resource usage, which other jobs on the cores do not inflate the way
they inflate wall-clock time. The graphs:

- ``add``: one elementwise op, the cost of any graph;
- ``matmul``: one 2-D matmul; ``matmul_twice``: two of the same signature;
- ``matmul_2d_and_3d``: a 2-D and a batched 3-D matmul (two signatures);
- ``add_again_warm``: ``add`` once more in the first child's ``HOME``, to show which part
  MAX's caches keep between processes (a graph identical to one compiled before);
- with ``--models``: the test PHA's plain-op prefill graph (tests/support/pha.py's shape,
  every branch on) with 2 blocks and with 1, to show whether the compile grows with depth;
  and the suite's SRM config's (tests/support/tiny.py) plain-op prefill and decode graphs,
  the decode once in the prefill's ``HOME`` (``srm_plain_decode_after_prefill``) and once in
  an empty one, to show how much two graphs of one model share;
- with ``--units`` (alone): the graphs of two test engines compiled one child each way, as
  the compile workers do (``srm_max.runtime.precompile``): each graph in a compile of its own
  (``units_apart``), and in the compile units that ``compile_units`` makes of them
  (``units_together``: the graphs binding the engine's weights as one, those binding none
  as another). The engines: the
  suite's SRM config with the Mojo ops (prefill, decode_steps, sample, regroup) and the test
  PHA with plain ops (prefill, decode).

With ``--families`` (alone): one small graph per kind of op the engines' graphs use (an
elementwise op; a 2-D matmul, a batched one, both, four of other shapes; the norms,
gathers, top-k, concatenation, cumulative sum, argmax), each in a child with an empty
``HOME``, and two single-matmul graphs of other shapes compiled one after the other in one
child (``family_two_matmul_graphs_in_one_process``): what each kind of op adds to a
compile beside the fixed cost every compile pays, and whether a process pays it once.

With ``--constant-subgraphs`` (alone): first ``floor_div_signed`` and
``floor_div_nonnegative`` (an int64 vector divided by a constant with ``ops.floor_div`` and
with ``graphs.ops.floor_div_nonnegative``, plus the vector), then each graph of the test
engines (``SUITE_GRAPHS``), compiled in a child up to its emitted Mojo (MAX's ``pre_jit``), counting the constant
subgraphs MAX wrote beside it: before its kernels, MAX compiles and runs each op whose
operands are all constants (a constant's sign test inside ``ops.floor_div``, 1 - a constant
mask, a product of constants that its canonicalizer made) as a compiled subgraph of its
own, seconds of every compile of that graph. Each row gives the count (0 is the goal) and
the seconds to the emitted Mojo.

MAX compiles a graph's kernels (after fusing its ops) one by one and keeps each in a
kernel cache under ``~/.cache/modular``; with ``MODULAR_ENABLE_CACHE_LOGGING=1`` it logs,
per batch of kernels, how many there were and how many that cache already held. Each row
gives those counts (``kernels``, ``kernel_cache_hits``), so the cost per kernel can be read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import machine_info

OUT = Path(__file__).with_name("results") / "compile_cost.json"
UNITS_OUT = OUT.with_name("compile_units.json")
GRAPHS = ("add", "matmul", "matmul_twice", "matmul_2d_and_3d")
MODEL_GRAPHS = ("pha_plain_prefill_2", "pha_plain_prefill_1", "srm_plain_prefill", "srm_plain_decode_after_prefill",
                "srm_plain_decode")
# compiled one after the other in one HOME (the rest each in an empty one)
SHARED_HOME = ("srm_plain_prefill", "srm_plain_decode_after_prefill")
UNIT_ENGINES = ("srm_mojo_ops", "pha_plain_ops")
UNIT_GRAPHS = tuple(f"{engine}_{way}" for engine in UNIT_ENGINES for way in ("units_apart", "units_together"))
CONSTANT_SUBGRAPHS_OUT = OUT.with_name("constant_subgraphs.json")
FAMILIES_OUT = OUT.with_name("compile_families.json")
FAMILY_GRAPHS = tuple(f"family_{k}" for k in (
    "elementwise", "matmul", "batch_matmul", "matmul_and_batch_matmul", "four_matmuls", "layer_norm", "rms_norm",
    "gather", "gather_nd", "top_k", "concat", "cumsum", "argmax", "two_matmul_graphs_in_one_process"))
# (architecture, kind, weight dtype, Mojo ops) of the graphs ``--constant-subgraphs`` checks:
# every kind of the test SRM (tests/support/tiny.py) and the test PHA (tests/support/pha.py)
FLOOR_DIV_GRAPHS = ("floor_div_signed", "floor_div_nonnegative")
SUITE_GRAPHS = tuple(
    [("srm", kind, "float32", kernels) for kind in ("prefill", "decode", "sample") for kernels in (False, True)]
    + [("srm", "decode_steps", "float32", True), ("srm", "regroup", "float32", True),
       ("srm", "prefill", "bfloat16", True), ("srm", "decode_steps", "bfloat16", True)]
    + [("pha", kind, "float32", kernels) for kind in ("prefill", "decode") for kernels in (False, True)]
    + [("pha", "decode_steps", "float32", True), ("pha", "prefill", "bfloat16", True),
       ("pha", "decode", "bfloat16", False), ("pha", "decode_steps", "bfloat16", True)])


def engine_jobs(engine: str) -> list:
    """The compile jobs of one test engine's graphs (``--units``)."""
    from srm_max.models import registry
    from tests.support.pha import CONFIG as PHA
    from tests.support.tiny import TINY

    if engine == "srm_mojo_ops":
        return [registry.of(TINY).graph_job(kind, TINY, "float32", "cpu", True)
                for kind in ("prefill", "decode_steps", "sample", "regroup")]
    return [registry.of(PHA).graph_job(kind, PHA, "float32", "cpu", False) for kind in ("prefill", "decode")]


def suite_graph(spec: tuple):
    """The graph of one ``SUITE_GRAPHS`` entry, or ``(name,)`` of one ``FLOOR_DIV_GRAPHS``."""
    if len(spec) == 1:
        return build(spec[0])
    from srm_max.models import registry
    from tests.support.pha import CONFIG as PHA
    from tests.support.tiny import TINY

    arch, kind, dtype, kernels = spec
    config = TINY if arch == "srm" else PHA
    return registry.of(config).graph_job(kind, config, dtype, "cpu", kernels).graph()


def build(name: str):
    """The named graph (see the module docs)."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    cpu, f32 = DeviceRef.CPU(), DType.float32
    if name.startswith("floor_div_"):
        from graphs.ops import floor_div_nonnegative

        with Graph(name, input_types=[TensorType(DType.int64, ["B"], cpu)]) as g:
            x = g.inputs[0].tensor
            q = (ops.floor_div(x, ops.constant(64, DType.int64, device=cpu)) if name == "floor_div_signed"
                 else floor_div_nonnegative(x, 64))
            g.output(q + x)
        return g

    def t(*shape):
        return TensorType(f32, list(shape), cpu)

    if name.startswith("family_"):
        return _family_graph(name.removeprefix("family_"), t)

    if name.startswith("srm_plain_"):
        from srm_max.models import registry
        from tests.support.tiny import TINY

        kind = name.removeprefix("srm_plain_").removesuffix("_after_prefill")
        return registry.of(TINY).graph_job(kind, TINY, "float32", "cpu", False).graph()
    if name.startswith("pha_plain_prefill_"):
        import dataclasses

        from srm_max.models import registry
        from srm_max.models.pha.config import PHAConfig

        config = PHAConfig(vocab_size=40, d_model=16, n_layers=2, context_length=160, n_q_heads=4, n_kv_heads=2,
                           dss_state_size=8)
        config = dataclasses.replace(config, n_layers=int(name.rsplit("_", 1)[1]))
        return registry.of(config).graph_job("prefill", config, "float32", "cpu", False).graph()
    inputs = {"add": [t("B", 16), t("B", 16)], "matmul": [t("B", 16), t(16, 40)],
              "matmul_twice": [t("B", 16), t(16, 40), t(40, 16)],
              "matmul_2d_and_3d": [t("B", 16), t(16, 40), t("B", 4, 16), t(16, 8)]}[name]
    with Graph(name, input_types=inputs) as g:
        x = [v.tensor for v in g.inputs]
        if name == "add":
            g.output(x[0] + x[1])
        elif name == "matmul":
            g.output(ops.matmul(x[0], x[1]))
        elif name == "matmul_twice":
            g.output(ops.matmul(ops.matmul(x[0], x[1]), x[2]))
        else:
            g.output(ops.matmul(x[0], x[1]), ops.matmul(x[2], x[3]))
    return g


def _family_graph(kind: str, t):
    """The ``FAMILY_GRAPHS`` graph of one kind of op (``t(*shape)``: a float32 CPU tensor type)."""
    import numpy as np
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    cpu = DeviceRef.CPU()
    ids = TensorType(DType.int64, ["B"], cpu)
    inputs = {"elementwise": [t("B", 16)], "matmul": [t("B", 16), t(16, 40)],
              "batch_matmul": [t("B", 4, 16), t("B", 16, 8)],
              "matmul_and_batch_matmul": [t("B", 16), t(16, 40), t("B", 4, 16), t("B", 16, 8)],
              "four_matmuls": [t("B", 16), t(16, 40), t(40, 24), t(24, 56), t(56, 16)],
              "layer_norm": [t("B", 16)], "rms_norm": [t("B", 16)], "gather": [t(64, 16), ids],
              "gather_nd": [t("B", 8, 16), TensorType(DType.int64, ["B", 1], cpu)], "top_k": [t("B", 64)],
              "concat": [t("B", 16), t("B", 8)], "cumsum": [t("B", 64)], "argmax": [t("B", 64)],
              "second_matmul": [t("B", 24), t(24, 56)]}[kind]
    ones = np.ones(16, np.float32)
    with Graph(f"family_{kind}", input_types=inputs) as g:
        x = [v.tensor for v in g.inputs]
        if kind == "elementwise":
            out = [ops.exp(x[0]) * 2.0]
        elif kind in ("matmul", "batch_matmul", "second_matmul"):
            out = [ops.matmul(x[0], x[1])]
        elif kind == "matmul_and_batch_matmul":
            out = [ops.matmul(x[0], x[1]), ops.matmul(x[2], x[3])]
        elif kind == "four_matmuls":
            h = x[0]
            for w in x[1:]:
                h = ops.matmul(h, w)
            out = [h]
        elif kind == "layer_norm":
            out = [ops.layer_norm(x[0], ops.constant(ones, DType.float32, device=cpu),
                                  ops.constant(0 * ones, DType.float32, device=cpu), epsilon=1e-5)]
        elif kind == "rms_norm":
            out = [ops.rms_norm(x[0], ops.constant(ones, DType.float32, device=cpu), epsilon=1e-5)]
        elif kind == "gather":
            out = [ops.gather(x[0], x[1], axis=0)]
        elif kind == "gather_nd":
            out = [ops.gather_nd(x[0], x[1], batch_dims=1)]
        elif kind == "top_k":
            out = [ops.top_k(x[0], 5, axis=-1)[0]]
        elif kind == "concat":
            out = [ops.concat([x[0], x[1]], axis=1)]
        elif kind == "cumsum":
            out = [ops.cumsum(x[0], axis=-1)]
        else:
            out = [ops.argmax(x[0], axis=-1)]
        g.output(*out)
    return g


def compile_once(name: str) -> None:
    """In the child: build and compile the graph (MAX's ``InferenceSession.compile``, as
    the engines' compile workers do; weights are bound later, at load), or for a name of
    ``UNIT_GRAPHS`` the engine's graphs one unit after another, as a compile worker does."""
    from max.driver import CPU
    from max.engine import InferenceSession

    if name == "family_two_matmul_graphs_in_one_process":
        session = InferenceSession(devices=[CPU()])
        for kind in ("family_matmul", "family_second_matmul"):
            session.compile(build(kind))
        return
    if name in UNIT_GRAPHS:
        from srm_max.runtime.precompile import _compile, compile_units

        engine, way = name.split("_units_")
        jobs = engine_jobs(engine)
        units = compile_units(jobs) if way == "together" else [(job,) for job in jobs]
        sessions: dict = {}
        for unit in units:
            _compile(unit, sessions)
        return
    InferenceSession(devices=[CPU()]).compile(build(name))


def emit_mojo(graph, ir_dir: str) -> None:
    """In the child: compile ``graph`` up to its emitted Mojo, written to ``ir_dir`` with
    the constant subgraphs MAX compiled on the way (``--constant-subgraphs``)."""
    from max.driver import CPU
    from max.engine import CompilationStopped, InferenceSession

    session = InferenceSession(devices=[CPU()])
    session.debug.ir_output_dir = ir_dir
    session.debug.pre_jit = True
    try:
        session.compile(graph)
    except CompilationStopped:
        pass


def constant_subgraph_files(ir_dir: Path) -> list[str]:
    """The constant subgraphs MAX compiled for a graph: one Mojo file each in its IR dump."""
    return sorted(p.name for p in ir_dir.glob("*_constant_subgraphs*.mojo"))


def measure_constant_subgraphs() -> list[dict]:
    """The ``--constant-subgraphs`` rows, each graph in a child with an empty ``HOME``."""
    import time

    rows = []
    os.environ["SRM_MAX_CACHE"] = cache = tempfile.mkdtemp(prefix="srm-compile-cost-")
    try:
        for spec in [(name,) for name in FLOOR_DIV_GRAPHS] + list(SUITE_GRAPHS):
            with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as ir_dir:
                t = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "bench.compile_cost", "--emit-mojo", json.dumps(spec),
                                       ir_dir], capture_output=True, text=True, env=os.environ | {"HOME": home},
                                      cwd=Path(__file__).parents[1])
                if done.returncode != 0:
                    raise SystemExit(f"compile_cost: emitting {spec} failed:\n{done.stderr[-2000:]}")
                files = constant_subgraph_files(Path(ir_dir))
                rows.append({"graph": " ".join(map(str, spec)), "constant_subgraphs": len(files), "files": files,
                             "seconds_to_mojo": round(time.perf_counter() - t, 1)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)
    return rows


# MAX's kernel cache log: "checkCache summary: 66 kernels, MOGG hit=8 miss=58, ..."
KERNEL_SUMMARY = re.compile(r"checkCache summary: (\d+) kernels, MOGG hit=(\d+) miss=(\d+)")


def kernel_counts(log: str) -> dict:
    """The kernels MAX compiled or found in its kernel cache, summed over the log's batches."""
    found = [tuple(map(int, m)) for m in KERNEL_SUMMARY.findall(log)]
    return {"kernels": sum(f[0] for f in found), "kernel_cache_hits": sum(f[1] for f in found)}


def measure(name: str, home: str) -> dict:
    """Compile ``name`` in a child with ``HOME=home``: its CPU and wall seconds, and its
    kernels (``kernel_counts``)."""
    import time

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    env = os.environ | {"HOME": home, "MODULAR_ENABLE_CACHE_LOGGING": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.compile_cost", "--child", name], capture_output=True,
                          text=True, env=env, cwd=Path(__file__).parents[1])
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"compile_cost: compiling {name} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"graph": name, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            **kernel_counts(done.stdout + done.stderr), "load_average": list(os.getloadavg())}


def measure_units() -> list[dict]:
    """The ``UNIT_GRAPHS`` rows, each in an empty ``HOME``."""
    import shutil

    # the children share one package of the Mojo ops, built here, so that no child's
    # seconds hold its build; each exports its .mef files there too
    os.environ["SRM_MAX_CACHE"] = cache = tempfile.mkdtemp(prefix="srm-compile-cost-")
    from srm_max.runtime.kernels import kernel_library

    kernel_library()
    rows = []
    try:
        for name in UNIT_GRAPHS:
            with tempfile.TemporaryDirectory() as home:
                rows.append(measure(name, home))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return rows


def measure_families() -> list[dict]:
    """The ``FAMILY_GRAPHS`` rows, each in an empty ``HOME``."""
    rows = []
    for name in FAMILY_GRAPHS:
        with tempfile.TemporaryDirectory() as home:
            rows.append(measure(name, home))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_graphs(models: bool) -> list[dict]:
    """The ``GRAPHS`` rows (and ``MODEL_GRAPHS``'), then ``add_again_warm``."""
    rows = []
    with tempfile.TemporaryDirectory() as first_home:
        names = list(GRAPHS) + (list(MODEL_GRAPHS) if models else [])
        with tempfile.TemporaryDirectory() as model_home:
            for i, name in enumerate(names):
                if i == 0:
                    rows.append(measure(name, first_home))
                elif name in SHARED_HOME:  # after the graphs before it in this HOME
                    rows.append(measure(name, model_home))
                else:
                    with tempfile.TemporaryDirectory() as home:
                        rows.append(measure(name, home))
                print(json.dumps(rows[-1]), flush=True)
        again = measure("add", first_home)
        again["graph"] = "add_again_warm"
        rows.append(again)
        print(json.dumps(again), flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", action="store_true",
                        help="also the test PHA's plain prefill at 2 and 1 blocks, and the test SRM's plain prefill "
                             "and decode (the decode after the prefill in one HOME, and alone)")
    parser.add_argument("--units", action="store_true",
                        help="instead: two test engines' graphs compiled each alone and as compile units")
    parser.add_argument("--families", action="store_true",
                        help="instead: one small graph per kind of op, each compiled alone")
    parser.add_argument("--constant-subgraphs", action="store_true",
                        help="instead: count the constant subgraphs MAX compiles for each test engine graph")
    parser.add_argument("--out", type=Path,
                        help=f"default {OUT} ({UNITS_OUT} with --units, {FAMILIES_OUT} with --families, "
                             f"{CONSTANT_SUBGRAPHS_OUT} with --constant-subgraphs)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--emit-mojo", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child or args.emit_mojo:
        if args.child:
            compile_once(args.child)
        else:
            emit_mojo(suite_graph(tuple(json.loads(args.emit_mojo[0]))), args.emit_mojo[1])
        # MAX's worker threads can abort the interpreter's teardown after a finished
        # compile ("terminate called without an active exception"): leave at once
        os._exit(0)
    if args.constant_subgraphs:
        out, rows = args.out or CONSTANT_SUBGRAPHS_OUT, measure_constant_subgraphs()
    elif args.families:
        out, rows = args.out or FAMILIES_OUT, measure_families()
    else:
        out = args.out or (UNITS_OUT if args.units else OUT)
        rows = measure_units() if args.units else measure_graphs(args.models)
    result = {"machine": machine_info(), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
