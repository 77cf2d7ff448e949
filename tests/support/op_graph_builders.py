"""The op tests' graphs: each Mojo op alone (the row sampler beside graphs/sampler.py's
sampler, which it must equal), float32 (the whole decode step also with bfloat16 matrices,
as a bfloat16 engine packs them), every dimension symbolic where the op allows, so
one compile serves every shape a test tries; and one piece of the PHA prefill graph alone
(the placement of its states). tests/support/op_graphs.py names them by op (or piece),
compiles them up front and loads them."""

from __future__ import annotations

from max.dtype import DType
from max.graph import Dim, Graph, TensorType, ops

from srm_max.graphs import sampler
from srm_max.graphs.pha.model import PrefillStates, StateLayout
from srm_max.graphs.op_names import (OP_DECODE_STEP, OP_DECODE_STEPS, OP_LINEAR, OP_PHA_GSS_SCAN,
                                     OP_PHA_PREFILL_ATTENTION, OP_SAMPLE_ROWS, OP_SCAN, OP_SCORE_HEAD,
                                     OP_SCORE_ROWS, OP_STEP_FUNCTIONAL)
from srm_max.models.pha.config import PHAConfig
from srm_max.models.srm.packing import INPUTS, MATRICES
from srm_max.runtime.kernels import kernel_library

F32, I64 = DType.float32, DType.int64


def _mixer_types(dev, *, scan: bool = False):
    params = [
        TensorType(F32, ["H", "n"], dev),  # w
        TensorType(F32, ["H", "n"], dev),  # beta
        TensorType(F32, ["H"], dev),  # lam
    ]
    if scan:
        return [
            TensorType(F32, ["B", "T", "H", "hd"], dev),
            TensorType(I64, ["B"], dev),  # lengths
            TensorType(I64, ["B"], dev),  # start
            TensorType(F32, ["B", "H", "hd"], dev),  # init
            *params,
        ]
    return [
        TensorType(F32, ["B", "H", "hd"], dev),  # state
        TensorType(F32, ["B", "H", "hd"], dev),
        TensorType(I64, ["B"], dev),
        *params,
    ]


def step_graph(dev):
    """(state, u, positions, w, beta, lam) -> (y, new_state): one mixer step."""
    with Graph("srm_mixer_step_functional", input_types=_mixer_types(dev), custom_extensions=[kernel_library()]) as g:
        state, u, positions, w, beta, lam = (v.tensor for v in g.inputs)
        y_t = TensorType(F32, u.shape, dev)
        y, new_state = ops.custom(OP_STEP_FUNCTIONAL, device=dev, values=[state, u, positions, w, beta, lam],
                                  out_types=[y_t, y_t])
        g.output(y.tensor, new_state.tensor)
    return g


def scan_graph(dev):
    """(u, lengths, start, init, w, beta, lam) -> (y, final_state): the mixer over prompts."""
    with Graph("srm_mixer_scan", input_types=_mixer_types(dev, scan=True), custom_extensions=[kernel_library()]) as g:
        y, fin = scan_op(*(v.tensor for v in g.inputs), device=dev)
        g.output(y.tensor, fin.tensor)
    return g


def scan_op(u, lengths, start, init, w, beta, lam, *, device):
    """The scan op on a graph's values: (y [B, T, H, hd], final state [B, H, hd])."""
    return ops.custom(OP_SCAN, device=device, values=[u, lengths, start, init, w, beta, lam],
                      out_types=[TensorType(F32, u.shape, device),
                                 TensorType(F32, [u.shape[0], u.shape[2], u.shape[3]], device)])


def _decode_graph(dev, greedy: bool, wdtype: DType = F32):
    """(ids, embedding, states, positions, *packing.INPUTS, eps, vocab) -> (logits,
    new_states): one ``srm_decode_step``, the embedding and the packed matrices
    (``packing.MATRICES``) in ``wdtype``, the rest float32. ``vocab`` is any [V] array:
    it only names the logits' width. With ``greedy``: one ``srm_decode_steps``, further
    inputs steps [S], temperature / top_k / top_p / seed [B], mode [1] and scored [1] (0: no
    log-probabilities), and -> (tokens [B, S], new_states, last [B], next positions [B])."""
    shapes = {"norms": ["L", 4, "d"], "fc1_b": ["L", "f"], "biases": ["L", 3, "d"], "w": ["L", "H", "n"],
              "beta": ["L", "H", "n"], "lam": ["L", "H"], "fc1": ["L", "P1"], "fc2": ["L", "P2"],
              "proj": ["L", "P3"], "out": ["L", "P3"], "head": ["P4"]}
    types = [TensorType(I64, ["B"], dev), TensorType(wdtype, ["E", "d"], dev),
             TensorType(F32, ["L", "B", "H", "hd"], dev),
             TensorType(I64, ["B"], dev),
             *(TensorType(wdtype if k in MATRICES else F32, shapes[k], dev) for k in INPUTS),
             TensorType(F32, [1], dev), TensorType(F32, ["V"], dev)]
    if greedy:
        types += [TensorType(I64, ["S"], dev), TensorType(F32, ["B"], dev), TensorType(I64, ["B"], dev),
                  TensorType(F32, ["B"], dev), TensorType(DType.uint64, ["B"], dev), TensorType(I64, [1], dev),
                  TensorType(I64, [1], dev)]
    name = ("srm_decode_steps_op" if greedy else "srm_decode_step_op") + ("_bf16" if wdtype == DType.bfloat16 else "")
    with Graph(name, input_types=types, custom_extensions=[kernel_library()]) as g:
        ids, embedding, states, positions, *rest = (v.tensor for v in g.inputs)
        choice = [rest.pop() for _ in range(7)][::-1] if greedy else []  # steps, sampling, scored
        vocab = rest.pop()
        activations = Dim("f") + 3 * Dim("d")
        if greedy:
            tokens, new_states, last, next_positions, *_ = ops.custom(
                OP_DECODE_STEPS, device=dev, values=[ids, embedding, states, positions, *rest, *choice],
                out_types=[TensorType(I64, ["B", "S"], dev), TensorType(F32, states.shape, dev),
                           TensorType(I64, ["B"], dev), TensorType(I64, ["B"], dev),
                           TensorType(F32, ["B", activations + vocab.shape[0]], dev),
                           TensorType(F32, ["B", "S"], dev), TensorType(F32, ["B", "S", 0], dev),
                           TensorType(I64, ["B", "S", 0], dev)])
            g.output(tokens.tensor, new_states.tensor, last.tensor, next_positions.tensor)
        else:
            logits, new_states, _, _ = ops.custom(
                OP_DECODE_STEP, device=dev, values=[ids, embedding, states, positions, *rest],
                out_types=[TensorType(F32, ["B", vocab.shape[0]], dev), TensorType(F32, states.shape, dev),
                           TensorType(F32, ["B", activations], dev), TensorType(I64, ["B"], dev)])
            g.output(logits.tensor, new_states.tensor)
    return g


def decode_step_graph(dev, wdtype: DType = F32):
    """The whole-step decode op, one step (``_decode_graph``)."""
    return _decode_graph(dev, greedy=False, wdtype=wdtype)


def decode_steps_graph(dev):
    """The whole-step decode op, S steps each choosing its token (``_decode_graph``)."""
    return _decode_graph(dev, greedy=True)


def score_head_graph(dev):
    """(x [R, d], head [V, dh], targets [R], width [K]) -> (logprobs [R], top values
    [R, K], top ids [R, K]). The head's width is its own dimension, so that a mismatch
    reaches the op's check; ``width`` only names the outputs' width K, so one graph serves
    every K."""
    types = [TensorType(F32, ["R", "d"], dev), TensorType(F32, ["V", "dh"], dev), TensorType(I64, ["R"], dev),
             TensorType(I64, ["K"], dev)]
    with Graph("score_head_any_k", input_types=types, custom_extensions=[kernel_library()]) as g:
        rows, w, tg, width = (v.tensor for v in g.inputs)
        R, k_dim = rows.shape[0], width.shape[0]
        out = ops.custom(OP_SCORE_HEAD, device=dev, values=[rows, w, tg],
                         out_types=[TensorType(F32, [R], dev), TensorType(F32, [R, k_dim], dev),
                                    TensorType(I64, [R, k_dim], dev)])
        g.output(*(o.tensor for o in out))
    return g


def score_rows_graph(dev):
    """(logits [R, V], targets [R], width [K]) -> (logprobs [R], top values [R, K], top
    ids [R, K]); ``width`` only names K, so one graph serves every K."""
    types = [TensorType(F32, ["R", "V"], dev), TensorType(I64, ["R"], dev), TensorType(I64, ["K"], dev)]
    with Graph("score_rows_any_k", input_types=types, custom_extensions=[kernel_library()]) as g:
        rows, tg, width = (v.tensor for v in g.inputs)
        R, k_dim = rows.shape[0], width.shape[0]
        out = ops.custom(OP_SCORE_ROWS, device=dev, values=[rows, tg],
                         out_types=[TensorType(F32, [R], dev), TensorType(F32, [R, k_dim], dev),
                                    TensorType(I64, [R, k_dim], dev)])
        g.output(*(o.tensor for o in out))
    return g


def linear_graph(dev):
    """(x [R, K], w [N, Kw], b [Nb]) -> x @ w^T + b [R, N]; w's width and b's length their
    own dimensions, so that a mismatch reaches the op's checks."""
    types = [TensorType(F32, ["R", "K"], dev), TensorType(F32, ["N", "Kw"], dev), TensorType(F32, ["Nb"], dev)]
    with Graph("linear_op", input_types=types, custom_extensions=[kernel_library()]) as g:
        rows, weight, bias = (v.tensor for v in g.inputs)
        y = ops.custom(OP_LINEAR, device=dev, values=[rows, weight, bias],
                       out_types=[TensorType(F32, [rows.shape[0], weight.shape[0]], dev)])
        g.output(y[0].tensor)
    return g


def sample_rows_graph(dev, vocab: int):
    """(logits [b, vocab], temperature, top_k, top_p, seed, counter [b], mode []) ->
    (graphs/sampler.py's tokens, the op's draw): the two on the same logits. The sampler
    needs a static row width."""
    types = [TensorType(F32, ["b", vocab], dev), TensorType(F32, ["b"], dev), TensorType(I64, ["b"], dev),
             TensorType(F32, ["b"], dev), TensorType(DType.uint64, ["b"], dev), TensorType(I64, ["b"], dev),
             TensorType(I64, [], dev)]
    with Graph("sample_rows_vs_graph", input_types=types, custom_extensions=[kernel_library()]) as g:
        logits, t, k, p, seed, counter, mode = (v.tensor for v in g.inputs)
        (op,) = ops.custom(OP_SAMPLE_ROWS, device=dev, values=[logits, t, k, p, seed, counter, ops.reshape(mode, [1])],
                           out_types=[TensorType(I64, [logits.shape[0]], dev)])
        g.output(sampler.sample(logits, t, k, p, seed, counter, mode, dev), op.tensor)
    return g


def pha_prefill_attention_graph(dev):
    """(q [B, T, Hq, dh], k, v [B, T, Hkv, dh], lengths [B]) -> attended [B, T, Hq, dh]."""
    types = [TensorType(F32, ["B", "T", "Hq", "dh"], dev), TensorType(F32, ["B", "T", "Hkv", "dh"], dev),
             TensorType(F32, ["B", "T", "Hkv", "dh"], dev), TensorType(I64, ["B"], dev)]
    with Graph("pha_prefill_attention_alone", input_types=types, custom_extensions=[kernel_library()]) as g:
        q, k, v, lengths = (x.tensor for x in g.inputs)
        (att,) = ops.custom(OP_PHA_PREFILL_ATTENTION, device=dev, values=[q, k, v, lengths],
                            out_types=[TensorType(F32, q.shape, dev)])
        g.output(att.tensor)
    return g


def pha_gss_scan_graph(dev):
    """(ends [B, M, H, 2N], xs [B, M, C, H], a_chunk [2N], a_step [2N], ct [H, 2N], lengths [B])
    -> (carried [B, M, H, 2N], state [B, 2, H, N])."""
    types = [TensorType(F32, ["B", "M", "H", "R"], dev), TensorType(F32, ["XB", "XM", "C", "XH"], dev),
             TensorType(F32, ["A"], dev), TensorType(F32, ["AS"], dev), TensorType(F32, ["CH", "CR"], dev),
             TensorType(I64, ["NB"], dev)]
    with Graph("pha_gss_scan_alone", input_types=types, custom_extensions=[kernel_library()]) as g:
        ends, xs, a_chunk, a_step, ct, lengths = (x.tensor for x in g.inputs)
        B, H = ends.shape[0], ends.shape[2]
        carried, state = ops.custom(OP_PHA_GSS_SCAN, device=dev, values=[ends, xs, a_chunk, a_step, ct, lengths],
                                    out_types=[TensorType(F32, ends.shape, dev),
                                               TensorType(F32, [B, 2, H, ct.shape[1] // 2], dev)])
        g.output(carried.tensor, state.tensor)
    return g




# The PHA prefill's placement of each layer's states in the state tensor (``PrefillStates``),
# alone, for two configs in one graph: head width 4 and a GSS state of 2 * 3 * 3 = 18 floats
# (pieces of gcd(18, 4) = 2 floats per cache row), and a model without the GSS branch.
PHA_PREFILL_STATES = "pha_prefill_states"
NARROW = PHAConfig(vocab_size=40, d_model=16, n_layers=1, context_length=12, n_q_heads=4, n_kv_heads=2,
                   gss_hidden_dim=3, dss_state_size=3)
NO_GSS = PHAConfig(vocab_size=40, d_model=16, n_layers=1, context_length=12, n_q_heads=4, n_kv_heads=2,
                   branches=("attn", "ffn"))
PREFILL_STATES_CONFIGS = (NARROW, NO_GSS)


def pha_prefill_states_graph(dev):
    """(positions [T], then per config: its GSS state [b, gss] if it has one, keys and values
    [b, T, kv]) -> each config's state rows [b, width]."""
    kv = NARROW.n_kv_heads * NARROW.head_dim
    inputs = [TensorType(I64, ["t"], dev)]
    for c in PREFILL_STATES_CONFIGS:
        gss = StateLayout.of(c).gss
        inputs += ([TensorType(F32, ["b", gss], dev)] if gss else []) + [TensorType(F32, ["b", "t", kv], dev)] * 2
    with Graph("pha_prefill_states_alone", input_types=inputs) as g:
        pos, *rest = (v.tensor for v in g.inputs)
        outs = []
        for c in PREFILL_STATES_CONFIGS:
            found = {}
            if StateLayout.of(c).gss:
                found["gss"], rest = rest[0], rest[1:]
            found["attn"], rest = (rest[0], rest[1]), rest[2:]
            outs.append(PrefillStates(c, pos, found["attn"][0].shape[0], dev).layer(found))
        g.output(*outs)
    return g
