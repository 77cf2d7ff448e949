"""The multi-step decode graph: S steps of any model's decode step in one ``execute``."""

from __future__ import annotations

from max.graph import DeviceRef, Graph, TensorType, ops

from .ops import F32, I64, U64
from .sampler import sample

def build_multistep_decode_graph(name: str, state_type: TensorType, make_step, device: DeviceRef,
                                 custom_extensions=()) -> Graph:
    """S decode steps for a batch in one ``execute`` (B and S symbolic), any model.

    Inputs: ids [B], positions [B], states (``state_type``), temperature / top_k /
    top_p / seed [B], mode [] (host), steps [S] (0 .. S-1), n_steps [] (host).
    Outputs: tokens [B, S], states, ids = tokens[:, -1], positions + S.
    ``make_step()`` is called inside the graph and returns ``step(ids, pos, states)
    -> (logits [B, V], new states)``. The token drawn after reading position p has
    position p + 1: that is its random counter.
    """
    host = DeviceRef.CPU()
    input_types = [
        TensorType(I64, ["batch"], device),  # ids
        TensorType(I64, ["batch"], device),  # positions
        state_type,  # states
        TensorType(F32, ["batch"], device),  # temperature
        TensorType(I64, ["batch"], device),  # top_k
        TensorType(F32, ["batch"], device),  # top_p
        TensorType(U64, ["batch"], device),  # seed
        TensorType(I64, [], host),  # sampling mode
        TensorType(I64, ["steps"], device),  # steps iota
        TensorType(I64, [], host),  # n_steps
    ]
    with Graph(name, input_types=input_types, custom_extensions=list(custom_extensions)) as g:
        ids, pos, states, temperature, top_k, top_p, seed, mode, steps, n_steps = (
            v.tensor for v in g.inputs)
        step = make_step()
        acc0 = ops.broadcast_to(ops.unsqueeze(ops.constant(0, I64, device=device), 0),
                                [ids.shape[0], steps.shape[0]])
        acc0 = acc0 + ops.unsqueeze(ids * 0, -1)  # [B, S] zeros
        i_host = ops.constant(0, I64, device=host)
        i_dev = ops.constant(0, I64, device=device)

        # The sampling inputs ride along unchanged: a cond inside the loop body may
        # only use values of the body (MAX 26.7 rejects graph inputs captured there).
        def pred(ih, idv, t, p, s, acc, *sampling):
            return ih < n_steps

        def body(ih, idv, t, p, s, acc, temp, k, top, sd):
            logits, s = step(t, p, s)
            nxt = sample(logits, temp, k, top, sd, p + 1, mode, device)
            hit = ops.cast(ops.equal(ops.unsqueeze(steps, 0), idv), I64)  # [1, S] one-hot
            acc = acc + hit * ops.unsqueeze(nxt, -1)  # each slot written once
            return ih + 1, idv + 1, nxt, p + 1, s, acc, temp, k, top, sd

        _, _, last, pos_out, s_out, toks, *_ = ops.while_loop(
            [i_host, i_dev, ids, pos, states, acc0, temperature, top_k, top_p, seed], pred, body)
        g.output(toks, s_out, last, pos_out)
    return g
