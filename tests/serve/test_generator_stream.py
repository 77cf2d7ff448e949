"""Generator.stream: the same tokens and text as generate, characters split across tokens,
stop strings never shown, a held-back tail released, and the CLI's streamed output."""

from __future__ import annotations

import argparse
import re

from srm_max import Generator
from tests.support.graphs import graphs
from tests.support.tiny import TINY
from tests.support.tokenizers import byte_level_tokenizer, word_tokenizer

pytestmark = graphs(TINY)

from tests.support.prompts import random_prompt


def test_stream_equals_generate(engine):
    gen = Generator.from_engine(engine, tokenizer=word_tokenizer(TINY.vocab_size))
    prompts = [random_prompt(5, 1), random_prompt(90, 2)]
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


STREAM_PROMPTS = [random_prompt(3 + 5 * i, 20 + i) for i in range(4)]
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
