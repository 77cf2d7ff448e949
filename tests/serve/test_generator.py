"""The user API: Generator.generate: single and batched results, the reference's greedy
tokens, the context limit, stop tokens and strings, seeds, progress, from_pretrained, threads."""

from __future__ import annotations

import pytest

from srm_max import GenerationError, Generator
from srm_max.serve.generator import Completion
from tests.support.graphs import graphs
from tests.support.tiny import TINY
from tests.support.tokenizers import word_tokenizer

pytestmark = graphs(TINY)

from tests.support.prompts import random_prompt


# ------------------------------------------------------------------ generation

def test_single_and_batched_results(generator):
    single = generator.generate(random_prompt(5), max_new_tokens=7)
    assert isinstance(single, Completion)
    assert len(single.ids) == 7 and single.finish_reason == "length" and single.text is None
    batch = generator.generate([random_prompt(5), random_prompt(30, 1)], max_new_tokens=7)
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0].ids == single.ids  # greedy, batch-independent


def test_matches_reference_greedy(generator, reference):
    import torch

    prompts = [random_prompt(n, n) for n in (3, 11, 29)]
    outs = generator.generate(prompts, max_new_tokens=40, steps_per_call=8)
    for p, out in zip(prompts, outs):
        ref = reference.generate_greedy(torch.tensor(p), 40).tolist()
        assert out.ids == ref


def test_text_prompts_with_tokenizer(engine):
    gen = Generator.from_engine(engine, tokenizer=word_tokenizer(TINY.vocab_size))
    out = gen.generate("w1 w2 w3", max_new_tokens=5)
    ids = gen.generate([1, 2, 3], max_new_tokens=5)
    assert out.ids == ids.ids
    assert out.text == gen.tokenizer.decode(out.ids)
    assert out.prompt_ids == [1, 2, 3]


def test_context_limit(generator):
    n = TINY.context_length
    out = generator.generate(random_prompt(n - 6), max_new_tokens=50)
    assert len(out.ids) == 6 and out.finish_reason == "context"
    full = generator.generate(random_prompt(n), max_new_tokens=5)
    assert full.ids == [] and full.finish_reason == "context"
    exact = generator.generate(random_prompt(n - 6), max_new_tokens=6)
    assert len(exact.ids) == 6 and exact.finish_reason == "length"
    none = generator.generate(random_prompt(4), max_new_tokens=0)
    assert none.ids == [] and none.finish_reason == "length"
    # mixed in one batch
    outs = generator.generate([random_prompt(n - 2), random_prompt(3)], max_new_tokens=10)
    assert [len(o.ids) for o in outs] == [2, 10]
    assert [o.finish_reason for o in outs] == ["context", "length"]


def test_stop_token(generator):
    p = random_prompt(8, 7)
    free = generator.generate(p, max_new_tokens=20).ids
    k = next((i for i in range(1, 20) if free[i] not in free[:i]), None)  # a first occurrence
    if k is None:
        pytest.skip("greedy output repeats one token")
    out = generator.generate(p, max_new_tokens=20, stop=[free[k]])
    assert out.ids == free[:k] and out.finish_reason == "stop"


def test_stop_string(engine):
    gen = Generator.from_engine(engine, tokenizer=word_tokenizer(TINY.vocab_size))
    free = gen.generate([5, 6, 7], max_new_tokens=12)
    word = free.text.split()[3]
    out = gen.generate([5, 6, 7], max_new_tokens=12, stop=word)
    assert out.finish_reason == "stop"
    assert word not in out.text and free.text.startswith(out.text)


def test_same_seed_same_tokens_whatever_the_batch(generator):
    p = random_prompt(9, 11)
    kw = dict(max_new_tokens=30, temperature=1.0, top_p=0.95, steps_per_call=4)
    alone = generator.generate(p, seed=[1234], **kw)
    others = [random_prompt(40, 1), p, random_prompt(2, 2), random_prompt(70, 3)]
    batch = generator.generate(others, seed=[7, 1234, 8, 9], temperature=[0.5, 1.0, 2.0, 1.0],
                               top_p=[1.0, 0.95, 0.5, 1.0], max_new_tokens=30, steps_per_call=7)
    assert batch[1].ids == alone.ids
    again = generator.generate(p, seed=[1234], **kw)
    assert again.ids == alone.ids
    different = generator.generate(p, seed=[1235], **kw)
    assert different.ids != alone.ids


def test_scalar_seed_is_per_prompt_offset(generator):
    p = random_prompt(9, 11)
    kw = dict(max_new_tokens=10, temperature=1.0)
    a = generator.generate([p, p], seed=50, **kw)
    assert a[0].ids == generator.generate(p, seed=50, **kw).ids
    assert a[1].ids == generator.generate(p, seed=51, **kw).ids


def test_seed_none_draws_a_fresh_seed_and_reports_it(generator):
    p, q = random_prompt(9, 11), random_prompt(4, 12)
    kw = dict(max_new_tokens=16, temperature=1.0)
    a, b = generator.generate(p, **kw), generator.generate(p, **kw)
    assert isinstance(a.seed, int) and 0 <= a.seed < 2**64
    assert a.seed != b.seed
    assert generator.generate(p, seed=a.seed, **kw).ids == a.ids
    assert generator.generate(p, seed=b.seed, **kw).ids == b.ids
    outs = generator.generate([p, q], **kw)
    assert outs[1].seed == outs[0].seed + 1  # a scalar seed s gives prompt i the seed s + i
    assert [o.ids for o in generator.generate([p, q], seed=[o.seed for o in outs], **kw)] == [o.ids for o in outs]
    assert [o.ids for o in generator.generate([p, q], seed=outs[0].seed, **kw)] == [o.ids for o in outs]
    assert generator.generate(q, seed=outs[1].seed, **kw).ids == outs[1].ids
    assert generator.generate(p, seed=[2**64 - 1], **kw).seed == 2**64 - 1


def test_sample_many_seed_none_draws_a_fresh_seed_and_reports_it(generator):
    prompts = [random_prompt(5, 1), random_prompt(7, 2)]
    kw = dict(max_new_tokens=6, temperature=1.0)

    def key(s):
        return s.prompt_index, s.sample_index

    run = generator.sample_many(prompts, 3, **kw)
    assert isinstance(run.seed, int) and 0 <= run.seed < 2**64
    samples = sorted(run, key=key)
    other = generator.sample_many(prompts, 3, **kw)
    other.close()
    assert other.seed != run.seed
    replay = sorted(generator.sample_many(prompts, 3, seed=run.seed, **kw), key=key)
    assert [(s.ids, s.seed) for s in replay] == [(s.ids, s.seed) for s in samples]
    s = samples[-1]
    assert generator.generate(prompts[s.prompt_index], seed=s.seed, **kw).ids == s.ids


def test_top_k_minus_one_is_off(generator):
    p = random_prompt(9, 3)
    for top_p in (1.0, 0.9):
        kw = dict(max_new_tokens=12, temperature=1.0, top_p=top_p, seed=21)
        assert generator.generate(p, top_k=-1, **kw).ids == generator.generate(p, top_k=0, **kw).ids
    kw = dict(max_new_tokens=6, temperature=1.0, seed=4)
    assert ([s.ids for s in generator.sample_many([p], 2, top_k=-1, **kw)]
            == [s.ids for s in generator.sample_many([p], 2, top_k=0, **kw)])


@pytest.mark.parametrize("top_k", [TINY.vocab_size, TINY.vocab_size + 1, 2**31, 2**63 - 1])
def test_a_top_k_of_the_vocabulary_or_more_keeps_every_token(generator, top_k):
    """k >= V filters nothing: the same tokens as k = 0, the first (drawn by the prefill's
    sample graph) and the rest (the decode op), alone and with top-p, up to the largest k the
    API takes."""
    p = random_prompt(9, 5)
    for top_p in (1.0, 0.9):
        kw = dict(max_new_tokens=6, temperature=1.0, top_p=top_p)
        for seed in (3, 8):
            assert generator.generate(p, top_k=top_k, seed=seed, **kw).ids == \
                generator.generate(p, top_k=0, seed=seed, **kw).ids


def test_progress_callback(generator):
    calls = []
    generator.generate([random_prompt(3), random_prompt(4)], max_new_tokens=9, steps_per_call=4,
                       progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (18, 18) and calls[0][1] == 18
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


def test_from_pretrained(tmp_path, tiny_weights):
    from srm_max.checkpoints.format import save_checkpoint

    tok_path = tmp_path / "tokenizer.json"
    word_tokenizer(TINY.vocab_size).save(str(tok_path))
    ckpt = save_checkpoint(tmp_path / "ckpt", TINY, tiny_weights, tokenizer=tok_path)
    gen = Generator.from_pretrained(ckpt, device="cpu")
    out = gen.generate("w3 w4", max_new_tokens=4)
    assert len(out.ids) == 4 and isinstance(out.text, str)
    with pytest.raises(GenerationError, match="unknown device"):
        Generator.from_pretrained(ckpt, device="npu")


def test_keeps_working_after_a_rejected_request(generator):
    p = random_prompt(9, 5)
    kw = dict(max_new_tokens=12, temperature=1.0, seed=[77])
    before = generator.generate(p, **kw)
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(prompts=[1] * 97), dict(stop=[99])):
        with pytest.raises(GenerationError):
            generator.generate(**({"prompts": p} | kw | bad))
        with pytest.raises(GenerationError):
            generator.stream(**({"prompts": p} | kw | bad))
    stream = generator.stream(p, **kw)
    next(stream)  # a request abandoned midway holds nothing either
    del stream
    assert generator.generate(p, **kw).ids == before.ids


def test_threads_share_a_generator_and_each_gets_its_own_result(generator):
    """Requests from several threads interleave call by call (the engine's lock)
    and each gets exactly what it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    requests = [(random_prompt(3 + 7 * i, i), dict(max_new_tokens=20, temperature=1.0, seed=[i], steps_per_call=1 + i % 3))
                for i in range(8)]
    alone = [generator.generate(p, **kw).ids for p, kw in requests]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda r: generator.generate(r[0], **r[1]).ids, requests))
        streamed = list(pool.map(
            lambda r: [t for ev in generator.stream(r[0], **r[1]) for t in ev.tokens.values()], requests))
    assert together == alone
    assert streamed == alone
