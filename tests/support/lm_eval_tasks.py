"""lm-evaluation-harness tasks over local CSV data and the TINY model as a checkpoint
directory (fixtures, imported by the tests that use them), and running lm-eval on them."""

from __future__ import annotations

import json
import os

import pytest

from tests.support.prompts import random_prompts
from tests.support.tiny import TINY
from tests.support.tokenizers import word_tokenizer_with_eot

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # and the tokenizer is a local directory


def words(ids) -> str:
    return " ".join(f"w{t}" for t in ids)


def random_words(lengths, seed):
    """Texts of words w1..w63 (ids 1..63: no <|endoftext|>)."""
    return [[t + 1 for t in p] for p in random_prompts(lengths, TINY.vocab_size - 1, seed)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_weights):
    """The TINY model as a checkpoint directory with a word-level tokenizer."""
    from srm_max.checkpoints.format import save_checkpoint

    root = tmp_path_factory.mktemp("lm_eval")
    word_tokenizer_with_eot().save(str(root / "tokenizer.json"))
    return save_checkpoint(root / "tiny", TINY, tiny_weights, tokenizer=root / "tokenizer.json")


CHOICE = dict(output_type="multiple_choice", doc_to_text="{{context}}", doc_to_choice="{{[c0, c1, c2, c3]}}",
              doc_to_target="{{answer}}", metric_list=[{"metric": "acc"}])


ROLLING = dict(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
               metric_list=[{"metric": "word_perplexity"}])


UNTIL = dict(output_type="generate_until", doc_to_text="{{context}}", doc_to_target="{{target}}",
             generation_kwargs={"until": ["w7"], "max_gen_toks": 6, "do_sample": False},
             metric_list=[{"metric": "exact_match"}])


def write_task(folder, name: str, docs: list[dict], spec: dict) -> str:
    """A task ``name`` over ``docs`` (a local CSV file; a list of choices as columns c0, c1, ...),
    as lm-eval reads it from YAML. (Not JSON: the datasets library's JSON reader crashed the
    test process, SIGSEGV, after the engines had run in it.)"""
    import csv

    rows = [{k: v for k, v in d.items() if k != "choices"} | {f"c{i}": c for i, c in enumerate(d.get("choices", []))}
            for d in docs]
    data = folder / f"{name}.csv"
    with open(data, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    config = {"task": name, "dataset_path": "csv", "dataset_kwargs": {"data_files": {"test": str(data)}},
              "test_split": "test"} | spec
    (folder / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
    return name


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


def evaluate(model, model_args, tasks, loaded=None):
    """lm-eval's ``simple_evaluate`` of ``tasks`` (or of the same tasks already ``loaded``)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    folder, docs = tasks
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=loaded or sorted(docs),
                                   task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                                   log_samples=True, bootstrap_iters=0, random_seed=0)


def by_doc(results, task):
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])

