"""``generate`` / ``stream`` / ``sample_many(..., logprobs=n)``: the log-probabilities come
from the decode itself (the first token's from the prefill graph's own draw, or the sample
graph's for forked samples), with no score-graph pass, and equal scoring the text and the
reference. TINY SRM, float32: the default CPU engine (the whole-step decode op) and, marked
``plain``, the engine of plain MAX ops (the decode graph's loop: the GPU's path)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.graphs import ENGINE_KINDS, graphs
from tests.support.prompts import random_prompts
from tests.support.reference_scores import ref_log_softmax
from tests.support.tiny import TINY, make_reference

pytestmark = graphs(TINY, ENGINE_KINDS)
# the plain-op engine's graphs, as tests/models/srm/test_engine.py declares them (no new graph)
PLAIN_OPS = graphs(TINY, ("prefill", "decode", "sample", "regroup"), kernels=False)

TOL = 1e-4  # float32 engine against the float32 reference's log_softmax and the scored prefill
# the same tokens in other batches or calls: a few float32 ulps (the op is exact there, MAX's
# matmuls in the plain graphs round differently by batch size)
SAME_TOKENS_ATOL = 1e-5
N_CTX = TINY.context_length


@pytest.fixture(scope="module")
def ref():
    return make_reference()


@pytest.fixture(scope="module")
def plain_generator(tiny_weights):
    from srm_max.models.srm.engine import Engine
    from srm_max.serve.generator import Generator

    engine = Engine(TINY, tiny_weights, kernels=False)
    assert not engine.steps_in_one_op
    return Generator.from_engine(engine)


@pytest.fixture(params=["op", pytest.param("plain", marks=PLAIN_OPS)])
def no_score_pass(request, monkeypatch):
    """A generator (the default engine's, or the plain-op engine's), its engine's scoring
    refused: a second pass would fail."""
    generator = request.getfixturevalue("generator" if request.param == "op" else "plain_generator")

    def refuse(*args, **kwargs):
        raise AssertionError("the sampled tokens were scored again")

    monkeypatch.setattr(generator.engine, "score", refuse)
    return generator


# prompts ending mid-call: at the context (N_CTX - 6 leaves 6 new tokens), and by a stop token
PROMPT_LENGTHS = [N_CTX - 6, 3, 17]


def check_completion(generator, ref, prompt, c, top_n):
    lp = c.logprobs
    assert lp.ids == c.ids and len(lp.logprobs) == len(c.ids) and None not in lp.logprobs
    want = ref_log_softmax(ref, (prompt + c.ids)[:-1])[len(prompt) - 1:]
    np.testing.assert_allclose(lp.logprobs, want[np.arange(len(c.ids)), c.ids], rtol=0, atol=TOL)
    assert all(len(row) == top_n for row in lp.top_ids)
    for row, ids in zip(want, lp.top_ids):
        np.testing.assert_allclose(row[ids], sorted(row, reverse=True)[:top_n], rtol=0, atol=TOL)
    return lp


@pytest.mark.parametrize("steps_per_call", [1, 4])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_k=8, seed=5)])
def test_generate_logprobs_come_from_the_decode_and_equal_scoring_the_text(no_score_pass, ref, monkeypatch,
                                                                           steps_per_call, sampling):
    gen = no_score_pass
    prompts = random_prompts(PROMPT_LENGTHS, TINY.vocab_size, seed=21)
    plain = gen.generate(prompts, max_new_tokens=9, steps_per_call=steps_per_call, **sampling)
    assert plain[0].finish_reason == "context" and len(plain[0].ids) == 6
    stop = next(t for t in plain[1].ids[2:] if t not in plain[1].ids[:2])  # sample 1 stops after 2 or more
    outs = gen.generate(prompts, max_new_tokens=9, steps_per_call=steps_per_call, logprobs=3, stop=[stop],
                        **sampling)
    assert outs[1].finish_reason == "stop" and 2 <= len(outs[1].ids) < 9
    for p, c in zip(plain, outs):
        assert c.ids == p.ids[:len(c.ids)] and c.finish_reason == ("stop" if stop in p.ids else p.finish_reason)
    lps = [check_completion(gen, ref, p, c, 3) for p, c in zip(prompts, outs)]
    if not sampling:
        assert all([row[0] for row in lp.top_ids] == c.ids for lp, c in zip(lps, outs))
    alone = gen.generate(prompts[2], max_new_tokens=9, steps_per_call=steps_per_call, logprobs=3, stop=[stop],
                         **(sampling | {"seed": outs[2].seed} if sampling else {}))
    assert alone.ids == outs[2].ids
    np.testing.assert_allclose(alone.logprobs.logprobs, lps[2].logprobs, rtol=0, atol=SAME_TOKENS_ATOL)  # batch 1
    monkeypatch.undo()  # scoring again: the same numbers as scoring the texts
    for p, c in zip(prompts, outs):
        scored = gen.score(p + c.ids, top_n=3)
        np.testing.assert_allclose(c.logprobs.logprobs, scored.logprobs[len(p):], rtol=0, atol=TOL)
        assert c.logprobs.top_ids == scored.top_ids[len(p):]


def test_stream_and_sample_many_take_the_decodes_logprobs(no_score_pass):
    gen = no_score_pass
    prompts = random_prompts([4, N_CTX - 3], TINY.vocab_size, seed=22)
    options = dict(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=11)
    outs = gen.generate(prompts, logprobs=2, **options)
    streamed, tops = {0: [], 1: []}, {0: [], 1: []}
    for event in gen.stream(prompts, steps_per_call=5, logprobs=2, **options):
        assert set(event.logprobs) == set(event.tokens)
        for b, v in event.logprobs.items():
            streamed[b].append(v)
            tops[b].append(list(event.top_logprobs[b]))
    for b, c in enumerate(outs):
        np.testing.assert_allclose(streamed[b], c.logprobs.logprobs, rtol=0, atol=SAME_TOKENS_ATOL)
        assert tops[b] == c.logprobs.top_ids
    samples = list(gen.sample_many(prompts, n=3, max_new_tokens=8, temperature=1.0, seed=5, max_batch=2,
                                   logprobs=1, steps_per_call=3))
    assert len(samples) == 6
    for s in samples:
        alone = gen.generate(prompts[s.prompt_index], max_new_tokens=8, temperature=1.0, seed=s.seed, logprobs=1)
        assert s.ids == alone.ids
        np.testing.assert_allclose(s.logprobs.logprobs, alone.logprobs.logprobs, rtol=0, atol=SAME_TOKENS_ATOL)


def test_decode_computes_log_probabilities_only_when_asked(generator, monkeypatch):
    """Without ``logprobs`` every decode call asks the op for none (its cost when not asked
    is nil); with it, for the most alternatives a sample asks for."""
    asked = []
    decode = generator.engine.decode

    def spy(*args, **kwargs):
        asked.append(kwargs.get("logprobs"))
        return decode(*args, **kwargs)

    monkeypatch.setattr(generator.engine, "decode", spy)
    plain = generator.generate([[1, 2, 3]], max_new_tokens=6, steps_per_call=2)
    assert asked and set(asked) == {None}
    asked.clear()
    scored = generator.generate([[1, 2, 3]], max_new_tokens=6, steps_per_call=2, logprobs=4)
    assert asked and set(asked) == {4}
    assert plain[0].ids == scored[0].ids and plain[0].logprobs is None


def test_samples_asking_for_different_top_n_share_a_batch(generator, ref):
    """One pool, samples asking for 0, 1, 4 alternatives and none, joining at different calls
    (2 slots): the decode asks for the widest its batch needs, each keeps its own."""
    from srm_max.serve.scheduler import SlotPool
    from srm_max.serve.sequence import Sequence
    from srm_max.serve.scoring import decoded_scores

    prompts = random_prompts([3, 8, 5, 12], TINY.vocab_size, seed=23)
    wants = [4, None, 1, 0]
    seqs = [Sequence(p, 0.9, 0, 1.0, 40 + i, 6 + i, logprobs=n) for i, (p, n) in enumerate(zip(prompts, wants))]
    pool = SlotPool(generator.engine, generator.decode, 2, steps_per_call=3)
    pool.submit(seqs)
    for _ in pool.run():
        pass
    for s, n in zip(seqs, wants):
        if n is None:
            assert s.token_scores == []
            continue
        sc = decoded_scores(s, n)
        assert sc.top_ids.shape == (len(s.tokens), n)
        want = ref_log_softmax(ref, (s.prompt + s.tokens)[:-1])[len(s.prompt) - 1:]
        np.testing.assert_allclose(sc.logprobs, want[np.arange(len(s.tokens)), s.tokens], rtol=0, atol=TOL)
        for row, ids in zip(want, sc.top_ids):
            np.testing.assert_allclose(row[ids], sorted(row, reverse=True)[:n], rtol=0, atol=TOL)


def test_first_tokens_log_probabilities_come_from_the_prefills_draw(no_score_pass, ref, monkeypatch):
    """Prompts of their own: each prefill call draws its first tokens and scores them in
    one sample-graph call, and nothing draws them again; the tokens are those drawn without
    log-probabilities, the first one's log-probability the reference's. A prompt's samples
    forked from one prefill draw through the sample graph too, with the same numbers."""
    gen = no_score_pass
    prompts = random_prompts([2, 30, 9], TINY.vocab_size, seed=24)
    options = dict(max_new_tokens=5, temperature=0.9, top_p=0.9, seed=13, steps_per_call=2)
    plain = gen.generate(prompts, **options)
    calls = {"scored prefill": 0, "prefill": 0, "draw": 0, "draw_scored": 0}

    def counted(name):
        method = getattr(gen.engine, name)

        def call(*args, **kwargs):
            calls["scored prefill" if kwargs.get("logprobs") is not None else name] += 1
            return method(*args, **kwargs)
        monkeypatch.setattr(gen.engine, name, call)

    for name in ("prefill", "draw", "draw_scored"):
        counted(name)
    outs = gen.generate(prompts, logprobs=4, **options)
    # one draw per prefill call (the prefix cache's pieces prefill unscored), none besides
    assert calls["scored prefill"] == calls["draw_scored"] == 1 and calls["draw"] == calls["prefill"], calls
    for p, a, c in zip(prompts, plain, outs):
        assert c.ids == a.ids
        check_completion(gen, ref, p, c, 4)
    forked = list(gen.sample_many(prompts[1:2], n=2, logprobs=4, **(options | {"seed": 3})))
    for s in forked:
        alone = gen.generate(prompts[1], logprobs=4, **(options | {"seed": s.seed}))
        assert s.ids == alone.ids
        np.testing.assert_allclose(s.logprobs.logprobs, alone.logprobs.logprobs, rtol=0, atol=TOL)
