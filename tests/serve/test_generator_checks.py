"""Generator's and sample_many's argument checks: each bad argument is named before any
work starts; devices, dtypes and tokenizers that do not fit the model."""

from __future__ import annotations

import inspect

import pytest

from srm_max import GenerationError, Generator
from tests.support.graphs import graphs
from tests.support.stand_ins import NoWork
from tests.support.tiny import TINY
from tests.support.tokenizers import word_tokenizer

pytestmark = graphs(TINY)


@pytest.fixture(scope="session")
def unchecked():
    return Generator.from_engine(NoWork(), tokenizer=word_tokenizer(TINY.vocab_size))


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
