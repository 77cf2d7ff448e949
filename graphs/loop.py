"""The multi-step decode graph: S steps of any model's decode step in one ``execute``."""

from __future__ import annotations

from max.graph import DeviceRef, Graph, TensorType, TensorValue, ops

from .ops import F32, I64, U64
from .sampler import drawn_logprobs, sample
from .scoring import top_width


def build_multistep_decode_graph(name: str, state_type: TensorType, make_step, vocab_size: int, device: DeviceRef,
                                 custom_extensions=()) -> Graph:
    """S decode steps for a batch in one ``execute`` (B and S symbolic), any model.

    Inputs: ids [B], positions [B], states (``state_type``), temperature / top_k /
    top_p / seed [B], mode [] (host), steps [S] (0 .. S-1), n_steps [] (host), scored []
    (host: 1 for the log-probabilities below, 0 for zeros at no cost).
    Outputs: tokens [B, S], states, ids = tokens[:, -1], positions + S; then each new
    token's raw log-probability [B, S] f32 (log_softmax of the logits, no temperature or
    filters) and the K likeliest tokens' at each step [B, S, K] f32 with their ids [B, S,
    K] int64 (``sampler.drawn_logprobs``, K = ``scoring.top_width(vocab_size)``).
    ``make_step()`` is called inside the graph and returns ``step(ids, pos, states)
    -> (logits [B, V], new states)``. The token drawn after reading position p has
    position p + 1: that is its random counter.
    """
    host = DeviceRef.CPU()
    K = top_width(vocab_size)
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
        TensorType(I64, [], host),  # scored
    ]
    with Graph(name, input_types=input_types, custom_extensions=list(custom_extensions)) as g:
        ids, pos, states, temperature, top_k, top_p, seed, mode, steps, n_steps, scored = (
            v.tensor for v in g.inputs)
        step = make_step()
        B, S = ids.shape[0], steps.shape[0]
        toks0 = _zeros(I64, [B, S], ids, device)
        lp0, values0 = _zeros(F32, [B, S], ids, device), _zeros(F32, [B, S, K], ids, device)
        top0 = _zeros(I64, [B, S, K], ids, device)
        i_host = ops.constant(0, I64, device=host)
        i_dev = ops.constant(0, I64, device=device)

        # The sampling inputs ride along unchanged: a cond inside the loop body may
        # only use values of the body (MAX 26.7 rejects graph inputs captured there).
        def pred(ih, idv, t, p, s, *rest):
            return ih < n_steps

        def body(ih, idv, t, p, s, toks, lp, values, top, temp, k, tp, sd):
            logits, s = step(t, p, s)
            nxt = sample(logits, temp, k, tp, sd, p + 1, mode, device)
            new_lp, new_values, new_top = drawn_logprobs(logits, nxt, scored, device)
            # each step writes its own column (an elementwise select: no one-hot matmul in a
            # loop, docs/avx2_crash.md)
            hit = ops.equal(ops.unsqueeze(steps, 0), idv)  # [1, S]
            toks = ops.where(hit, ops.unsqueeze(nxt, -1), toks)
            lp = ops.where(hit, ops.unsqueeze(new_lp, -1), lp)
            hit3 = ops.unsqueeze(hit, -1)  # [1, S, 1]
            values = ops.where(hit3, ops.unsqueeze(new_values, 1), values)
            top = ops.where(hit3, ops.unsqueeze(new_top, 1), top)
            return ih + 1, idv + 1, nxt, p + 1, s, toks, lp, values, top, temp, k, tp, sd

        _, _, last, pos_out, s_out, toks, lp, values, top, *_ = ops.while_loop(
            [i_host, i_dev, ids, pos, states, toks0, lp0, values0, top0, temperature, top_k, top_p, seed], pred, body)
        g.output(toks, s_out, last, pos_out, lp, values, top)
    return g


def _zeros(dtype, shape: list, like: TensorValue, device: DeviceRef) -> TensorValue:
    """Zeros of ``shape`` whose symbolic dims come from the graph's inputs (``like`` [B]
    ties the batch dim to the inputs' own, as the loop's carried values must keep it)."""
    z = ops.broadcast_to(ops.constant(0, dtype, device=device), shape)
    return z + ops.reshape(ops.cast(like, dtype) * 0, [-1] + [1] * (len(shape) - 1))
