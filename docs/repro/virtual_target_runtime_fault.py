"""Reproducer, MAX and numpy only: graphs compiled for a virtual CPU target fault at random calls.

    python docs/repro/virtual_target_runtime_fault.py --target x86-64-v3 --runs 20
    python docs/repro/virtual_target_runtime_fault.py --runs 20            # the host's own target

A tiny language model written with plain MAX ops and one Mojo op, no srm-max code. Each
block has parallel branches (causal attention, a SiLU MLP). Two graphs:

- prefill: ids ``[B, T]`` -> (logits of the last token, the next token, the state
  ``[L, B, X]``: every layer's keys and values over the context, zeros after the prompt);
- decode: one token against the state, read from a buffer; with ``--state buffer`` (the
  default) the step writes its key and value rows into that buffer in place by the Mojo
  op ``repro_write_rows`` (``write_rows/``), with ``--state tensors`` the keys and values
  are graph inputs and outputs and the host writes the new rows.

The next token comes from a sampler with a host-side mode, as two ``ops.cond`` one after
the other (``--no-cond``: argmax alone). As in srm-max's PHA graphs, the matrices are
stored transposed, q, k and v are each added to their product by a constant swap matrix
(RoPE's rotation written as a matmul; ``--no-const-matmul``: without) and the norms are
MAX's ``rms_norm`` and ``layer_norm`` ops (``--norms ops``: written out).

The parent compiles both graphs (under ``max.driver.set_virtual_cpu_target(target)``
when ``--target`` is given) and exports them as ``.mef`` files; each of ``--runs`` child processes sets the same target, loads
the files into one ``InferenceSession`` and runs ``--calls`` rounds (a prefill of a
random 1-19 token prompt, then ``--steps`` decode calls on a copy of its state), checking
the first round's logits and state against numpy. The parent prints, per run, whether
the child finished or which signal ended it and after how many rounds. ``--load lazy``
(the default) loads the decode graph into the session after the first prefill has run,
the pattern that makes srm-max's PHA graphs fault; ``--load eager`` loads both first.

Not yet a reproducer: on an AVX-512 Xeon under ``x86-64-v3`` these graphs have run 30 of
30 children in every mode tried, where srm-max's PHA graphs fault in about one child in
six, and need, in the graph loaded second, the product by the constant matrix
(docs/avx2_crash.md has the tables). It is kept as the standalone base to grow toward
srm-max's graphs until it faults.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

V, E, HEADS, DH, FF = 40, 16, 2, 8, 32  # vocabulary, width, heads, head width, MLP width
HERE = Path(__file__).resolve().parent


def weights(layers: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = {"embed": rng.standard_normal((V, E)), "out": rng.standard_normal((E, V)) * 0.3}
    for l in range(layers):
        for name, shape in (("q", (E, HEADS * DH)), ("k", (E, HEADS * DH)), ("v", (E, HEADS * DH)),
                            ("o", (HEADS * DH, E)), ("up", (E, FF)), ("down", (FF, E))):
            w[f"{l}.{name}"] = rng.standard_normal(shape) * 0.3
    return {k: v.astype(np.float32) for k, v in w.items()}


def stored(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights as the graphs take them: every matrix but the embedding transposed."""
    return {k: v if k == "embed" else np.ascontiguousarray(v.T) for k, v in w.items()}


def swap_matrix() -> np.ndarray:
    """[HEADS DH, HEADS DH]: x @ it swaps the halves of each head and negates one (the
    matrix RoPE's rotation is written with)."""
    half = DH // 2
    m = np.zeros((HEADS * DH, HEADS * DH), np.float32)
    for h in range(HEADS):
        for i in range(half):
            m[h * DH + half + i, h * DH + i], m[h * DH + i, h * DH + half + i] = -1.0, 1.0
    return m


def build_graphs(args, branches: tuple[str, ...]):
    from max.dtype import DType
    from max.graph import BufferType, DeviceRef, Graph, TensorType, Weight, ops

    cpu = DeviceRef.CPU()
    F32, I64 = DType.float32, DType.int64
    L, n = args.layers, args.context
    X = 2 * HEADS * n * DH  # per layer: keys [HEADS, n, DH], then values
    shapes = {k: list(v.shape) for k, v in stored(weights(L)).items()}
    W = {}  # the current graph's weights (a Weight belongs to the graph it is made in)

    def norm(x):
        if args.norms == "max":
            ones = ops.constant(np.ones(E, np.float32), F32, device=cpu)
            zeros = ops.constant(np.zeros(E, np.float32), F32, device=cpu)
            return ops.layer_norm(ops.rms_norm(x, ones, epsilon=1e-5), ones, zeros, epsilon=1e-5)
        c = x - ops.mean(x, axis=-1)
        return c / ops.sqrt(ops.mean(c * c, axis=-1) + 1e-5)

    def softmax(x, mask):  # mask 1 = seen
        x = x + (mask - 1.0) * 1e9
        e = ops.exp(x - ops.max(x, axis=-1))
        return e / ops.sum(e, axis=-1)

    def lin(t, name):
        """t @ the matrix ``name``, stored transposed ([out, in], as PyTorch's Linear)."""
        return ops.matmul(t, ops.transpose(W[name], 0, 1))

    def rotate(t):
        """t + t @ swap_matrix() with --const-matmul (the matrix a graph constant), else t."""
        return t + ops.matmul(t, ops.constant(swap_matrix(), F32, device=cpu)) if args.const_matmul else t

    def mlp(h, l):
        return lin(ops.silu(lin(h, f"{l}.up")), f"{l}.down")

    def pick(logits, mode, u):
        """The next token [B]: 0 greedy, 1 an inverse-CDF draw at uniform u [B], 2 that
        draw among the top 5 (a host-side mode), or argmax alone with --no-cond."""
        greedy = lambda: ops.squeeze(ops.argmax(logits, axis=-1), -1)
        if not args.cond:
            return greedy()
        B = logits.shape[0]
        is_mode = lambda m: ops.equal(mode, ops.constant(m, I64, device=cpu))
        floor = ops.broadcast_to(ops.constant(-3.0e38, F32, device=cpu), [B])
        top5 = lambda: ops.squeeze(ops.top_k(logits, k=5, axis=-1)[0][:, 4:], -1)
        threshold = ops.cond(is_mode(2), [TensorType(F32, [B], cpu)], top5, lambda: floor)[0]

        def draw():
            weight = ops.exp(logits - ops.max(logits, axis=-1))
            weight = weight * ops.cast(logits >= ops.unsqueeze(threshold, -1), F32)
            cdf = ops.cumsum(weight, axis=-1)
            below = ops.sum(ops.cast(cdf <= ops.unsqueeze(u, -1) * cdf[:, V - 1:], I64), axis=-1)
            return ops.squeeze(ops.min(below, ops.constant(V - 1, I64, device=cpu)), -1)

        return ops.cond(is_mode(0), [TensorType(I64, [B], cpu)], greedy, draw)[0]

    def block(x, l, attention):
        """x + each branch of norm(x); attention(h) -> its output."""
        h = norm(x)
        outs = ([attention(h)] if "attn" in branches else []) + ([mlp(h, l)] if "mlp" in branches else [])
        for o in outs:
            x = x + o
        return x

    pick_types = [TensorType(I64, [], cpu), TensorType(F32, ["B"], cpu)]  # mode (host), u

    # prefill: ids [B, T] -> (logits [B, V], next token [B], state [L, B, X])
    with Graph("prefill", input_types=[TensorType(I64, ["B", "T"], cpu)] + pick_types) as prefill:
        W.update({k: Weight(k, F32, s, cpu) for k, s in shapes.items()})
        ids, mode, u = (v.tensor for v in prefill.inputs)
        x = ops.gather(W["embed"], ids, axis=0)  # [B, T, E]
        B, T = x.shape[0], x.shape[1]
        iota = ops.range(0, T, 1, out_dim=T, dtype=I64, device=cpu)
        causal = ops.cast(ops.unsqueeze(iota, 0) <= ops.unsqueeze(iota, 1), F32)  # [T, T]
        iota_n = ops.range(0, n, 1, out_dim=n, dtype=I64, device=cpu)
        last = ops.max(iota, axis=-1)  # [1]: T - 1
        rows = ops.min(iota_n, last)  # cache row i holds token min(i, T - 1), times (i < T)
        keep = ops.reshape(ops.cast(iota_n <= last, F32), [1, 1, n, 1])
        layers = []
        for l in range(L):
            def attention(h, l=l):
                def heads(t):
                    return ops.permute(ops.reshape(t, [B, T, HEADS, DH]), [0, 2, 1, 3])  # [B, H, T, DH]
                q, k, v = (heads(rotate(lin(h, f"{l}.{c}"))) for c in "qkv")
                p = softmax(ops.matmul(q, ops.transpose(k, 2, 3)) * (DH ** -0.5), causal)  # [B, H, T, T]
                a = ops.reshape(ops.permute(ops.matmul(p, v), [0, 2, 1, 3]), [B, T, HEADS * DH])
                layers.append(ops.concat([ops.reshape(ops.gather(t, rows, axis=2) * keep, [B, HEADS * n * DH])
                                          for t in (k, v)], axis=1))  # [B, X]
                return lin(a, f"{l}.o")

            x = block(x, l, attention)
        logits = lin(norm(x[:, -1, :]), "out")
        prefill.output(logits, pick(logits, mode, u), ops.stack(layers, axis=0))

    # decode: the token [B] at position pos [B] against the state of positions < pos
    # -> (next token [B], pos + 1[, per layer the new k, v [B, HEADS * DH] with --state tensors])
    in_place = args.state == "buffer"
    state_type = (BufferType if in_place else TensorType)(F32, [L, "B", X], cpu)
    with Graph("decode", input_types=[TensorType(I64, ["B"], cpu), TensorType(I64, ["B"], cpu)] + pick_types
               + [state_type], custom_extensions=[HERE / "write_rows"] if in_place else []) as decode:
        W.update({k: Weight(k, F32, s, cpu) for k, s in shapes.items()})
        ids, pos, mode, u, state = decode.inputs
        ids, pos, mode, u = ids.tensor, pos.tensor, mode.tensor, u.tensor
        st = ops.buffer_load(state.buffer) if in_place else state.tensor
        x = ops.gather(W["embed"], ids, axis=0)  # [B, E]
        B = x.shape[0]
        iota = ops.range(0, n, 1, out_dim=n, dtype=I64, device=cpu)
        seen = ops.cast(ops.unsqueeze(iota, 0) < ops.unsqueeze(pos, 1), F32)  # [B, n]
        seen = ops.reshape(ops.concat([seen, ops.cast(ops.unsqueeze(pos * 0 + 1, 1), F32)], axis=1),
                           [B, 1, 1, n + 1])  # + the new token
        fresh = []
        for l in range(L):
            def attention(h, l=l):
                q, k, v = (ops.reshape(rotate(lin(h, f"{l}.{c}")), [B, HEADS, 1, DH]) for c in "qkv")
                keys = ops.reshape(st[l][:, : X // 2], [B, HEADS, n, DH])
                values = ops.reshape(st[l][:, X // 2 :], [B, HEADS, n, DH])
                logits = ops.concat([ops.matmul(q, ops.transpose(keys, 2, 3)),  # [B, H, 1, n]
                                     ops.sum(q * k, axis=-1)], axis=-1) * (DH ** -0.5)
                p = softmax(logits, seen)
                a = ops.matmul(p[:, :, :, :n], values) + p[:, :, :, n:] * v  # [B, H, 1, DH]
                fresh.append(ops.concat([ops.reshape(k, [B, HEADS, DH]), ops.reshape(v, [B, HEADS, DH])], axis=1))
                return lin(ops.reshape(a, [B, HEADS * DH]), f"{l}.o")

            x = block(x, l, attention)
        logits = lin(norm(x), "out")
        outputs = [pick(logits, mode, u), pos + 1]
        if fresh and in_place:
            # row r of (l, b): key head r (r < HEADS) or value head r - HEADS, at position pos
            base = np.array([h * n for h in range(2 * HEADS)], np.int64).reshape(1, 2 * HEADS)
            index = ops.unsqueeze(pos, 1) + ops.constant(base, I64, device=cpu)  # [B, 2 HEADS], rows of DH
            # after=logits: a value computed from every read of the state, so the write follows them
            ops.inplace_custom("repro_write_rows", device=cpu, values=[state.buffer, ops.stack(fresh, axis=0), index, logits],
                               out_types=[TensorType(F32, [L, B, 2 * HEADS, DH], cpu)])
        elif fresh:
            outputs.append(ops.stack(fresh, axis=0))  # [L, B, 2 HEADS, DH]
        decode.output(*outputs)
    return prefill, decode


def reference(w, layers, branches, prompt, context, const_matmul):
    """numpy: the prefill's last logits and state [L, X] for one prompt."""
    def norm(x):
        c = x - x.mean(-1, keepdims=True)
        return c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5)

    x = w["embed"][prompt]
    T = len(prompt)
    state = np.zeros((layers, 2, HEADS, context, DH), np.float32)
    rotate = (lambda t: t + t @ swap_matrix()) if const_matmul else (lambda t: t)
    for l in range(layers):
        h = norm(x)
        outs = []
        if "attn" in branches:
            q, k, v = (rotate(h @ w[f"{l}.{c}"]).reshape(T, HEADS, DH).transpose(1, 0, 2) for c in "qkv")
            s = q @ k.transpose(0, 2, 1) * DH ** -0.5 + np.triu(np.full((T, T), -1e9), 1)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            outs.append((p @ v).transpose(1, 0, 2).reshape(T, HEADS * DH) @ w[f"{l}.o"])
            state[l, 0, :, :T], state[l, 1, :, :T] = k, v
        if "mlp" in branches:
            u = h @ w[f"{l}.up"]
            outs.append(u / (1 + np.exp(-u)) @ w[f"{l}.down"])
        for o in outs:
            x = x + o
    return norm(x[-1]) @ w["out"], state.reshape(layers, -1)


def set_target(target: str | None) -> None:
    if target:
        from max import driver

        driver.set_virtual_cpu_target(target)


def compile_to(args, branches: tuple[str, ...]) -> None:
    set_target(args.target)
    from max.driver import CPU
    from max.engine import InferenceSession

    session = InferenceSession(devices=[CPU()])
    for graph in build_graphs(args, branches):
        path = args.mef_dir / f"{graph.name}.mef"
        if not path.exists():
            session.compile(graph).export_mef(str(path))


def child(args, branches: tuple[str, ...]) -> None:
    set_target(args.target)
    from max import engine
    from max.driver import CPU, Buffer
    from max.engine import InferenceSession

    w = weights(args.layers)
    cpu = CPU()
    session = InferenceSession(devices=[cpu])

    def load(name):
        return session.init(engine.read(str(args.mef_dir / f"{name}.mef")), weights_registry=stored(w))

    prefill = load("prefill")
    decode = load("decode") if args.load == "eager" else None
    rng = np.random.default_rng(1)
    n, in_place = args.context, args.state == "buffer"
    for call in range(args.calls):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 20)))
        mode = Buffer.from_numpy(np.array(call % 3, np.int64))
        u = Buffer.from_numpy(rng.random(1).astype(np.float32))
        logits, token, state = prefill.execute(Buffer.from_numpy(prompt.reshape(1, -1)), mode, u)
        if call == 0:
            want_logits, want_state = reference(w, args.layers, branches, prompt, n, args.const_matmul)
            for name, got, want in (("logits", logits.to_numpy()[0], want_logits),
                                    ("state", state.to_numpy()[:, 0], want_state)):
                err = np.abs(got - want).max()
                assert err < 1e-3, f"prefill {name} differ from numpy by {err}"
        if decode is None:  # --load lazy: into the session after the prefill has run
            decode = load("decode")
        T = len(prompt)
        pos = Buffer.from_numpy(np.array([T], np.int64))
        if in_place:  # as an engine keeps the prefill's state: the decode writes a copy
            state = state.copy()
            cpu.synchronize()  # Buffer.copy is asynchronous
        else:
            state = state.to_numpy()
        for s in range(min(args.steps, n - T)):
            if in_place:
                token, pos = decode.execute(token, pos, mode, u, state)
            else:
                token, pos, fresh = decode.execute(token, pos, mode, u, Buffer.from_numpy(state))
                rows = state.reshape(args.layers, 1, 2 * HEADS, n, DH)
                rows[:, :, :, T + s] = fresh.to_numpy()
        cpu.synchronize()  # the in-place writes are not outputs: wait for them
        print(f"round {call + 1} done", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="an LLVM CPU name for set_virtual_cpu_target (default: the host's)")
    ap.add_argument("--branches", default="attn,mlp", help="per block, comma-separated: attn, mlp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--state", choices=["buffer", "tensors"], default="buffer",
                    help="decode: state written in place by the Mojo op, or new rows as outputs")
    ap.add_argument("--no-cond", dest="cond", action="store_false",
                    help="pick the next token by argmax alone, without the sampler's ops.cond")
    ap.add_argument("--load", choices=["lazy", "eager"], default="lazy",
                    help="load the decode graph after the first prefill has run, or both before any call")
    ap.add_argument("--norms", choices=["max", "ops"], default="max",
                    help="norms by MAX's rms_norm + layer_norm ops, or written out in elementwise ops")
    ap.add_argument("--no-const-matmul", dest="const_matmul", action="store_false",
                    help="q, k and v without the product by a constant matrix")
    ap.add_argument("--runs", type=int, default=10, help="child processes")
    ap.add_argument("--calls", type=int, default=30, help="rounds per child: a prefill, then --steps decodes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mef-dir", type=Path, help="where the compiled graphs go (default: a temporary folder)")
    ap.add_argument("--child", choices=["compile", "run"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    branches = tuple(args.branches.split(","))
    if args.child == "compile":
        compile_to(args, branches)
        return
    if args.child == "run":
        child(args, branches)
        return
    # a folder per set of the options that shape the compiled graphs, so a reused
    # --mef-dir never hands one variant's graphs to another
    shaping = ("target", "branches", "layers", "context", "state", "cond", "norms", "const_matmul")
    folder = (args.mef_dir or Path(tempfile.mkdtemp(prefix="max_repro_"))) / "-".join(
        f"{name}={getattr(args, name)}" for name in shaping)
    folder.mkdir(parents=True, exist_ok=True)
    # the children get this command line (argparse keeps the last --mef-dir)
    common = [sys.executable, __file__, *sys.argv[1:], "--mef-dir", str(folder)]
    subprocess.run(common + ["--child", "compile"], check=True)  # the parent process never touches MAX
    target = args.target or "the host CPU"
    ran = 0
    for run in range(args.runs):
        proc = subprocess.run(common + ["--child", "run"], capture_output=True, text=True)
        done = proc.stdout.count("done")
        if proc.returncode == 0:
            ran += 1
            result = "ran"
        elif proc.returncode < 0:
            result = f"signal {-proc.returncode} after {done} rounds"
        else:
            tail = proc.stderr.strip().splitlines()
            result = f"exit {proc.returncode}: {tail[-1] if tail else ''}"
        print(f"run {run + 1}: compiled for {target}: {result}", flush=True)
    print(f"{ran} of {args.runs} runs finished")


if __name__ == "__main__":
    main()
