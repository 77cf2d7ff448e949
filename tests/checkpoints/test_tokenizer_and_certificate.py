"""A checkpoint's tokenizer.json and parity.json: ``srm-max verify`` fails on one that the
loaders or the certificate check refuse, with the problem named and no traceback, and
the tokenizer is held to the model's vocabulary by its largest id."""

import json
import shutil

import pytest

from srm_max.checkpoints.convert import convert
from srm_max.checkpoints.parity import compute_parity, read_certificate
from srm_max.checkpoints.tokenizer import check_vocabulary
from srm_max.cli import main as cli_main
from srm_max.errors import CheckpointError, ConvertError, GenerationError
from tests.support.srm_sources import CONFIG, write_source
from tests.support.tokenizers import word_tokenizer


@pytest.fixture(scope="module")
def converted(model, tmp_path_factory):
    """A converted checkpoint (with its parity certificate) that each test copies and spoils."""
    root = tmp_path_factory.mktemp("converted")
    convert(write_source("pt", model, root), root / "model", parity_tokens=16)
    return root / "model"


@pytest.fixture
def checkpoint(converted, tmp_path):
    return shutil.copytree(converted, tmp_path / "ck")


def sparse_tokenizer(largest: int):
    """A WordLevel tokenizer of three tokens whose ids are not dense: 0, 1 and ``largest``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": largest}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def verify_lines(path, capsys) -> tuple[int, list[str]]:
    code = cli_main(["verify", str(path), "--no-engine"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out.splitlines()


# ---------------------------------------------------------------- parity.json


def test_verify_passes_a_good_checkpoint_without_tokenizer(checkpoint, capsys):
    code, lines = verify_lines(checkpoint, capsys)
    assert code == 0
    assert [line.split(":")[0] for line in lines] == ["ok   integrity", "ok   tokenizer", "ok   parity"]


@pytest.mark.parametrize("spoil,problem", [
    (lambda p: (p.unlink(), p.mkdir()), r"is a directory, not a regular file"),
    (lambda p: p.write_text("[]"), r"corrupt parity certificate \(a JSON list, expected an object\)"),
    (lambda p: p.write_text('"passed"'), r"corrupt parity certificate \(a JSON str, expected an object\)"),
    (lambda p: p.write_text("{"), r"corrupt parity certificate \(Expecting property name"),
])
def test_verify_fails_on_an_unusable_certificate(spoil, problem, checkpoint, capsys):
    spoil(checkpoint / "parity.json")
    code, lines = verify_lines(checkpoint, capsys)
    assert code == 1
    (line,) = lines
    assert line.startswith(f"FAIL integrity: {checkpoint / 'parity.json'}: ")
    with pytest.raises(CheckpointError, match=problem):
        read_certificate(checkpoint / "parity.json")


@pytest.mark.parametrize("field,value,expected", [
    ("tokens", -5, "an integer >= 1"),
    ("tokens", "many", "an integer >= 1"),
    ("batch", 10**9, r"an integer in \[1, 64\]"),
    ("batch", True, r"an integer in \[1, 64\]"),
    ("seed", -1, r"an integer in \[0, "),
])
def test_verify_fails_on_certificate_settings_it_cannot_rerun(field, value, expected, checkpoint, capsys):
    path = checkpoint / "parity.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {field: value}))
    code, lines = verify_lines(checkpoint, capsys)
    assert code == 1 and len(lines) == 1
    assert f"corrupt parity certificate ({field} {value!r}, expected " in lines[0]
    with pytest.raises(CheckpointError, match=rf"\({field} .*, expected {expected}"):
        read_certificate(path)


def test_parity_tokens_are_a_positive_integer():
    with pytest.raises(CheckpointError, match="tokens 0: expected a positive integer"):
        compute_parity(CONFIG, {}, tokens=0)
    with pytest.raises(CheckpointError, match="tokens -5: expected a positive integer"):
        compute_parity(CONFIG, {}, tokens=-5)


# ---------------------------------------------------------------- tokenizer.json


def test_verify_fails_on_a_tokenizer_the_loaders_refuse(checkpoint, capsys):
    (checkpoint / "tokenizer.json").write_text("x")
    code, lines = verify_lines(checkpoint, capsys)
    assert code == 1
    assert lines[1].startswith(f"FAIL tokenizer: {checkpoint / 'tokenizer.json'}: not a valid tokenizer.json (")
    assert "ok   integrity" in lines[0] and "ok   parity" in lines[-1]  # the other checks still run


def test_verify_fails_on_a_tokenizer_with_an_id_beyond_the_vocabulary(checkpoint, capsys):
    sparse_tokenizer(CONFIG.vocab_size).save(str(checkpoint / "tokenizer.json"))
    code, lines = verify_lines(checkpoint, capsys)
    assert code == 1
    assert (f"FAIL tokenizer: {checkpoint / 'tokenizer.json'}: tokenizer has 3 tokens with ids up to "
            f"{CONFIG.vocab_size}, but the model's vocabulary is {CONFIG.vocab_size}") in "\n".join(lines)

    sparse_tokenizer(CONFIG.vocab_size - 1).save(str(checkpoint / "tokenizer.json"))
    code, lines = verify_lines(checkpoint, capsys)
    assert code == 0
    assert f"ok   tokenizer: 3 tokens, ids up to {CONFIG.vocab_size - 1} within the vocabulary" in lines[1]


def test_convert_refuses_a_tokenizer_by_its_largest_id(model, tmp_path, capsys):
    sparse_tokenizer(5000).save(str(tmp_path / "sparse.json"))
    src = write_source("pt", model, tmp_path)
    with pytest.raises(ConvertError, match="sparse.json: tokenizer has 3 tokens with ids up to 5000, but the model's "
                                           f"vocabulary is {CONFIG.vocab_size}.*: mismatched tokenizer"):
        convert(src, tmp_path / "out", tokenizer=tmp_path / "sparse.json")
    assert not (tmp_path / "out").exists()


def test_added_tokens_count_toward_the_largest_id():
    tok = word_tokenizer(CONFIG.vocab_size - 1)
    check_vocabulary(tok, CONFIG.vocab_size, CheckpointError)  # ids up to V - 2
    tok.add_special_tokens(["<a>", "<b>"])  # take the next ids, V - 1 and V
    with pytest.raises(CheckpointError, match=f"ids up to {CONFIG.vocab_size}, but"):
        check_vocabulary(tok, CONFIG.vocab_size, CheckpointError)


@pytest.mark.parametrize("bad", [123, b"tokenizer.json", {"model": {}}])
def test_a_tokenizer_that_is_no_tokenizer_is_named(bad, converted):
    with pytest.raises(GenerationError, match=f"tokenizer: expected a tokenizers.Tokenizer .*got {type(bad).__name__}"):
        check_vocabulary(bad, CONFIG.vocab_size, GenerationError)
    from srm_max.serve.generator import Generator

    with pytest.raises(GenerationError, match="tokenizer"):
        Generator.from_pretrained(converted, tokenizer=bad, warmup=False)
