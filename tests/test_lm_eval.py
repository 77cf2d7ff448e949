"""lm-evaluation-harness on the TINY model: the native ``srm-max`` model and ``srm-max eval``.

Tasks are small YAML files over local CSV data written by the tests (nothing is
downloaded), run in-process by lm-eval's ``simple_evaluate``; the answers are checked
against the PyTorch reference computing lm-eval's own rules.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # and the tokenizer is a local directory

from conftest import TINY, graphs, random_prompts  # noqa: E402
from srm_max import Generator  # noqa: E402
from srm_max.serve.scoring import rolling_windows  # noqa: E402
from test_scoring_api import ENGINE_KINDS, lm_eval_loglikelihood, ref_windows, word_tokenizer_with_eot  # noqa: E402

pytestmark = graphs(TINY, ENGINE_KINDS)


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


def test_a_checkpoint_directory_loads_with_auto_tokenizer(checkpoint):
    """save_checkpoint writes tokenizer_config.json: transformers loads the tokenizer with its
    end-of-text token (lm-eval's local-completions model reads it so)."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok("w3 w40").input_ids == [3, 40] and tok.model_max_length == TINY.context_length


def test_native_model_runs_loglikelihood_rolling_and_generate_until_tasks(checkpoint, tasks, reference):
    import srm_max.lm_eval_model  # noqa: F401  registers "srm-max"

    results = evaluate("srm-max", f"pretrained={checkpoint},device=cpu,batch_size=2", tasks)
    _, docs = tasks
    n = TINY.context_length
    # multiple choice: every (context, " " + choice) pair as lm-eval's hf model scores it on the reference
    right = 0
    for s, doc in zip(by_doc(results, "tiny_choice"), docs["tiny_choice"]):
        ctx = [int(w[1:]) for w in doc["context"].split()]
        want = [lm_eval_loglikelihood(reference, ctx, [int(w[1:]) for w in c.split()], n) for c in doc["choices"]]
        got = [tuple(r) for r in s["filtered_resps"]]
        assert [g[1] for g in got] == [w[1] for w in want]
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=1e-3)
        right += int(np.argmax([w[0] for w in want]) == doc["answer"])
    assert results["results"]["tiny_choice"]["acc,none"] == pytest.approx(right / len(docs["tiny_choice"]))
    # rolling: lm-eval's windows after <|endoftext|> (id 0)
    for s, doc in zip(by_doc(results, "tiny_rolling"), docs["tiny_rolling"]):
        ids = [int(w[1:]) for w in doc["text"].split()]
        got = s["filtered_resps"][0]
        got = got[0] if isinstance(got, (list, tuple)) else got
        assert got == pytest.approx(ref_windows(reference, rolling_windows(ids, 0, n)).sum(), abs=1e-3)
    # generate_until: greedy, cut at "w7" or <|endoftext|>, the context cut to leave room for 6 tokens
    gen = Generator.from_pretrained(checkpoint, device="cpu")
    for s, doc in zip(by_doc(results, "tiny_until"), docs["tiny_until"]):
        prompt = gen.encode(doc["context"])[-(n - 6):]
        want = gen.generate(prompt, max_new_tokens=6, stop=["w7", 0]).text
        assert s["filtered_resps"][0] == want


def test_rolling_loglikelihood_of_an_empty_text_is_zero(checkpoint):
    from lm_eval.api.instance import Instance

    from srm_max.lm_eval_model import SRMMaxLM

    lm = SRMMaxLM(pretrained=str(checkpoint), device="cpu")
    requests = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in ["", "w3 w4", " "]]
    totals = lm.loglikelihood_rolling(requests, disable_tqdm=True)
    assert totals[0] == 0.0 and totals[2] == 0.0 and totals[1] < 0


# ------------------------------------------------------------------ srm-max eval
def test_eval_cli_prints_the_references_perplexity(checkpoint, tmp_path, reference, capsys):
    from srm_max.cli import main

    ids = random_words([400], seed=5)[0]
    text = tmp_path / "text.txt"
    text.write_text(words(ids))
    assert main(["eval", str(checkpoint), "--text", str(text), "--max-length", "64", "--device", "cpu"]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines() if line.strip())
    nll = -ref_windows(reference, rolling_windows(ids, 0, 64)).sum() / len(ids)
    assert int(lines["tokens"]) == len(ids)
    assert float(lines["mean"].split()[1]) == pytest.approx(nll, abs=1e-4)
    assert float(lines["perplexity"]) == pytest.approx(math.exp(nll), rel=1e-4)
    assert lines["windows"].startswith("7 of up to 64")
