"""Scoring through the Python API: Generator.score, loglikelihood, loglikelihood_rolling and
the log-probabilities of generate / stream / sample_many, against the PyTorch reference's
log_softmax (float32, within 1e-4), on the TINY SRM and the test PHA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from srm_max import GenerationError, Generator
from srm_max.serve.scoring import rolling_windows
from tests.support.graphs import ENGINE_KINDS, graphs
from tests.support.pha import CONFIG as PHA_CONFIG, random_pha
from tests.support.prompts import random_prompts
from tests.support.reference_scores import lm_eval_loglikelihood, ref_log_softmax, ref_windows
from tests.support.stand_ins import NoWork
from tests.support.tiny import TINY, make_reference
from tests.support.tokenizers import byte_level_tokenizer, word_tokenizer_with_eot

pytestmark = graphs(TINY, ENGINE_KINDS)

TOL = 1e-4


@pytest.fixture(scope="module")
def ref():
    return make_reference()


@pytest.fixture(scope="module")
def gen(engine):
    return Generator.from_engine(engine, tokenizer=byte_level_tokenizer())


# ------------------------------------------------------------------ score
def test_score_equals_the_reference_log_softmax_with_top_n(generator, ref):
    lengths = [1, 2, 31, 33, 95, 96]
    texts = random_prompts(lengths, TINY.vocab_size, seed=1)
    results = generator.score(texts, top_n=5)
    for ids, r in zip(texts, results):
        assert r.ids == ids and r.logprobs[0] is None and r.top_logprobs[0] is None
        assert r.tokens is None and r.text_offset is None  # no tokenizer
        if len(ids) == 1:
            assert r.logprobs == [None]
            continue
        lp = ref_log_softmax(ref, ids[:-1])
        np.testing.assert_allclose(r.logprobs[1:], lp[np.arange(len(ids) - 1), ids[1:]], atol=TOL)
        want = np.argsort(-lp, axis=-1, kind="stable")[:, :5]
        assert [row for row in r.top_ids[1:]] == want.tolist()
        got = np.array([list(d.values()) for d in r.top_logprobs[1:]])
        np.testing.assert_allclose(got, np.take_along_axis(lp, want, -1), atol=TOL)
        assert list(r.top_logprobs[-1].keys()) == r.top_ids[-1]  # keyed by id without a tokenizer


def test_score_batch_of_64_texts_of_every_length(generator, ref):
    rng = np.random.default_rng(2)
    texts = random_prompts(rng.integers(2, TINY.context_length + 1, 64).tolist(), TINY.vocab_size, seed=2)
    for ids, r in zip(texts, generator.score(texts)):
        lp = ref_log_softmax(ref, ids[:-1])
        np.testing.assert_allclose(r.logprobs[1:], lp[np.arange(len(ids) - 1), ids[1:]], atol=TOL)
        assert r.top_logprobs is None


def test_rolling_windows_are_lm_evals():
    utils = pytest.importorskip("lm_eval.utils")
    for n in range(0, 30):
        for max_length in (1, 2, 5, 8):
            ids = list(range(100, 100 + n))
            theirs = [tuple(map(list, utils.make_disjoint_window(w)))
                      for w in utils.get_rolling_token_windows(ids, 7, max_length, 1)]
            assert rolling_windows(ids, 7, max_length) == theirs


@pytest.mark.parametrize("max_length", [None, 40])
def test_a_text_longer_than_the_context_is_scored_in_rolling_windows(generator, ref, max_length):
    ids = random_prompts([250], TINY.vocab_size, seed=3)[0]
    r = generator.score(ids, top_n=2, max_length=max_length)
    windows = rolling_windows(ids[1:], ids[0], max_length or TINY.context_length)
    assert len(windows) > 2
    np.testing.assert_allclose(r.logprobs[1:], ref_windows(ref, windows), atol=TOL)
    assert len(r.top_ids) == len(ids)


def test_score_of_text_gives_token_texts_and_offsets(gen, ref):
    text = "ab é€😀中 üxé"
    r = gen.score(text, top_n=3)
    assert r.ids == gen.encode(text)
    assert "".join(r.tokens) == text and r.text_offset[0] == 0
    assert r.text_offset == np.cumsum([0] + [len(t) for t in r.tokens[:-1]]).tolist()
    assert "" in r.tokens  # the byte-level tokenizer splits characters: the completing token carries them
    assert all(isinstance(k, str) for k in r.top_logprobs[1])
    lp = ref_log_softmax(ref, r.ids[:-1])
    np.testing.assert_allclose(r.logprobs[1:], lp[np.arange(len(r.ids) - 1), r.ids[1:]], atol=TOL)
    assert r.total == pytest.approx(sum(r.logprobs[1:]))


def test_token_pieces_add_up_to_the_text_in_one_call_or_two():
    from srm_max.serve.logprobs import token_pieces

    tok = byte_level_tokenizer()
    decode = tok.decode
    rng = np.random.default_rng(14)
    for _ in range(200):
        ids = rng.integers(0, TINY.vocab_size, rng.integers(1, 25)).tolist()  # valid and broken UTF-8 alike
        assert "".join(token_pieces(decode, ids)) == decode(ids)
        k = int(rng.integers(0, len(ids)))  # a stream: the first k, then the rest (its last call)
        head = token_pieces(decode, ids[:k], final=False)
        assert "".join(head + token_pieces(decode, ids[k:], before=ids[:k])) == decode(ids)


# ------------------------------------------------------------------ loglikelihood
class CountingEngine:
    """The engine, counting the prompts its prefill reads."""

    def __init__(self, engine):
        self._engine, self.prefilled = engine, []

    def prefill(self, prompts, *args, **kwargs):
        self.prefilled.extend(tuple(p) for p in prompts)
        return self._engine.prefill(prompts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_loglikelihood_equals_lm_evals_rule_and_reads_each_context_once(engine, ref):
    counting = CountingEngine(engine)
    gen = Generator.from_engine(counting, prefix_cache_mb=0)  # the cache's reuse: test_scoring_prefix_cache.py
    contexts = random_prompts([20, 1, 90], TINY.vocab_size, seed=4)
    conts = random_prompts([1, 5, 12], TINY.vocab_size, seed=5)
    greedy = gen.generate(contexts[0], max_new_tokens=6).ids  # a continuation the model would write
    requests = [(c, k) for c in contexts for k in conts] + [(contexts[0], greedy)]
    counting.prefilled.clear()
    results = gen.loglikelihood(requests)
    for (ctx, cont), (total, is_greedy) in zip(requests, results):
        want_total, want_greedy = lm_eval_loglikelihood(ref, ctx, cont)
        assert total == pytest.approx(want_total, abs=TOL * len(cont))
        assert is_greedy == want_greedy
    assert results[-1][1] is True
    # one prefill row per distinct context as the model reads it (cut on the left so that
    # context + continuation fit), all but its last token; a 1-token context needs none
    n = TINY.context_length
    read = {tuple((c + k)[-(n + 1):][:-len(k)]) for c, k in requests}
    assert len(read) == 4  # the 90-token context is cut before the 12-token continuation only
    assert sorted(counting.prefilled) == sorted(r[:-1] for r in read if len(r) > 1)
    # token ids as integer arrays, as score takes them, give the same answers
    as_arrays = [(np.array(c), np.array(k, np.int32)) for c, k in requests[:2]]
    assert gen.loglikelihood(as_arrays) == results[:2]


def test_loglikelihood_of_text_pairs_encodes_as_lm_eval(gen, ref):
    model = pytest.importorskip("lm_eval.api.model")

    class Tok:  # the parts of lm-eval's TemplateLM that _encode_pair uses
        backend = "causal"

        def tok_encode(self, s, **_):
            return gen.encode(s)

    from srm_max.serve.logprobs import encode_pair

    for ctx, cont in [("ab é ", "€😀"), ("ab", " é"), ("x  ", "ü"), ("中", "a")]:
        assert encode_pair(gen, ctx, cont) == model.TemplateLM._encode_pair(Tok(), ctx, cont)
        c, k = encode_pair(gen, ctx, cont)
        (total, greedy), = gen.loglikelihood([(ctx, cont)])
        assert (total, greedy) == pytest.approx(lm_eval_loglikelihood(ref, c, k), abs=TOL * len(k))


def test_loglikelihood_rolling_reads_the_end_of_text_token_first(engine, ref):
    gen = Generator.from_engine(engine, tokenizer=word_tokenizer_with_eot())
    ids = random_prompts([230], TINY.vocab_size - 1, seed=6)[0]
    ids = [t + 1 for t in ids]  # words only
    text = " ".join(f"w{t}" for t in ids)
    total = gen.loglikelihood_rolling(text)
    assert gen.end_of_text_id == 0
    assert total == pytest.approx(ref_windows(ref, rolling_windows(ids, 0, TINY.context_length)).sum(), abs=1e-3)
    assert gen.loglikelihood_rolling([text], max_length=50)[0] == pytest.approx(
        ref_windows(ref, rolling_windows(ids, 0, 50)).sum(), abs=1e-3)


# ------------------------------------------------------------------ generate / stream / sample_many
def test_greedy_generate_logprobs_equal_scoring_the_text_and_the_reference(generator, ref):
    prompts = random_prompts([5, 1, 60], TINY.vocab_size, seed=7)
    outs = generator.generate(prompts, max_new_tokens=30, logprobs=5)
    for p, c in zip(prompts, outs):
        lp = c.logprobs
        assert lp.ids == c.ids and len(lp.logprobs) == len(c.ids) and None not in lp.logprobs
        assert [row[0] for row in lp.top_ids] == c.ids  # greedy: each token is the likeliest
        scored = generator.score(p + c.ids)
        np.testing.assert_allclose(lp.logprobs, scored.logprobs[len(p):], atol=1e-5)
        want = ref_log_softmax(ref, (p + c.ids)[:-1])[len(p) - 1:]
        np.testing.assert_allclose(lp.logprobs, want[np.arange(len(c.ids)), c.ids], atol=TOL)


def test_sampled_tokens_get_their_raw_log_probabilities(generator, ref):
    prompts = random_prompts([3, 40], TINY.vocab_size, seed=8)
    outs = generator.generate(prompts, max_new_tokens=40, temperature=0.7, top_k=5, seed=3, logprobs=5)
    for p, c in zip(prompts, outs):
        want = ref_log_softmax(ref, (p + c.ids)[:-1])[len(p) - 1:]
        np.testing.assert_allclose(c.logprobs.logprobs, want[np.arange(len(c.ids)), c.ids], atol=TOL)
        assert all(t in top for t, top in zip(c.ids, c.logprobs.top_ids))  # top-k 5 drew among the raw top 5


def test_stream_and_sample_many_carry_the_same_logprobs_as_generate(generator):
    prompts = random_prompts([4, 9], TINY.vocab_size, seed=9)
    options = dict(max_new_tokens=20, temperature=0.9, top_p=0.9, seed=11)
    outs = generator.generate(prompts, logprobs=2, **options)
    streamed = {0: [], 1: []}
    tops = {0: [], 1: []}
    for event in generator.stream(prompts, steps_per_call=3, logprobs=2, **options):
        assert set(event.logprobs) == set(event.tokens)
        for b, v in event.logprobs.items():
            streamed[b].append(v)
            tops[b].append(event.top_logprobs[b])
    for b, c in enumerate(outs):
        np.testing.assert_allclose(streamed[b], c.logprobs.logprobs, atol=1e-5)
        assert [list(t) for t in tops[b]] == c.logprobs.top_ids
    run = generator.sample_many(prompts, n=3, max_new_tokens=15, temperature=1.0, seed=5, max_batch=2, logprobs=1)
    samples = list(run)
    assert len(samples) == 6
    for s in samples:
        alone = generator.generate(prompts[s.prompt_index], max_new_tokens=15, temperature=1.0, seed=s.seed,
                                   logprobs=1)
        assert s.ids == alone.ids
        np.testing.assert_allclose(s.logprobs.logprobs, alone.logprobs.logprobs, atol=1e-5)


@pytest.mark.parametrize("call, name", [
    (lambda g: g.generate([1, 2], logprobs=21), "logprobs"),
    (lambda g: g.generate([1, 2], logprobs=-1), "logprobs"),
    (lambda g: g.stream([1, 2], logprobs=1.5), "logprobs"),
    (lambda g: g.sample_many([1, 2], n=2, logprobs=True), "logprobs"),
    (lambda g: g.score([1, 2], top_n=21), "top_n"),
    (lambda g: g.score([1, 2], max_length=0), "max_length"),
    (lambda g: g.score([]), "empty"),
    (lambda g: g.score([1, 64]), "token id 64"),
    (lambda g: g.loglikelihood([([1], [2]), ([1],)]), "request 1"),
    (lambda g: g.loglikelihood([([], [2])]), "request 0"),
    (lambda g: g.loglikelihood([([1], [2] * 97)]), "continuation"),
    (lambda g: g.loglikelihood([("", "w1")]), "<|endoftext|>"),
])
def test_bad_arguments_are_refused_before_any_work(call, name):
    unchecked = Generator.from_engine(NoWork(), tokenizer=byte_level_tokenizer())
    with pytest.raises(GenerationError, match=name):
        result = call(unchecked)
        next(iter(result))


# ------------------------------------------------------------------ PHA (scores from the start only)
@graphs(PHA_CONFIG, ("prefill", "decode_steps", "sample", "regroup"))
def test_pha_scores_and_rescores_continuations_from_the_start():
    from srm_max.models.pha.engine import PHAEngine

    model = random_pha()
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    gen = Generator.from_engine(PHAEngine(PHA_CONFIG, weights, dtype="float32", device="cpu"))
    texts = random_prompts([2, 70, 160], PHA_CONFIG.vocab_size, seed=10)
    for ids, r in zip(texts, gen.score(texts, top_n=2)):
        lp = ref_log_softmax(model, ids[:-1])
        np.testing.assert_allclose(r.logprobs[1:], lp[np.arange(len(ids) - 1), ids[1:]], atol=TOL)
    requests = [(texts[1][:30], texts[1][30:40]), (texts[1][:30], texts[0]), ([5], [6, 7])]
    for (ctx, cont), (total, greedy) in zip(requests, gen.loglikelihood(requests)):
        want = lm_eval_loglikelihood(model, ctx, cont, PHA_CONFIG.context_length)
        assert (total, greedy) == pytest.approx(want, abs=TOL * len(cont))
    c = gen.generate(texts[0], max_new_tokens=10, logprobs=1)
    want = ref_log_softmax(model, (texts[0] + c.ids)[:-1])[len(texts[0]) - 1:]
    np.testing.assert_allclose(c.logprobs.logprobs, want[np.arange(len(c.ids)), c.ids], atol=TOL)


# ------------------------------------------------------------------ GRPO
def test_grpo_old_and_reference_logprobs_from_the_engine_equal_pytorchs(engine):
    import copy

    from srm_max.rl.grpo import engine_token_logprobs, grpo_step, pad_sequences, token_logprobs

    prompts = random_prompts([3, 10, 1], TINY.vocab_size, seed=12)
    completions = random_prompts([5, 2, 7], TINY.vocab_size, seed=13)
    ids, mask = pad_sequences(prompts, completions)
    model = make_reference()
    want = token_logprobs(model, ids, mask).detach()
    got = engine_token_logprobs(engine, prompts, completions, mask.shape) * mask
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=TOL)
    infos = []
    for engines in (None, (engine, engine)):  # the engine holds the reference's weights: policy = reference
        policy = make_reference()
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
        infos.append(grpo_step(policy, copy.deepcopy(policy), optimizer, prompts, completions, np.array([1., -1, 0]),
                               engines=engines))
    assert infos[1]["loss"] == pytest.approx(infos[0]["loss"], abs=1e-4)
    assert infos[1]["kl"] == pytest.approx(infos[0]["kl"], abs=1e-6)
