"""The op tests' graphs: each Mojo op alone as an ``OpPiece`` (its inputs, every dimension
symbolic where the op allows, so one compile serves every shape a test tries; its output;
its inputs for a call that does nothing), float32 (the whole decode step also with
bfloat16 matrices, as a bfloat16 engine packs them); the pieces side by side in one graph
(``together``); the row sampler beside graphs/sampler.py's sampler, which it must equal;
and one piece of the PHA prefill graph alone (the placement of its states).
tests/support/op_graphs.py names them by op (or piece), compiles them up front and loads
them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Dim, Graph, StaticDim, SymbolicDim, TensorType, ops

from srm_max.graphs import sampler
from srm_max.graphs.pha.model import PrefillStates, StateLayout
from srm_max.graphs.op_names import (OP_DECODE_STEP, OP_DECODE_STEPS, OP_LINEAR, OP_LINEAR_PACKED, OP_PHA_GSS_SCAN,
                                     OP_PHA_PREFILL_ATTENTION, OP_PHA_QK_ROPE, OP_SAMPLE_ROWS, OP_SCAN, OP_SCORE_HEAD,
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


@dataclass(frozen=True)
class OpPiece:
    """One op alone: its inputs (symbolic dimensions by name), what it computes from them,
    and the sizes of its dimensions in a call that gives it nothing to do."""

    types: Callable  # device -> [TensorType]
    body: Callable  # (input values, device) -> [outputs]
    outputs: int  # how many ``body`` returns (a call of the ``together`` graph picks its own by it)
    idle: dict = field(default_factory=dict)  # dimension -> size where not 0 (the op's shape checks)

    def idle_inputs(self) -> list:
        """Zeros of the piece's input types (CPU buffers), each symbolic dimension 0 or its
        ``idle`` size: a call that gives the op nothing to do."""
        arrays = []
        for t in self.types(DeviceRef.CPU()):
            shape = [int(d) if isinstance(d, StaticDim) else self.idle.get(d.name, 0) for d in t.shape]
            if t.dtype == DType.bfloat16:  # numpy has none: zeros as its bit patterns
                arrays.append(Buffer.from_numpy(np.zeros(shape, np.uint16)).view(DType.bfloat16))
            else:
                arrays.append(Buffer.from_numpy(np.zeros(shape, t.dtype.to_numpy())))
        return arrays


def graph_of(name: str, piece: OpPiece, dev) -> Graph:
    """``piece`` as a graph of its own."""
    with Graph(name, input_types=piece.types(dev), custom_extensions=[kernel_library()]) as g:
        g.output(*_tensors(piece.body([v.tensor for v in g.inputs], dev)))
    return g


def together(name: str, pieces: list[OpPiece], dev) -> Graph:
    """The ``pieces`` side by side in one graph (each piece's dimensions renamed apart): its
    inputs and outputs are theirs one piece after the other. A graph's compile is mostly a
    fixed cost whatever it holds (docs/testing.md), so one graph of several ops alone
    compiles in about the time of one."""
    types = [_renamed(t, f"p{i}_") for i, piece in enumerate(pieces) for t in piece.types(dev)]
    with Graph(name, input_types=types, custom_extensions=[kernel_library()]) as g:
        values, outputs = [v.tensor for v in g.inputs], []
        for piece in pieces:
            n = len(piece.types(dev))
            outputs += _tensors(piece.body(values[:n], dev))
            values = values[n:]
        g.output(*outputs)
    return g


def _renamed(t: TensorType, prefix: str) -> TensorType:
    return TensorType(t.dtype, [Dim(prefix + d.name) if isinstance(d, SymbolicDim) else d for d in t.shape], t.device)


def _tensors(outputs) -> list:
    """The tensors of a body's outputs (``ops.custom`` returns graph values)."""
    return [o.tensor if hasattr(o, "tensor") else o for o in outputs]


def _step_body(values, dev):
    state, u, positions, w, beta, lam = values
    y_t = TensorType(F32, u.shape, dev)
    return ops.custom(OP_STEP_FUNCTIONAL, device=dev, values=[state, u, positions, w, beta, lam], out_types=[y_t, y_t])


# (state, u, positions, w, beta, lam) -> (y, new_state): one mixer step
STEP = OpPiece(_mixer_types, _step_body, 2)
# (u, lengths, start, init, w, beta, lam) -> (y, final_state): the mixer over prompts
SCAN = OpPiece(lambda dev: _mixer_types(dev, scan=True), lambda values, dev: scan_op(*values, device=dev), 2)


def scan_op(u, lengths, start, init, w, beta, lam, *, device):
    """The scan op on a graph's values: (y [B, T, H, hd], final state [B, H, hd])."""
    return ops.custom(OP_SCAN, device=device, values=[u, lengths, start, init, w, beta, lam],
                      out_types=[TensorType(F32, u.shape, device),
                                 TensorType(F32, [u.shape[0], u.shape[2], u.shape[3]], device)])


def _decode_types(dev, greedy: bool, wdtype: DType = F32) -> list[TensorType]:
    """(ids, embedding, states, positions, *packing.INPUTS, eps, vocab): one
    ``srm_decode_step``'s inputs, the embedding and the packed matrices
    (``packing.MATRICES``) in ``wdtype``, the rest float32. ``vocab`` is any [V] array: it
    only names the logits' width. With ``greedy`` (``srm_decode_steps``) further inputs
    steps [S], temperature / top_k / top_p / seed [B], mode [1] and scored [1] (0: no
    log-probabilities)."""
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
    return types


def _decode_body(values, dev, greedy: bool):
    """-> (logits [B, V], new_states) of one step; with ``greedy`` (tokens [B, S],
    new_states, last [B], next positions [B])."""
    ids, embedding, states, positions, *rest = values
    choice = [rest.pop() for _ in range(7)][::-1] if greedy else []  # steps, sampling, scored
    vocab = rest.pop()
    B, d, f = ids.shape[0], embedding.shape[1], rest[1].shape[1]  # rest[1]: fc1_b [L, f]
    activations = f + 3 * d
    if greedy:
        S = choice[0].shape[0]
        tokens, new_states, last, next_positions, *_ = ops.custom(
            OP_DECODE_STEPS, device=dev, values=[ids, embedding, states, positions, *rest, *choice],
            out_types=[TensorType(I64, [B, S], dev), TensorType(F32, states.shape, dev),
                       TensorType(I64, [B], dev), TensorType(I64, [B], dev),
                       TensorType(F32, [B, activations + vocab.shape[0]], dev),
                       TensorType(F32, [B, S], dev), TensorType(F32, [B, S, 0], dev),
                       TensorType(I64, [B, S, 0], dev)])
        return [tokens, new_states, last, next_positions]
    logits, new_states, _, _ = ops.custom(
        OP_DECODE_STEP, device=dev, values=[ids, embedding, states, positions, *rest],
        out_types=[TensorType(F32, [B, vocab.shape[0]], dev), TensorType(F32, states.shape, dev),
                   TensorType(F32, [B, activations], dev), TensorType(I64, [B], dev)])
    return [logits, new_states]


# the whole-step decode op, one step, float32 weights: -> (logits, new_states)
DECODE_STEP = OpPiece(lambda dev: _decode_types(dev, False), lambda values, dev: _decode_body(values, dev, False), 2)
# S steps each choosing its token: -> (tokens, new_states, last, next positions); the op's
# scratch must hold a row of the logits (V <= the embedding's rows)
DECODE_STEPS = OpPiece(lambda dev: _decode_types(dev, True), lambda values, dev: _decode_body(values, dev, True), 4,
                       {"V": 1, "E": 1})


def decode_step_graph(dev, wdtype: DType = F32):
    """The whole-step decode op, one step, alone (its bfloat16-weight graph; the float32
    one is among the ops together)."""
    piece = OpPiece(lambda d: _decode_types(d, False, wdtype), DECODE_STEP.body, 2)
    return graph_of("srm_decode_step_op" + ("_bf16" if wdtype == DType.bfloat16 else ""), piece, dev)


def _score_head_types(dev, mdtype: DType = F32):
    return [TensorType(F32, ["R", "d"], dev), TensorType(mdtype, ["S"], dev), TensorType(I64, ["A"], dev),
            TensorType(I64, ["R"], dev), TensorType(I64, ["K"], dev)]


def _score_rows_types(dev):
    return [TensorType(F32, ["R", "V"], dev), TensorType(I64, ["R"], dev), TensorType(I64, ["K"], dev)]


def _scored(op: str, values, dev):
    """``op`` on the values but the last, ``width`` [K], which only names the outputs'
    width K (one graph serves every K) -> (logprobs [R], top values [R, K], top ids [R, K])."""
    *inputs, width = values
    R, k_dim = inputs[0].shape[0], width.shape[0]
    return ops.custom(op, device=dev, values=inputs,
                      out_types=[TensorType(F32, [R], dev), TensorType(F32, [R, k_dim], dev),
                                 TensorType(I64, [R, k_dim], dev)])


# (x [R, d], mats [S], head_at [A], targets [R], width [K]): the head packed at
# mats[head_at[0]:] with head_at[1] tokens; head_at's size its own dimension, so that a
# wrong one reaches the op's check
SCORE_HEAD = OpPiece(_score_head_types, lambda values, dev: _scored(OP_SCORE_HEAD, values, dev), 3, {"K": 1, "A": 2})
# the same op on a bfloat16 head (a piece of its own: the op is compiled per dtype)
SCORE_HEAD_BF16 = "srm_score_head_bf16_head"
SCORE_HEAD_BF16_HEAD = OpPiece(lambda dev: _score_head_types(dev, DType.bfloat16), SCORE_HEAD.body, 3,
                               {"K": 1, "A": 2})
# (logits [R, V], targets [R], width [K])
SCORE_ROWS = OpPiece(_score_rows_types, lambda values, dev: _scored(OP_SCORE_ROWS, values, dev), 3, {"K": 1, "V": 1})


def _linear_body(values, dev):
    rows, weight, bias = values
    return ops.custom(OP_LINEAR, device=dev, values=[rows, weight, bias],
                      out_types=[TensorType(F32, [rows.shape[0], weight.shape[0]], dev)])


def _linear_piece(wdtype: DType) -> OpPiece:
    """(x [R, K], w [N, Kw] in ``wdtype``, b [Nb]) -> x @ w^T + b [R, N]; w's width and b's
    length their own dimensions, so that a mismatch reaches the op's checks."""
    return OpPiece(lambda dev: [TensorType(F32, ["R", "K"], dev), TensorType(wdtype, ["N", "Kw"], dev),
                                TensorType(F32, ["Nb"], dev)], _linear_body, 1)


LINEAR = _linear_piece(F32)
# the same op on bfloat16 weights (a piece of its own: the op is compiled per weight dtype)
LINEAR_BF16 = "srm_linear_bf16_weights"
LINEAR_BF16_WEIGHTS = _linear_piece(DType.bfloat16)


def _linear_packed_body(values, dev):
    rows, mats, layer, bias, scale = values
    return ops.custom(OP_LINEAR_PACKED, device=dev, values=[rows, mats, layer, bias, scale],
                      out_types=[TensorType(F32, [rows.shape[0], bias.shape[0]], dev)])


def _linear_packed_piece(mdtype: DType) -> OpPiece:
    """(x [R, K], mats [S] in ``mdtype``, layer [A], b [N], scale [SR, SN]) -> act(x @ w^T +
    b) (* scale) [R, N], w the [N, K] matrix packed at mats[layer[0]:], act the activation
    layer[1]; layer's and scale's sizes their own dimensions, so that a wrong one reaches
    the op's checks."""
    return OpPiece(lambda dev: [TensorType(F32, ["R", "K"], dev), TensorType(mdtype, ["S"], dev),
                                TensorType(I64, ["A"], dev), TensorType(F32, ["N"], dev),
                                TensorType(F32, ["SR", "SN"], dev)],
                   _linear_packed_body, 1, {"A": 2})


LINEAR_PACKED = _linear_packed_piece(F32)
# the same op on bfloat16 matrices (a piece of its own: the op is compiled per dtype)
LINEAR_PACKED_BF16 = "srm_linear_packed_bf16_matrices"
LINEAR_PACKED_BF16_MATRICES = _linear_packed_piece(DType.bfloat16)


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


def _attention_body(values, dev):
    q = values[0]
    return ops.custom(OP_PHA_PREFILL_ATTENTION, device=dev, values=values, out_types=[TensorType(F32, q.shape, dev)])


# (q [B, R, Hq, dh], k, v [B, T, Hkv, dh], lengths [B], at [B, R]) -> attended [B, R, Hq, dh]
PHA_ATTENTION = OpPiece(lambda dev: [TensorType(F32, ["B", "R", "Hq", "dh"], dev),
                                     TensorType(F32, ["B", "T", "Hkv", "dh"], dev),
                                     TensorType(F32, ["B", "T", "Hkv", "dh"], dev), TensorType(I64, ["B"], dev),
                                     TensorType(I64, ["B", "R"], dev)],
                        _attention_body, 1, {"Hq": 1, "Hkv": 1})


def _qk_rope_body(values, dev):
    q, k, pos, freq, scale = values
    return ops.custom(OP_PHA_QK_ROPE, device=dev, values=[q, k, pos, freq, scale],
                      out_types=[TensorType(F32, q.shape, dev), TensorType(F32, k.shape, dev)])


# (q [B, T, QW], k [B, T, KW], pos [T], freq [F], scale [QW]) -> (q', k'): heads of 2F channels
PHA_QK_ROPE = OpPiece(lambda dev: [TensorType(F32, ["B", "T", "QW"], dev), TensorType(F32, ["B", "T", "KW"], dev),
                                   TensorType(I64, ["T"], dev), TensorType(F32, ["F"], dev),
                                   TensorType(F32, ["QW"], dev)], _qk_rope_body, 2, {"F": 1})


def _gss_scan_body(values, dev):
    xs, ct = values[0], values[7]
    B, H = xs.shape[0], xs.shape[3]
    return ops.custom(OP_PHA_GSS_SCAN, device=dev, values=values,
                      out_types=[TensorType(F32, xs.shape, dev), TensorType(F32, [B, 2, H, ct.shape[1] // 2], dev)])


# (xs [B, M, C, H], taps [H, C], long_taps [LT, H], d [H], p_end [C, 2N], p_out_t [2N, C],
#  p_step [S, 2N], ct [H, 2N], lengths [B]) -> (y [B, M, C, H], state [B, 2, H, N])
PHA_GSS_SCAN = OpPiece(lambda dev: [TensorType(F32, ["B", "M", "C", "H"], dev), TensorType(F32, ["TH", "TC"], dev),
                                    TensorType(F32, ["LT", "LH"], dev), TensorType(F32, ["DH"], dev),
                                    TensorType(F32, ["EC", "ER"], dev), TensorType(F32, ["OR", "OC"], dev),
                                    TensorType(F32, ["S", "SR"], dev), TensorType(F32, ["CH", "CR"], dev),
                                    TensorType(I64, ["NB"], dev)],
                       _gss_scan_body, 2, {"C": 1, "TC": 1, "EC": 1, "OC": 1, "S": 2})


# The PHA prefill's placement of each layer's states in the state tensor (``PrefillStates``,
# by plain ops and by the op), alone, for three configs in one graph: head width 4 and a GSS
# state of 2 * 3 * 3 = 18 floats (pieces of gcd(18, 4) = 2 floats per cache row), a model
# without the GSS branch and one without the attention.
PHA_PREFILL_STATES = "pha_prefill_states"
NARROW = PHAConfig(vocab_size=40, d_model=16, n_layers=1, context_length=12, n_q_heads=4, n_kv_heads=2,
                   gss_hidden_dim=3, dss_state_size=3)
NO_GSS = PHAConfig(vocab_size=40, d_model=16, n_layers=1, context_length=12, n_q_heads=4, n_kv_heads=2,
                   branches=("attn", "ffn"))
NO_ATTN = PHAConfig(vocab_size=40, d_model=16, n_layers=1, context_length=12, n_q_heads=4, n_kv_heads=2,
                    gss_hidden_dim=3, dss_state_size=3, branches=("gss", "ffn"))
PREFILL_STATES_CONFIGS = (NARROW, NO_GSS, NO_ATTN)
PREFILL_STATES_LAYERS = 2  # each config's states placed for this many layers at once


def prefill_states_inputs(config, dev) -> list[TensorType]:
    """One layer's inputs of ``PrefillStates``: its GSS state [b, gss] and its keys and values
    [b, t, kv], those of them the config's branches have."""
    lay, kv = StateLayout.of(config), config.n_kv_heads * config.head_dim
    return ([TensorType(F32, ["b", lay.gss], dev)] if lay.gss else []) \
        + ([TensorType(F32, ["b", "t", kv], dev)] * 2 if lay.kv else [])


def pha_prefill_states_graph(dev):
    """(positions [T], then per config and layer ``prefill_states_inputs``) -> per config its
    states [layers, b, width] by plain ops, then by the op (``PrefillStates``' two paths)."""
    inputs = [TensorType(I64, ["t"], dev)]
    for c in PREFILL_STATES_CONFIGS:
        inputs += prefill_states_inputs(c, dev) * PREFILL_STATES_LAYERS
    with Graph("pha_prefill_states_alone", input_types=inputs, custom_extensions=[kernel_library()]) as g:
        pos, *rest = (v.tensor for v in g.inputs)
        outs = []
        for c in PREFILL_STATES_CONFIGS:
            lay, found_by_layer = StateLayout.of(c), []
            for _ in range(PREFILL_STATES_LAYERS):
                found = {}
                if lay.gss:
                    found["gss"], rest = rest[0], rest[1:]
                if lay.kv:
                    found["attn"], rest = (rest[0], rest[1]), rest[2:]
                found_by_layer.append(found)
            first = found_by_layer[0]
            batch = (first["attn"][0] if "attn" in first else first["gss"]).shape[0]
            outs += [PrefillStates(c, pos, batch, dev, by_op=op).stacked(found_by_layer) for op in (False, True)]
        g.output(*outs)
    return g
