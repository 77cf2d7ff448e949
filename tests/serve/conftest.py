"""Fixtures of the lm-eval tests (tests/serve/test_lm_eval.py and the server's
tests/serve/http/test_server_logprobs.py): the TINY model as a checkpoint directory and
the lm-eval tasks over local data."""

import pytest

from tests.support.lm_eval_tasks import CHOICE, ROLLING, UNTIL, random_words, words, write_task
from tests.support.tiny import TINY
from tests.support.tokenizers import word_tokenizer_with_eot


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_weights):
    """The TINY model as a checkpoint directory with a word-level tokenizer."""
    from srm_max.checkpoints.format import save_checkpoint

    root = tmp_path_factory.mktemp("lm_eval")
    word_tokenizer_with_eot().save(str(root / "tokenizer.json"))
    return save_checkpoint(root / "tiny", TINY, tiny_weights, tokenizer=root / "tokenizer.json")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    contexts = random_words([5, 12, 30, 1], seed=1)
    choices = random_words([1, 2, 3, 1], seed=2)
    choice_docs = [{"context": words(c), "choices": [words(x) for x in choices], "answer": i % 4}
                   for i, c in enumerate(contexts)]
    long = random_words([20, 150, 300], seed=3)  # longer than the context: rolling windows
    rolling_docs = [{"text": words(t)} for t in long]
    until_docs = [{"context": words(c), "target": "w1"} for c in random_words([3, 40, 85, 95], seed=4)]
    return folder, {write_task(folder, "tiny_choice", choice_docs, CHOICE): choice_docs,
                    write_task(folder, "tiny_rolling", rolling_docs, ROLLING): rolling_docs,
                    write_task(folder, "tiny_until", until_docs, UNTIL): until_docs}

