"""The embedded default model: it loads, its certificate holds, and MAX agrees with the reference."""

import json
import shutil

import pytest
import torch

from srm_max.checkpoints.format import load_checkpoint
from srm_max.checkpoints.parity import compute_parity, read_certificate, reference_model
from srm_max.embedded import EMBEDDED_MODEL_DIR, REQUIRED_FILES, default_model_path
from srm_max.errors import CheckpointError
from srm_max.models.registry import load_config
from tests.support.graphs import ENGINE_KINDS, graphs


# the CPU graphs of the embedded model (shipped with the package: installed, not compiled)
pytestmark = graphs(load_config(EMBEDDED_MODEL_DIR / "config.json"), ENGINE_KINDS)

PROMPT = "To be, or not"


@pytest.fixture(scope="module")
def embedded():
    return load_checkpoint(default_model_path())


def test_embedded_model_loads_with_its_tokenizer(embedded):
    assert embedded.config.architecture == "srm"
    assert embedded.tokenizer_path is not None
    assert sum(p.stat().st_size for p in EMBEDDED_MODEL_DIR.iterdir()) <= 25 * 2**20
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(embedded.tokenizer_path))
    assert tokenizer.get_vocab_size() <= embedded.config.vocab_size
    assert tokenizer.decode(tokenizer.encode(PROMPT).ids) == PROMPT


def test_embedded_parity_certificate_holds(embedded):
    recorded = read_certificate(EMBEDDED_MODEL_DIR / "parity.json")
    assert recorded["passed"]
    again = compute_parity(embedded.config, embedded.weights, tokens=64, seed=recorded["seed"])
    assert again["passed"], again["max_abs_delta"]


@pytest.mark.parametrize("missing", REQUIRED_FILES)
def test_missing_embedded_file_is_named(missing, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL_DIR, copy)
    (copy / missing).unlink()
    with pytest.raises(CheckpointError, match=f"embedded model: .*{missing} is missing"):
        default_model_path(copy)


def test_corrupted_embedded_weights_are_named(tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL_DIR, copy)
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: tensor .*truncated"):
        load_checkpoint(default_model_path(copy))
    (copy / "config.json").write_text(json.dumps({"vocab_size": 4096}))
    with pytest.raises(CheckpointError, match=r"config.json: missing config field\(s\)"):
        load_checkpoint(copy)


def test_reference_greedy_from_prompt_is_text(embedded):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(embedded.tokenizer_path))
    model = reference_model(embedded.config, embedded.weights, torch.float32)
    ids = tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        out = model.generate_greedy(torch.tensor(ids), 16).tolist()
    assert len(tokenizer.decode(out).split()) >= 3


def test_max_greedy_equals_reference_on_the_embedded_model(request, embedded):
    """Generator.from_pretrained() with no path is the embedded model, and it agrees with torch."""
    from srm_max import Generator

    from tests.support.graphs import declared_graph_jobs

    generator = Generator.from_pretrained(device="cpu")
    assert generator.config == embedded.config
    jobs = {generator.engine.graph_job(kind) for kind in generator.engine.graph_kinds()}
    assert jobs == set(declared_graph_jobs([request.node]))  # precompiled by conftest
    completion = generator.generate(PROMPT, max_new_tokens=24)
    model = reference_model(embedded.config, embedded.weights, torch.float32)
    ids = generator.encode(PROMPT)
    with torch.no_grad():
        expected = model.generate_greedy(torch.tensor(ids), 24).tolist()
    assert completion.ids == expected
    assert completion.text == generator.decode(expected)
    assert completion.finish_reason == "length"


def test_cli_generate_with_the_embedded_model(capsys):
    from srm_max.cli import main

    assert main(["generate", PROMPT, "--max-new-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and len(out) > len(PROMPT) + 1
