"""The user API: Generator.generate / stream, input validation, finish reasons."""

from __future__ import annotations

import argparse
import inspect
import re

import numpy as np
import pytest

from srm_max import GenerationError, Generator
from srm_max.serve.generator import Completion
from tests.support.graphs import graphs
from tests.support.stand_ins import NoWork
from tests.support.tiny import TINY
from tests.support.tokenizers import byte_level_tokenizer, word_tokenizer

pytestmark = graphs(TINY)


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
    ("top_k < -1", dict(prompts=[1], top_k=-2), "top_k"),
    ("top_k float", dict(prompts=[1], top_k=2.5), "top_k"),
    ("seed negative", dict(prompts=[1], seed=-1), "seed must be an integer in"),
    ("seed 2**64", dict(prompts=[1], seed=2**64), "seed must be an integer in"),
    ("seed float", dict(prompts=[1], seed=1.5), "seed must be an integer in"),
    ("seed text", dict(prompts=[1], seed="7"), "seed must be an integer in"),
    ("seed in a list negative", dict(prompts=[[1], [2]], seed=[1, -1]), r"seed\[1\] must be an integer"),
    ("per-prompt list too short", dict(prompts=[[1], [2]], temperature=[1.0]),
     r"temperature: expected one value or a list of 2 \(one per prompt\), got a list of 1"),
    ("stop id >= vocab", dict(prompts=[1], stop=[99]), "stop token id 99"),
]


@pytest.mark.parametrize("what,kwargs,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_before_any_work(unchecked, what, kwargs, message):
    with pytest.raises(GenerationError, match=message):
        unchecked.generate(**kwargs)
    with pytest.raises(GenerationError, match=message):
        unchecked.stream(**kwargs)  # raised at the call, not at the first next()


SAMPLE_MANY_BAD = [
    ("seed negative", dict(seed=-1), "seed must be an integer in"),
    ("seed 2**64", dict(seed=2**64), "seed must be an integer in"),
    ("seed float", dict(seed=1.5), "seed must be an integer in"),
    ("seed bool", dict(seed=True), "seed must be an integer in"),
    ("temperature list", dict(temperature=[0.5, 1.0]), "temperature: sample_many takes one value for all prompts"),
    ("top_p list", dict(top_p=[0.5]), "top_p: sample_many takes one value for all prompts"),
    ("top_k < -1", dict(top_k=-2), "top_k"),
]


@pytest.mark.parametrize("what,kwargs,message", SAMPLE_MANY_BAD, ids=[b[0] for b in SAMPLE_MANY_BAD])
def test_sample_many_bad_input_is_named(unchecked, what, kwargs, message):
    with pytest.raises(GenerationError, match=message):
        unchecked.sample_many([[1], [2]], 2, **kwargs)


def test_device_defaults_agree():
    init = inspect.signature(Generator.__init__).parameters["device"].default
    pretrained = inspect.signature(Generator.from_pretrained).parameters["device"].default
    assert init == pretrained == "auto"


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


def test_seed_none_draws_a_fresh_seed_and_reports_it(generator):
    p, q = rnd_prompt(9, 11), rnd_prompt(4, 12)
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
    prompts = [rnd_prompt(5, 1), rnd_prompt(7, 2)]
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
    p = rnd_prompt(9, 3)
    for top_p in (1.0, 0.9):
        kw = dict(max_new_tokens=12, temperature=1.0, top_p=top_p, seed=21)
        assert generator.generate(p, top_k=-1, **kw).ids == generator.generate(p, top_k=0, **kw).ids
    kw = dict(max_new_tokens=6, temperature=1.0, seed=4)
    assert ([s.ids for s in generator.sample_many([p], 2, top_k=-1, **kw)]
            == [s.ids for s in generator.sample_many([p], 2, top_k=0, **kw)])


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


def streamed(gen, prompts, **kw):
    """Each sample's concatenated stream text. Without stop strings, also checks that
    a running sample's stream never ends inside a character (a trailing U+FFFD); a
    held-back start of a stop string may follow an invalid byte's lasting U+FFFD."""
    texts = [""] * len(prompts)
    for ev in gen.stream(prompts, **kw):
        for i, s in ev.texts.items():
            texts[i] += s
            if i not in ev.finished and not kw.get("stop"):
                assert not texts[i].endswith("\ufffd")
    return texts


STREAM_PROMPTS = [rnd_prompt(3 + 5 * i, 20 + i) for i in range(4)]
STREAM_KW = dict(max_new_tokens=30, temperature=1.0, seed=[5, 6, 7, 8])


def rewrites_its_text(gen, ids) -> bool:
    """Whether some token changes the decoded text before it (it completes a split character)."""
    return any(not gen.decode(ids[: k + 1]).startswith(gen.decode(ids[:k])) for k in range(1, len(ids)))


def test_stream_adds_up_with_characters_split_across_tokens(engine):
    gen = Generator.from_engine(engine, tokenizer=byte_level_tokenizer())
    outs = gen.generate(STREAM_PROMPTS, **STREAM_KW)
    assert all(rewrites_its_text(gen, o.ids) for o in outs)  # the case under test, in every sample
    assert any(ch in o.text for o in outs for ch in "é€😀中")
    assert streamed(gen, STREAM_PROMPTS, **STREAM_KW) == [o.text for o in outs]


def spanning_stop_string(gen, ids) -> str:
    """Two characters of the sample's text, the first settled by token k, the second
    added by token k + 1 (so the stop string spans those tokens)."""
    for k in range(3, len(ids)):
        before, after = gen.decode(ids[:k]), gen.decode(ids[: k + 1])
        settled = before.rstrip("\ufffd")
        if settled and after.startswith(settled) and len(after) > len(settled):
            s = settled[-1] + after[len(settled)]
            if "\ufffd" not in s:
                return s
    raise AssertionError("no two characters span a token boundary")


def first_stop(gen, ids, stops):
    """The ids and text a sample keeps under ``stops``: what ``generate`` should give."""
    for k in range(1, len(ids) + 1):
        text = gen.decode(ids[:k])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return ids[:k], text[: min(hits)]
    return None


def test_stream_never_shows_a_stop_string(engine):
    gen = Generator.from_engine(engine, tokenizer=byte_level_tokenizer())
    free = gen.generate(STREAM_PROMPTS, **STREAM_KW)
    stops = [spanning_stop_string(gen, o.ids) for o in free]
    outs = gen.generate(STREAM_PROMPTS, stop=stops, **STREAM_KW)
    for f, o in zip(free, outs):
        ids, text = first_stop(gen, f.ids, stops)
        assert (o.ids, o.text, o.finish_reason) == (ids, text, "stop")
    texts = streamed(gen, STREAM_PROMPTS, stop=stops, **STREAM_KW)
    assert texts == [o.text for o in outs]
    assert not any(s in t for s in stops for t in texts)


def test_stream_releases_a_held_back_tail_when_the_sample_ends(engine):
    """Text that could start a stop string is held back, and released when the sample
    ends without the stop string."""
    gen = Generator.from_engine(engine, tokenizer=byte_level_tokenizer())
    free = gen.generate(STREAM_PROMPTS, **STREAM_KW)
    never = "\n"  # no token has a newline
    stops = [o.text.rstrip("\ufffd")[-1] + never for o in free]
    outs = gen.generate(STREAM_PROMPTS, stop=stops, **STREAM_KW)
    assert [o.text for o in outs] == [o.text for o in free]
    assert streamed(gen, STREAM_PROMPTS, stop=stops, **STREAM_KW) == [o.text for o in free]
    last = free[0].ids[-1]  # and when a stop token ends it
    cut = free[0].ids.index(last)
    out = gen.generate(STREAM_PROMPTS[0], stop=[last, stops[0]], **STREAM_KW | dict(seed=5))
    assert out.ids == free[0].ids[:cut] and out.finish_reason == "stop"
    assert streamed(gen, [STREAM_PROMPTS[0]], stop=[last, stops[0]], **STREAM_KW | dict(seed=[5])) == [out.text]


def test_cli_stream_prints_the_text_and_the_seed(engine, monkeypatch, capsys):
    from srm_max.generate_cli import run_generate

    gen = Generator.from_engine(engine, tokenizer=byte_level_tokenizer())
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda cls, *a, **k: gen))
    prompt = "a é"
    args = argparse.Namespace(model="unused", device="cpu", dtype=None, prompt=[prompt], max_new_tokens=30,
                              temperature=1.0, top_k=0, top_p=1.0, seed=None, stop=None, stream=True)
    assert run_generate(args) == 0
    out, err = capsys.readouterr()
    seed = int(re.search(r"seed (\d+)", err).group(1))
    expected = gen.generate(prompt, max_new_tokens=30, temperature=1.0, seed=seed)
    assert out == prompt + expected.text + "\n"
    assert run_generate(args) == 0
    assert int(re.search(r"seed (\d+)", capsys.readouterr().err).group(1)) != seed


def test_progress_callback(generator):
    calls = []
    generator.generate([rnd_prompt(3), rnd_prompt(4)], max_new_tokens=9, steps_per_call=4,
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
