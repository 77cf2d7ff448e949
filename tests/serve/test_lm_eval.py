"""lm-evaluation-harness on the TINY model: the native ``srm-max`` model and ``srm-max eval``.

Tasks are small YAML files over local CSV data written by the tests (nothing is
downloaded), run in-process by lm-eval's ``simple_evaluate``; the answers are checked
against the PyTorch reference computing lm-eval's own rules.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # and the tokenizer is a local directory

from srm_max import Generator  # noqa: E402
from srm_max.serve.scoring import rolling_windows  # noqa: E402
from tests.support.graphs import ENGINE_KINDS, graphs  # noqa: E402
from tests.support.lm_eval_tasks import by_doc, evaluate, random_words, words  # noqa: E402
from tests.support.reference_scores import lm_eval_loglikelihood, ref_windows  # noqa: E402
from tests.support.tiny import TINY  # noqa: E402

pytestmark = graphs(TINY, ENGINE_KINDS)


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
