"""The MAX prefill and decode graphs against the PyTorch reference (same weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srm_max.graphs import sampler
from srm_max.runtime.call_types import SamplingArrays
from tests.support.sampler_mirror import draw_np, filtered_probs
from tests.support.checks import assert_close_rel, assert_prefill_matches_reference
from tests.support.graphs import graphs
from tests.support.prompts import random_prompts, reference_prefill
from tests.support.single_steps import decode_in_single_steps, single_step_graphs
from tests.support.tiny import TINY

# Every test runs the float32 graphs with the Mojo ops (the CPU engine's default); a test
# that also runs the bfloat16 ones or the plain-op ones declares them itself, so that the
# x86-64-v3 guard (tests/runtime/test_cpu_target.py), which selects the tests needing the
# float32 Mojo-op graphs alone, compiles only those.
pytestmark = graphs(TINY)
BFLOAT16 = graphs(TINY, dtype="bfloat16")
PLAIN_OPS = graphs(TINY, ("prefill", "decode", "sample", "regroup"), kernels=False)
DTYPES = [pytest.param("float32"), pytest.param("bfloat16", marks=BFLOAT16)]

# Mixed lengths: 1 token, inside one chunk, across chunk borders, the full context.
PROMPT_LENGTHS = [1, 5, 32, 33, 70, 96]


def prompts_of(lengths, seed=0):
    return random_prompts(lengths, TINY.vocab_size, seed)


def engine_of(request, dtype: str):
    """The session's float32 or bfloat16 engine (the other one is not built)."""
    return request.getfixturevalue("engine" if dtype == "float32" else "engine_bf16")


def ref_prefill(reference, prompts):
    """The reference's last-token logits and states of right-padded prompts, as numpy."""
    logits, states = reference_prefill(reference, prompts)
    return logits, states.numpy()


def test_prefill_logits_and_states_match_reference(engine, reference):
    prompts = prompts_of(PROMPT_LENGTHS)
    # the logits, and the greedy first token = their argmax
    res, _, ref_states = assert_prefill_matches_reference(engine, reference, prompts, TINY.vocab_size)
    states = engine.host(res.states)
    assert states.shape == (TINY.n_layers, len(prompts), TINY.n_heads, TINY.head_dim)
    assert_close_rel(states, ref_states.numpy())


def test_prefill_is_independent_of_batch_padding(engine):
    prompts = prompts_of([7, 40])
    alone = engine.host(engine.prefill(prompts[:1]).logits)
    batched = engine.host(engine.prefill(prompts).logits)
    assert_close_rel(batched[:1], alone, rel=1e-6)


def ref_greedy(reference, prompts, steps):
    """Reference: per-sample prefill, then batched recurrent steps with per-sample positions."""
    logits, states = ref_prefill(reference, prompts)
    states = torch.tensor(states)
    tok = torch.tensor(logits.argmax(-1))
    pos = torch.tensor([len(p) for p in prompts])
    out = [tok]
    with torch.no_grad():
        for _ in range(steps):
            logits, states = reference.step(tok, pos, states)
            tok, pos = logits.argmax(-1), pos + 1
            out.append(tok)
    return torch.stack(out, 1).numpy(), states.numpy()


@pytest.mark.parametrize("steps_per_call", [1, 16])
def test_greedy_decode_matches_reference(engine, reference, steps_per_call):
    lengths = [1, 9, 31, 20]
    steps = 64  # longest: 31 + 1 + 64 = 96 = n
    prompts = prompts_of(lengths, seed=1)
    ref_tokens, ref_states = ref_greedy(reference, prompts, steps)
    pre = engine.prefill(prompts)
    tokens = [pre.next_ids]
    ids, pos, states = pre.next_ids, np.array(lengths, np.int64), pre.states
    sampling = engine.sampling_buffers(SamplingArrays.greedy(len(prompts)))
    for _ in range(steps // steps_per_call):
        res = engine.decode(ids, pos, states, sampling, steps_per_call)
        tokens.extend(res.tokens.T)
        ids, pos, states = res.ids, res.positions, res.states  # device buffers fed back
    tokens = np.stack(tokens, 1)
    assert (tokens == ref_tokens).all(), np.argwhere(tokens != ref_tokens)[:5]
    assert (engine.host(pos) == np.array(lengths) + steps).all()
    # the states before the last token was fed: reference stepped one token further
    assert_close_rel(engine.host(states), ref_step_states(reference, prompts, ref_tokens[:, :-1]))


@pytest.mark.gpu
def test_the_gpu_engine_matches_the_reference(tiny_weights, reference):
    """On a GPU (its default: plain MAX ops) prefill and greedy decode agree with the reference."""
    from srm_max.models.srm.engine import Engine

    gpu = Engine(TINY, tiny_weights, device="gpu")
    lengths, steps = [1, 9, 31, 20], 16
    prompts = prompts_of(lengths, seed=1)
    pre = gpu.prefill(prompts)
    ref_logits, _ = ref_prefill(reference, prompts)
    assert_close_rel(gpu.host(pre.logits), ref_logits)
    res = gpu.decode(pre.next_ids, np.array(lengths, np.int64), pre.states, SamplingArrays.greedy(len(prompts)),
                     steps)
    ref_tokens, _ = ref_greedy(reference, prompts, steps)
    assert (np.concatenate([pre.next_ids[:, None], res.tokens], 1) == ref_tokens[:, : steps + 1]).all()


@PLAIN_OPS
def test_mixer_kernels_and_plain_ops_agree(engine, tiny_weights, reference):
    """The graphs with the Mojo mixer ops (the CPU default: scan in prefill, step in
    decode) and with plain MAX ops (the GPU default): same tokens, logits and states,
    both equal to the reference. Lengths cover one token, a chunk border and n."""
    from srm_max.models.srm.engine import Engine

    mojo, engine = engine, Engine(TINY, tiny_weights, kernels=False)
    assert mojo.kernels and not engine.kernels
    prompts = prompts_of(PROMPT_LENGTHS, seed=8)
    pres = [e.prefill(prompts) for e in (mojo, engine)]
    assert (pres[0].next_ids == pres[1].next_ids).all()
    assert_close_rel(mojo.host(pres[0].logits), engine.host(pres[1].logits))
    assert_close_rel(mojo.host(pres[0].states), engine.host(pres[1].states))

    lengths = [3, 40, 17]
    prompts = prompts_of(lengths, seed=9)
    s = SamplingArrays(np.array([0.0, 1.0, 0.9], np.float32), np.array([0, 0, 4], np.int64),
                       np.array([1.0, 0.8, 1.0], np.float32), np.array([5, 6, 7], np.uint64))
    pre = engine.prefill(prompts, s)
    outs = [e.decode(pre.next_ids, lengths, pre.states, s, 24) for e in (mojo, engine)]
    assert (outs[0].tokens == outs[1].tokens).all()
    assert_close_rel(mojo.host(outs[0].states), engine.host(outs[1].states))
    fed = np.concatenate([pre.next_ids[:, None], outs[0].tokens[:, :-1]], 1)
    assert_close_rel(mojo.host(outs[0].states), ref_step_states(reference, prompts, fed))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_whole_step_op_gives_a_sample_the_same_tokens_in_any_batch(request, dtype):
    """On the CPU with the Mojo kernels a decode step is one op (mojo/decode_step.mojo)
    that cuts the batch into tiles of rows and units of tiles: a sample draws the same
    tokens and ends in the same state alone, in a small batch and in a batch of several
    units (float32 and bfloat16). Against the plain graph and the reference: the tests
    above."""
    from max.dtype import DType
    from max.graph import DeviceRef

    from srm_max.models.srm.build import build_graph

    engine = engine_of(request, dtype)
    assert "srm_decode_step" in str(build_graph("decode", TINY, DType.float32, DeviceRef.CPU(), kernels=True))
    assert "srm_decode_step" not in str(build_graph("decode", TINY, DType.float32, DeviceRef.CPU(), kernels=False))
    B = 53  # two units of rows, register tiles of 6 and a remainder
    rng = np.random.default_rng(21)
    lengths = rng.integers(1, 40, B).tolist()
    prompts = prompts_of(lengths, seed=21)
    s = SamplingArrays(np.where(np.arange(B) % 3 == 0, 0.0, 0.9).astype(np.float32),
                       np.where(np.arange(B) % 4 == 2, 5, 0).astype(np.int64),
                       np.where(np.arange(B) % 4 == 1, 0.9, 1.0).astype(np.float32),
                       np.arange(B, dtype=np.uint64) + 40)
    steps = 24

    pre = engine.prefill(prompts, s)
    pre_states = engine.host(pre.states)

    def run(index):  # decode only, from the same prefill
        out = engine.decode(pre.next_ids[index], [lengths[i] for i in index],
                            engine.to_device(pre_states[:, index]), s.take(index), steps)
        return out.tokens, engine.host(out.states)

    big_tokens, big_states = run(list(range(B)))
    for index in (list(range(7)), [B - 1]):
        tokens, states = run(index)
        assert (tokens == big_tokens[index]).all()
        np.testing.assert_array_equal(states, big_states[:, index])


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=single_step_graphs("float32")),
                                   pytest.param("bfloat16", marks=[BFLOAT16, single_step_graphs("bfloat16")])])
def test_greedy_decode_in_one_op_equals_single_steps(request, dtype):
    """An all-greedy decode on the CPU runs every step inside one op
    (``srm_decode_steps``); single steps of the whole-step op with MAX's argmax
    (tests/support/single_steps.py) give the same tokens, bit for bit the same states, and
    the same last ids and positions, also where positions run past the context (clamped)."""
    engine = engine_of(request, dtype)
    assert engine.steps_in_one_op
    n = TINY.context_length
    lengths = [1, 5, 33, 60, n - 4, n, 17]
    prompts = prompts_of(lengths, seed=31)
    pre = engine.prefill(prompts)
    greedy = SamplingArrays.greedy(len(prompts))
    steps = 10
    one_op = engine.decode(pre.next_ids, lengths, pre.states, greedy, steps)
    toks, states, last, pos = decode_in_single_steps(engine, pre.next_ids, lengths, pre.states, greedy, steps)
    np.testing.assert_array_equal(one_op.tokens, toks)
    np.testing.assert_array_equal(engine.host(one_op.states), states)
    np.testing.assert_array_equal(engine.host(one_op.ids), last)
    np.testing.assert_array_equal(engine.host(one_op.positions), pos)


@BFLOAT16
@PLAIN_OPS
def test_the_suite_precompiles_the_graphs_its_engines_load(request, engine, engine_bf16, tiny_weights):
    """The graphs this module declares (its own marker, and the bfloat16 and plain-op
    markers its tests add, all on this test) must be exactly those its engines load, or
    CI compiles twice."""
    from tests.support.graphs import declared_graph_jobs
    from srm_max.models.srm.engine import Engine

    jobs = set(declared_graph_jobs([request.node]))
    plain = Engine(TINY, tiny_weights, kernels=False)
    loaded = {e.graph_job(kind) for e in (engine, engine_bf16, plain) for kind in e.graph_kinds()}
    assert loaded == jobs


def ref_step_states(reference, prompts, fed):
    """States after the prompts and then the tokens ``fed`` [B, k], stepped one at a time."""
    _, states = ref_prefill(reference, prompts)
    states = torch.tensor(states)
    pos = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        for k in range(fed.shape[1]):
            _, states = reference.step(torch.tensor(fed[:, k]), pos + k, states)
    return states.numpy()


def test_prefill_states_equal_stepping(engine):
    """MAX prefill over a prompt == MAX prefill of its first token + decode steps feeding the rest."""
    prompts = prompts_of([40, 65, 12], seed=2)
    full = engine.host(engine.prefill(prompts).states)
    k = 12  # step the first 12 tokens of each
    states = engine.prefill([p[:1] for p in prompts]).states
    sampling = engine.sampling_buffers(SamplingArrays.greedy(len(prompts)))
    for t in range(1, k):
        ids = np.array([p[t] for p in prompts], np.int64)
        res = engine.decode(ids, np.full(len(prompts), t, np.int64), states, sampling, 1)
        states = res.states
    stepped = engine.host(states)
    part = engine.host(engine.prefill([p[:k] for p in prompts]).states)
    assert_close_rel(stepped, part)
    assert not np.allclose(full, part)  # sanity: the longer prompts really differ


# ------------------------------------------------------------------ sampling

def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square; bins expecting < 5 are pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    if dof == 0:
        return 1.0  # one possible outcome (checked by the caller's zero-probability test)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


SAMPLING_CASES = [  # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.7, 5, 1.0),
    (1.5, 0, 0.8),
    (1.0, 8, 0.6),
]
N_SAMPLES = 4000


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING_CASES)
def test_sampled_distribution_matches_reference(engine, reference, temperature, top_k, top_p):
    prompt = prompts_of([6], seed=3)[0]
    ref_logits, _ = ref_prefill(reference, [prompt])
    probs = filtered_probs(ref_logits[0], temperature, top_k, top_p)
    s = SamplingArrays(np.full(N_SAMPLES, temperature, np.float32), np.full(N_SAMPLES, top_k, np.int64),
                       np.full(N_SAMPLES, top_p, np.float32), np.arange(N_SAMPLES, dtype=np.uint64) + 1000)
    ids = engine.prefill([prompt] * N_SAMPLES, s).next_ids  # N samples in one batched call
    counts = np.bincount(ids, minlength=TINY.vocab_size)
    assert counts[probs == 0].sum() == 0, "sampled a token the filters exclude"
    p = chi_square_pvalue(counts, probs)
    assert p > 1e-3, f"chi-square p = {p:.2g}"


def test_decode_sampling_distribution(engine, reference):
    """The decode graph's sampler, one step from a shared state."""
    prompt = prompts_of([10], seed=4)[0]
    pre = engine.prefill([prompt])
    tok = int(pre.next_ids[0])
    with torch.no_grad():
        _, st = ref_prefill(reference, [prompt])
        logits, _ = reference.step(torch.tensor([tok]), torch.tensor([10]), torch.tensor(st))
    probs = filtered_probs(logits[0].numpy(), 1.0, 0, 0.9)
    states = np.repeat(engine.host(pre.states), N_SAMPLES, axis=1)
    s = SamplingArrays(np.ones(N_SAMPLES, np.float32), np.zeros(N_SAMPLES, np.int64),
                       np.full(N_SAMPLES, 0.9, np.float32), np.arange(N_SAMPLES, dtype=np.uint64))
    res = engine.decode(np.full(N_SAMPLES, tok), np.full(N_SAMPLES, 10), engine.to_device(states), s, 1)
    counts = np.bincount(res.tokens[:, 0], minlength=TINY.vocab_size)
    assert counts[probs == 0].sum() == 0
    assert chi_square_pvalue(counts, probs) > 1e-3


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7)])
def test_sampler_draw_is_the_documented_inverse_cdf(engine, top_k, top_p):
    """The in-graph draw is sampler_mirror.draw_np on filtered_probs (checked on MAX's logits)."""
    prompt = prompts_of([6], seed=3)[0]
    B = 64
    seeds = np.arange(B, dtype=np.uint64) * 7919 + 5
    s = SamplingArrays(np.full(B, 0.8, np.float32), np.full(B, top_k, np.int64),
                       np.full(B, top_p, np.float32), seeds)
    res = engine.prefill([prompt] * B, s)
    logits = engine.host(res.logits).astype(np.float64)
    expected = [draw_np(filtered_probs(logits[b], 0.8, top_k, top_p), int(seeds[b]), len(prompt))
                for b in range(B)]
    assert (res.next_ids == np.array(expected)).mean() >= 0.95  # float32 vs float64 at cdf edges aside


def test_a_sample_draws_the_same_whatever_its_batch_mates(engine):
    """Greedy / plain / filtered batches run different in-graph branches; the
    samples without filters must not notice (prefill and multi-step decode)."""
    prompts = prompts_of([7] * 4, seed=11)
    seeds = np.array([3, 1, 4, 1], np.uint64)
    plain = [1.0, 0.0, 1.3, 0.0]  # samples 0, 2 sampled, 1, 3 greedy: plain mode

    def run(temps, top_k):
        s = SamplingArrays(np.array(temps, np.float32), np.array(top_k, np.int64),
                           np.ones(4, np.float32), seeds)
        assert s.mode() == (sampler.MODE_FILTERED if any(top_k) else sampler.MODE_PLAIN)
        pre = engine.prefill(prompts, s)
        dec = engine.decode(pre.next_ids, [7] * 4, pre.states, s, 12)
        return np.concatenate([pre.next_ids[:, None], dec.tokens], 1)

    a = run(plain, [0, 0, 0, 0])
    b = run(plain[:3] + [0.9], [0, 0, 0, 3])  # sample 3 now filtered: filtered mode
    assert (a[:3] == b[:3]).all()
    greedy = SamplingArrays.greedy(4)
    assert greedy.mode() == sampler.MODE_GREEDY
    pre = engine.prefill(prompts, greedy)
    dec = engine.decode(pre.next_ids, [7] * 4, pre.states, greedy, 12)
    assert (np.concatenate([pre.next_ids[:, None], dec.tokens], 1)[[1, 3]] == a[[1, 3]]).all()


# ------------------------------------------------------------------ bfloat16
BF16_LOGIT_BOUND = 0.02  # max |bf16 - f32| logit error relative to max |f32 logit| (measured 0.006)


@BFLOAT16
def test_bfloat16_logits_close_and_greedy_equal(engine, engine_bf16):
    prompts = prompts_of([4, 17, 50], seed=5)
    f32 = engine.prefill(prompts)
    bf = engine_bf16.prefill(prompts)
    a, b = engine.host(f32.logits), engine_bf16.host(bf.logits)
    err = np.abs(a - b).max() / np.abs(a).max()
    assert err < BF16_LOGIT_BOUND, f"bf16 logits off by {err:.3g} (relative)"
    steps = 16
    greedy = SamplingArrays.greedy(len(prompts))
    r32 = engine.decode(f32.next_ids, [len(p) for p in prompts], f32.states, greedy, steps)
    r16 = engine_bf16.decode(bf.next_ids, [len(p) for p in prompts], bf.states, greedy, steps)
    assert (f32.next_ids == bf.next_ids).all()
    assert (r32.tokens == r16.tokens).all()


def test_weights_reach_max_on_cache_lines(tiny_weights):
    """MAX reads the weights it is given in place: every float32 array of the registry,
    the decode op's packed panels included, starts on a cache line and holds the same
    values as the tensor it came from (a panel row straddling two lines cost the op a
    sixth of its speed at batch 64)."""
    from srm_max.models.srm import packing, schema
    from srm_max.models.srm.engine import weights_registry
    from srm_max.runtime.device import CACHE_LINE, cache_aligned

    full = schema.graph_weights(TINY, tiny_weights)
    full |= packing.decode_step_weights(TINY, full)
    registry = weights_registry(TINY, tiny_weights, "float32", packed=True)
    assert set(registry) == set(full) and packing.matrix_names() <= set(registry)
    for name, arr in registry.items():
        assert arr.ctypes.data % CACHE_LINE == 0, name
        np.testing.assert_array_equal(arr, full[name], err_msg=name)

    raw = np.arange(40, dtype=np.float32)
    off = raw[1:].reshape(3, 13) if raw[1:].ctypes.data % CACHE_LINE else raw[2:].reshape(2, 19)
    moved = cache_aligned(off)
    assert moved.ctypes.data % CACHE_LINE == 0 and moved.flags.c_contiguous
    assert moved.dtype == off.dtype and moved.shape == off.shape
    np.testing.assert_array_equal(moved, off)
    assert cache_aligned(moved) is moved  # already on a line: no copy
