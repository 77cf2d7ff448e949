"""Standalone reproducer: MAX 26.7 CPU code for AVX2, small one-hot matmuls inside
``ops.while_loop`` (a greedy decode loop of a two-layer recurrent mixer model).

    python docs/repro/avx2_loop_onehot_matmul.py matmul   # crashes (SIGSEGV) on AVX2 code
    python docs/repro/avx2_loop_onehot_matmul.py gather   # the same values: runs

Each loop iteration is one decode step: embed the current ids, per layer a layer
norm, a projection, the mixer update (per-head vectors w[pos], beta[pos] [B, H] and
the decay [1, H] expanded per channel [.., H*hd] by a matmul against a constant
one-hot [H, H*hd], K = H = 2, in "matmul" mode, by a gather in "gather" mode) and an
output projection, then logits and the argmax as the next ids. Tokens and states are
checked against numpy. ``REPRO_CPU_TARGET=x86-64-v3`` compiles for AVX2 on any
x86-64 host (``max.driver.set_virtual_cpu_target``). docs/avx2_crash.md says what
was observed and how it was narrowed.
"""

import os
import sys

import numpy as np
from max.driver import CPU, Buffer, set_virtual_cpu_target
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops

if os.environ.get("REPRO_CPU_TARGET"):
    set_virtual_cpu_target(os.environ["REPRO_CPU_TARGET"])

L, H, HD, N, V, B, STEPS = 2, 2, 8, 96, 64, 3, 4
D = H * HD
F32, I64 = DType.float32, DType.int64
EPS = 1e-5


def weights(rng):
    per_layer = lambda *shape, s=1.0: (rng.standard_normal((L, *shape)) * s).astype(np.float32)  # noqa: E731
    return {"emb": (rng.standard_normal((V, D))).astype(np.float32), "head": (rng.standard_normal((V, D)) / 4).astype(np.float32),
            "proj": per_layer(D, D, s=0.25), "out": per_layer(D, D, s=0.25), "w": per_layer(N, H),
            "beta": per_layer(N, H, s=0.1), "loglam": np.log(np.full((L, H), 0.95, np.float32))}


def build(expand: str, W: dict) -> Graph:
    dev = DeviceRef.CPU()
    types = [TensorType(I64, ["batch"], dev), TensorType(I64, ["batch"], dev),
             TensorType(F32, [L, "batch", H, HD], dev), TensorType(I64, [], dev)]
    with Graph(f"repro_{expand}", input_types=types) as g:
        ids, pos, states, n_steps = (v.tensor for v in g.inputs)
        c = {k: ops.constant(v, F32, device=dev) for k, v in W.items()}
        onehot = ops.constant(np.repeat(np.eye(H, dtype=np.float32), HD, axis=1), F32, device=dev)
        head = ops.constant(np.repeat(np.arange(H), HD).astype(np.int64), I64, device=dev)
        col = ops.constant(np.repeat((np.arange(H) < H // 2).astype(np.float32), HD), F32, device=dev)
        ones, zeros = (ops.constant(f(D, np.float32), F32, device=dev) for f in (np.ones, np.zeros))

        def expand_heads(v):  # [..., H] -> [..., D]
            return ops.matmul(v, onehot) if expand == "matmul" else ops.gather(v, head, axis=v.rank - 1)

        def body(i, t, p, st):
            x = ops.gather(c["emb"], t, axis=0)
            new_states = []
            for l in range(L):
                z = ops.layer_norm(x, ones, zeros, epsilon=EPS)
                u = ops.matmul(z, ops.transpose(c["proj"][l], 0, 1))
                wt = expand_heads(ops.gather(c["w"][l], p, axis=0))
                bt = expand_heads(ops.gather(c["beta"][l], p, axis=0))
                lam = expand_heads(ops.reshape(ops.exp(c["loglam"][l]), [1, H]))
                s = ops.reshape(st[l], [x.shape[0], D])
                new = u * (col + (1.0 - col) * wt) + lam * s
                y = new * (col * wt + (1.0 - col)) + bt
                x = x + ops.matmul(y, ops.transpose(c["out"][l], 0, 1))
                new_states.append(ops.reshape(new, [x.shape[0], H, HD]))
            logits = ops.matmul(x, ops.transpose(c["head"], 0, 1))
            nxt = ops.squeeze(ops.argmax(logits, axis=-1), -1)
            return i + 1, nxt, p + 1, ops.stack(new_states, axis=0)

        i0 = ops.constant(0, I64, device=dev)
        _, last, _, s_out = ops.while_loop([i0, ids, pos, states], lambda i, *_: i < n_steps, body)
        g.output(last, s_out)
    return g


def numpy_loop(W, ids, pos, states):
    col = np.repeat((np.arange(H) < H // 2).astype(np.float32), HD)
    st = states.reshape(L, B, D).copy()
    for k in range(STEPS):
        x = W["emb"][ids]
        for l in range(L):
            z = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS)
            wt, bt = np.repeat(W["w"][l][pos + k], HD, axis=1), np.repeat(W["beta"][l][pos + k], HD, axis=1)
            st[l] = (z @ W["proj"][l].T) * (col + (1 - col) * wt) + np.repeat(np.exp(W["loglam"][l]), HD) * st[l]
            x = x + (st[l] * (col * wt + (1 - col)) + bt) @ W["out"][l].T
        ids = (x @ W["head"].T).argmax(-1)
    return ids, st


def main() -> int:
    expand = sys.argv[1] if len(sys.argv) > 1 else "matmul"
    W = weights(np.random.default_rng(0))
    ids, pos = np.array([1, 2, 3], np.int64), np.array([3, 4, 5], np.int64)
    states = np.zeros((L, B, H, HD), np.float32)
    model = InferenceSession(devices=[CPU()]).load(build(expand, W))
    last, s_out = model.execute(Buffer.from_numpy(ids), Buffer.from_numpy(pos), Buffer.from_numpy(states),
                                Buffer.from_numpy(np.array(STEPS, np.int64)))
    want_ids, want_states = numpy_loop(W, ids, pos, states)
    err = float(np.abs(s_out.to_numpy().reshape(L, B, D) - want_states).max())
    same = bool((last.to_numpy() == want_ids).all())
    print(f"{expand}: ran {STEPS} steps; tokens equal numpy's: {same}; state max error {err:.2e}")
    return 0 if same and err < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
