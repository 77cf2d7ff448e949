"""The user API: Generator.generate / stream, input validation, finish reasons."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY
from srm_max import Generator, GenerationError
from srm_max.generator import Completion


def word_tokenizer(size: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    return tok


class NoWork:
    """Stands in for the engine: any call means work started before validation."""

    config = TINY

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} used before the arguments were checked")


@pytest.fixture(scope="session")
def unchecked():
    return Generator.from_engine(NoWork(), tokenizer=word_tokenizer(TINY.vocab_size))


def rnd_prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, n).tolist()


BAD = [
    ("empty prompt", dict(prompts=[]), "empty"),
    ("empty prompt in batch", dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    ("empty text", dict(prompts=""), "empty"),
    ("token id >= vocab", dict(prompts=[1, 64]), "token id 64"),
    ("negative token id", dict(prompts=[[3], [-1]]), "token id -1"),
    ("prompt longer than n", dict(prompts=[1] * 97), "context length 96"),
    ("max_new_tokens < 0", dict(prompts=[1], max_new_tokens=-1), "max_new_tokens"),
    ("temperature < 0", dict(prompts=[1], temperature=-0.5), "temperature"),
    ("temperature nan", dict(prompts=[1], temperature=float("nan")), "temperature"),
    ("top_p = 0", dict(prompts=[1], top_p=0.0), "top_p"),
    ("top_p > 1", dict(prompts=[1], top_p=1.5), "top_p"),
    ("top_k < 0", dict(prompts=[1], top_k=-3), "top_k"),
    ("top_k float", dict(prompts=[1], top_k=2.5), "top_k"),
    ("seed negative", dict(prompts=[1], seed=-1), "seed"),
    ("per-prompt list too short", dict(prompts=[[1], [2]], temperature=[1.0]), "temperature"),
    ("stop id >= vocab", dict(prompts=[1], stop=[99]), "stop token id 99"),
]


@pytest.mark.parametrize("what,kwargs,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_before_any_work(unchecked, what, kwargs, message):
    with pytest.raises(GenerationError, match=message):
        unchecked.generate(**kwargs)
    with pytest.raises(GenerationError, match=message):
        unchecked.stream(**kwargs)  # raised at the call, not at the first next()


def test_unknown_device_and_dtype(tiny_weights):
    with pytest.raises(GenerationError, match="unknown device 'tpu'"):
        Generator(TINY, tiny_weights, device="tpu")
    with pytest.raises(GenerationError, match="unknown dtype 'float8'"):
        Generator(TINY, tiny_weights, dtype="float8")


def test_mismatched_tokenizer(tiny_weights, engine):
    big = word_tokenizer(TINY.vocab_size + 10)
    with pytest.raises(GenerationError, match="tokenizer has 74 tokens .* vocabulary is 64"):
        Generator(TINY, tiny_weights, tokenizer=big)
    with pytest.raises(GenerationError, match="mismatched tokenizer"):
        Generator.from_engine(engine, tokenizer=big)


def test_text_needs_a_tokenizer(generator):
    with pytest.raises(GenerationError, match="tokenizer"):
        generator.generate("w1 w2")


# ------------------------------------------------------------------ generation

def test_single_and_batched_results(generator):
    single = generator.generate(rnd_prompt(5), max_new_tokens=7)
    assert isinstance(single, Completion)
    assert len(single.ids) == 7 and single.finish_reason == "length" and single.text is None
    batch = generator.generate([rnd_prompt(5), rnd_prompt(30, 1)], max_new_tokens=7)
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0].ids == single.ids  # greedy, batch-independent


def test_matches_reference_greedy(generator, reference):
    import torch

    prompts = [rnd_prompt(n, n) for n in (3, 11, 29)]
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
    out = generator.generate(rnd_prompt(n - 6), max_new_tokens=50)
    assert len(out.ids) == 6 and out.finish_reason == "context"
    full = generator.generate(rnd_prompt(n), max_new_tokens=5)
    assert full.ids == [] and full.finish_reason == "context"
    exact = generator.generate(rnd_prompt(n - 6), max_new_tokens=6)
    assert len(exact.ids) == 6 and exact.finish_reason == "length"
    none = generator.generate(rnd_prompt(4), max_new_tokens=0)
    assert none.ids == [] and none.finish_reason == "length"
    # mixed in one batch
    outs = generator.generate([rnd_prompt(n - 2), rnd_prompt(3)], max_new_tokens=10)
    assert [len(o.ids) for o in outs] == [2, 10]
    assert [o.finish_reason for o in outs] == ["context", "length"]


def test_stop_token(generator):
    p = rnd_prompt(8, 7)
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
    p = rnd_prompt(9, 11)
    kw = dict(max_new_tokens=30, temperature=1.0, top_p=0.95, steps_per_call=4)
    alone = generator.generate(p, seed=[1234], **kw)
    others = [rnd_prompt(40, 1), p, rnd_prompt(2, 2), rnd_prompt(70, 3)]
    batch = generator.generate(others, seed=[7, 1234, 8, 9], temperature=[0.5, 1.0, 2.0, 1.0],
                               top_p=[1.0, 0.95, 0.5, 1.0], max_new_tokens=30, steps_per_call=7)
    assert batch[1].ids == alone.ids
    again = generator.generate(p, seed=[1234], **kw)
    assert again.ids == alone.ids
    different = generator.generate(p, seed=[1235], **kw)
    assert different.ids != alone.ids


def test_scalar_seed_is_per_prompt_offset(generator):
    p = rnd_prompt(9, 11)
    kw = dict(max_new_tokens=10, temperature=1.0)
    a = generator.generate([p, p], seed=50, **kw)
    assert a[0].ids == generator.generate(p, seed=50, **kw).ids
    assert a[1].ids == generator.generate(p, seed=51, **kw).ids


def test_stream_equals_generate(engine):
    gen = Generator.from_engine(engine, tokenizer=word_tokenizer(TINY.vocab_size))
    prompts = [rnd_prompt(5, 1), rnd_prompt(90, 2)]
    kw = dict(max_new_tokens=12, temperature=0.8, seed=[3, 4])
    outs = gen.generate(prompts, **kw)
    got = {0: [], 1: []}
    texts = {0: "", 1: ""}
    finished = {}
    steps = 0
    for ev in gen.stream(prompts, **kw):
        steps += 1
        for i, t in ev.tokens.items():
            got[i].append(t)
        for i, s in ev.texts.items():
            texts[i] += s
        finished |= ev.finished
    assert steps == 12
    assert [got[0], got[1]] == [o.ids for o in outs]
    assert [texts[0], texts[1]] == [o.text for o in outs]
    assert finished == {0: "length", 1: "context"}


def test_progress_callback(generator):
    calls = []
    generator.generate([rnd_prompt(3), rnd_prompt(4)], max_new_tokens=9, steps_per_call=4,
                       progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (18, 18) and calls[0][1] == 18
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


def test_from_pretrained(tmp_path, tiny_weights):
    from srm_max.checkpoint import save_checkpoint

    tok_path = tmp_path / "tokenizer.json"
    word_tokenizer(TINY.vocab_size).save(str(tok_path))
    ckpt = save_checkpoint(tmp_path / "ckpt", TINY, tiny_weights, tokenizer=tok_path)
    gen = Generator.from_pretrained(ckpt, device="cpu")
    out = gen.generate("w3 w4", max_new_tokens=4)
    assert len(out.ids) == 4 and isinstance(out.text, str)
    with pytest.raises(GenerationError, match="unknown device"):
        Generator.from_pretrained(ckpt, device="npu")


def test_keeps_working_after_a_rejected_request(generator):
    p = rnd_prompt(9, 5)
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

    requests = [(rnd_prompt(3 + 7 * i, i), dict(max_new_tokens=20, temperature=1.0, seed=[i], steps_per_call=1 + i % 3))
                for i in range(8)]
    alone = [generator.generate(p, **kw).ids for p, kw in requests]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda r: generator.generate(r[0], **r[1]).ids, requests))
        streamed = list(pool.map(
            lambda r: [t for ev in generator.stream(r[0], **r[1]) for t in ev.tokens.values()], requests))
    assert together == alone
    assert streamed == alone
