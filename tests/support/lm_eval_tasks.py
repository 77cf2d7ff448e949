"""lm-evaluation-harness tasks over local CSV data, and running lm-eval on them (the
fixtures that write them are in tests/serve/conftest.py)."""

from __future__ import annotations

import json
import os

from tests.support.prompts import random_prompts
from tests.support.tiny import TINY

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # and the tokenizer is a local directory


def words(ids) -> str:
    return " ".join(f"w{t}" for t in ids)


def random_words(lengths, seed):
    """Texts of words w1..w63 (ids 1..63: no <|endoftext|>)."""
    return [[t + 1 for t in p] for p in random_prompts(lengths, TINY.vocab_size - 1, seed)]


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

