"""Generator's and sample_many's argument checks: each bad argument is named before any
work starts; devices, dtypes and tokenizers that do not fit the model."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from srm_max import GenerationError, Generator
from srm_max.serve import generator as generator_module
from srm_max.serve.sample_many import plan
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
    ("id array of no rows", dict(prompts=np.zeros((0, 3), np.int64)), r"prompts is empty: .* shape \(0, 3\)"),
    ("bytes", dict(prompts=b"w1"), r"prompts: got bytes, which is not text: decode it to str"),
    ("bytearray", dict(prompts=bytearray(b"w1")), "prompts: got bytearray, which is not text"),
    ("memoryview", dict(prompts=memoryview(b"w1")), "prompts: got memoryview, which is not text"),
    ("bytes in a batch", dict(prompts=["w1", b"w2"]), "prompt 1: got bytes, which is not text"),
    ("stop bytes", dict(prompts=[1], stop=bytearray(b"w1")), "stop: got bytearray, which is not text"),
    ("stop bytes in a list", dict(prompts=[1], stop=["w1", b"w2"]), r"stop\[1\]: got bytes, which is not text"),
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
    ("verifier not callable", dict(verifier=5), "verifier must be callable"),
    ("bytes prompt", dict(prompts=b"w1"), "prompts: got bytes, which is not text"),
    ("id array of no rows", dict(prompts=np.zeros((0, 3), np.int64)), "prompts is empty"),
]


@pytest.mark.parametrize("what,kwargs,message", SAMPLE_MANY_BAD, ids=[b[0] for b in SAMPLE_MANY_BAD])
def test_sample_many_bad_input_is_named(unchecked, what, kwargs, message):
    args = dict(prompts=[[1], [2]], n=2) | kwargs
    with pytest.raises(GenerationError, match=message):
        unchecked.sample_many(**args)


def test_sample_many_takes_the_prompts_generate_takes(unchecked):
    """One prompt, or several as a list, a tuple or a 2-D id array: the prompts ``generate`` takes."""
    for prompts, expected in [("w1 w2", [[1, 2]]), ([1, 2], [[1, 2]]), (np.array([1, 2]), [[1, 2]]),
                              (("w1", "w2 w3"), [[1], [2, 3]]), ([[1], "w2 w3"], [[1], [2, 3]]),
                              (np.array([[1, 2], [3, 4]]), [[1, 2], [3, 4]])]:
        assert plan(unchecked, prompts, 2, max_batch=2).prompts == expected


def test_no_prompt_is_refused_however_it_comes(unchecked):
    for nothing in ([], (), np.zeros((0, 2), np.int64)):
        with pytest.raises(GenerationError, match="empty"):
            unchecked.score(nothing)
        with pytest.raises(GenerationError, match="empty"):
            unchecked.loglikelihood_rolling(nothing)


BAD_LOADS = [
    ("path int", dict(path=123), r"path must be a checkpoint directory \(a str or a pathlib.Path\), got 123"),
    ("path bytes", dict(path=b"/tmp"), r"path must be a checkpoint directory .*, got b'/tmp'"),
    ("tokenizer int", dict(tokenizer=123), "tokenizer: expected a tokenizers.Tokenizer or the path of a tokenizer"),
    ("tokenizer bytes", dict(tokenizer=b"t.json"), "tokenizer: expected a tokenizers.Tokenizer"),
    ("cache inf", dict(prefix_cache_mb=float("inf")), r"prefix_cache_mb must be a finite number >= 0 .*, got inf"),
    ("cache -inf", dict(prefix_cache_mb=-np.inf), "prefix_cache_mb must be a finite number >= 0"),
    ("cache nan", dict(prefix_cache_mb=float("nan")), "prefix_cache_mb must be a finite number >= 0"),
]


@pytest.mark.parametrize("what,kwargs,message", BAD_LOADS, ids=[b[0] for b in BAD_LOADS])
def test_bad_load_arguments_are_named_before_any_loading(monkeypatch, what, kwargs, message):
    def loaded(path):
        raise AssertionError("a checkpoint was loaded before the arguments were checked")

    monkeypatch.setattr(generator_module, "load_checkpoint", loaded)
    with pytest.raises(GenerationError, match=message):
        Generator.from_pretrained(**kwargs)
    engine_kwargs = {k: v for k, v in kwargs.items() if k != "path"}
    if engine_kwargs:
        with pytest.raises(GenerationError, match=message):
            Generator.from_engine(NoWork(), **engine_kwargs)


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


@pytest.mark.parametrize("top_p", [1e-50, 1.4e-45, 1e-40, 1.17e-38])
def test_a_top_p_the_engine_flushes_to_0_is_refused(top_p):
    # float32 subnormals are flushed to 0 by the engine, where top_p 0 would mean no filter
    from srm_max.serve.sampling import check_top_p

    with pytest.raises(GenerationError, match="rounds to 0 .*smallest normal number"):
        check_top_p(top_p)


def test_the_smallest_normal_top_p_is_accepted():
    from srm_max.serve.sampling import check_top_p

    tiny = float(np.finfo(np.float32).tiny)
    assert check_top_p(tiny) == tiny
    assert check_top_p(1e-30) == 1e-30
