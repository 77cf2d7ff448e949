"""``srm-max generate``, ``eval`` and ``serve`` refuse bad input with one line on stderr and exit 2:
generate before it prints anything (a checkpoint without a tokenizer before it builds an
engine), eval a text with no token to score rather than report a perplexity of nan, serve an
option out of its bounds before the model loads; and eval does not score a byte order mark."""

from __future__ import annotations

import io
import sys

import pytest

from srm_max import Generator
from srm_max.checkpoints.format import save_checkpoint
from srm_max.cli import build_parser, main
from srm_max.serve.http.run import MAX_BATCH, MAX_STEPS_PER_CALL, MAX_WAITING, checked_options
from tests.support.graphs import graphs
from tests.support.stand_ins import NoWork
from tests.support.tiny import TINY
from tests.support.tokenizers import byte_level_tokenizer, word_tokenizer

pytestmark = graphs(TINY)


@pytest.fixture
def unchecked(monkeypatch):
    """``Generator.from_pretrained`` gives a generator whose engine fails if anything runs."""
    gen = Generator.from_engine(NoWork(), tokenizer=byte_level_tokenizer())
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda cls, *a, **k: gen))
    return gen


def refused(capsys, argv: list[str], says: str) -> None:
    """``srm-max argv`` exits 2 with one line on stderr that ``says`` why, and prints nothing else."""
    assert main(["--quiet", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"srm-max {argv[0]}: error: ") and says in err and err.count("\n") == 1, err


GENERATE_BAD = [
    (["a", "--stream", "--stop", ""], "stop[0]: empty stop string"),
    (["a", "--temperature", "inf"], "temperature must be a finite number"),
    (["a", "--temperature", "nan", "--stream"], "temperature must be a finite number"),
    (["a", "--top-p", "0"], "top_p"),
    (["a", "--max-new-tokens", "-1"], "max_new_tokens"),
    (["a", "--seed", "-1", "--temperature", "1"], "--seed must be an integer"),
    (["a", "b", "--stream"], "--stream takes exactly one prompt"),
    (["\udcff\udcfe"], "prompt 0 is not valid UTF-8 text: byte 0 is 0xff"),
    (["ok", "a\udcc3"], "prompt 1 is not valid UTF-8 text: byte 1 is 0xc3"),
    (["a", "--stop", "\udcff"], "--stop is not valid UTF-8 text"),
]


@pytest.mark.parametrize("argv,says", GENERATE_BAD, ids=[says for _, says in GENERATE_BAD])
def test_generate_refuses_every_bad_argument_before_printing_anything(unchecked, capsys, argv, says):
    refused(capsys, ["generate", *argv], says)


def test_generate_wants_a_tokenizer_before_building_an_engine(tmp_path, monkeypatch, capsys):
    def built(*args, **kwargs):
        raise AssertionError("the engine was built before the tokenizer was asked for")

    monkeypatch.setattr(Generator, "from_pretrained", classmethod(built))
    (tmp_path / "config.json").write_text("{}")
    refused(capsys, ["generate", "hi", "--model", str(tmp_path)], f"{tmp_path} has no tokenizer.json")


# ------------------------------------------------------------------ srm-max eval
def evaluate(checkpoint, text, capsys) -> str:
    assert main(["--quiet", "eval", str(checkpoint), "--text", str(text), "--device", "cpu"]) == 0
    return capsys.readouterr().out


def test_a_byte_order_mark_is_not_scored_in_a_file_or_on_standard_input(checkpoint, tmp_path, monkeypatch, capsys):
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("w3 w4 w5 w6", encoding="utf-8")
    marked.write_text("w3 w4 w5 w6", encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    out = evaluate(checkpoint, plain, capsys)
    assert out.startswith("tokens      4\n")
    assert evaluate(checkpoint, marked, capsys) == out
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(marked.read_bytes())))
    assert evaluate(checkpoint, "-", capsys) == out  # '-': standard input


def test_a_text_of_whitespace_is_refused(checkpoint, tmp_path, capsys):
    text = tmp_path / "text.txt"
    for content in (" \n\t ", "\ufeff \n"):  # the word tokenizer drops whitespace
        text.write_text(content, encoding="utf-8")
        refused(capsys, ["eval", str(checkpoint), "--text", str(text), "--device", "cpu"], "the text has no tokens")


def test_one_token_is_nothing_to_score_without_an_end_of_text_token(tiny_weights, tmp_path, capsys):
    """Without <|endoftext|> in the tokenizer a text's first token is read, not scored."""
    word_tokenizer(TINY.vocab_size).save(str(tmp_path / "tokenizer.json"))
    checkpoint = save_checkpoint(tmp_path / "ckpt", TINY, tiny_weights, tokenizer=tmp_path / "tokenizer.json")
    text = tmp_path / "text.txt"
    text.write_text("w3")
    refused(capsys, ["eval", str(checkpoint), "--text", str(text), "--device", "cpu"], "the text is one token")
    text.write_text("w3 w4")
    assert evaluate(checkpoint, text, capsys).startswith("tokens      1\n")


def test_an_empty_file_is_refused_before_a_model_is_loaded(tmp_path, monkeypatch, capsys):
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded for an empty text")

    monkeypatch.setattr(Generator, "from_pretrained", classmethod(loaded))
    for content in (b"", b"\xef\xbb\xbf"):  # a byte order mark alone is no text either
        (tmp_path / "empty.txt").write_bytes(content)
        refused(capsys, ["eval", "--text", str(tmp_path / "empty.txt")], "the file is empty")


# ------------------------------------------------------------------ paths
EMPTY_PATHS = [
    (["convert", "", "dst"], "SRC"),
    (["convert", "src", ""], "DST"),
    (["convert", "src", "dst", "--config", ""], "--config"),
    (["convert", "src", "dst", "--tokenizer", ""], "--tokenizer"),
    (["generate", "hi", "--model", ""], "--model"),
    (["compile", ""], "DIR"),
    (["verify", ""], "DIR"),
    (["eval", "", "--text", "t.txt"], "DIR"),
    (["eval", "--text", ""], "--text"),
]


@pytest.mark.parametrize("argv,shown", EMPTY_PATHS, ids=[" ".join(argv) for argv, _ in EMPTY_PATHS])
def test_an_empty_path_is_refused(monkeypatch, capsys, argv, shown):
    # Path("") is the current directory and an empty option reads as not given: neither is what was asked
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    refused(capsys, argv, f"{shown}: an empty path names no file or directory")


# ------------------------------------------------------------------ srm-max serve
SERVE_BAD = [
    (["--max-batch", str(10**12)], f"--max-batch must be 'auto' or an integer from 1 to {MAX_BATCH}, got "
                                   "'1000000000000'"),
    (["--max-batch", str(MAX_BATCH + 1)], f"from 1 to {MAX_BATCH}, got '{MAX_BATCH + 1}'"),
    (["--max-batch", "0"], "--max-batch must be 'auto' or an integer"),
    (["--max-batch", "\u00b2"], "--max-batch must be 'auto' or an integer"),  # a digit to isdigit, not to int
    (["--max-batch", "9" * 5000], "--max-batch must be 'auto' or an integer"),  # past int()'s digit limit
    (["--max-waiting", str(10**12)], f"--max-waiting must be an integer from 1 to {MAX_WAITING}, got 1000000000000"),
    (["--max-waiting", "0"], f"--max-waiting must be an integer from 1 to {MAX_WAITING}, got 0"),
    (["--steps-per-call", str(10**9)], f"--steps-per-call must be an integer from 1 to {MAX_STEPS_PER_CALL}, got "
                                       "1000000000"),
    (["--steps-per-call", "-1"], "--steps-per-call must be an integer from 1"),
    (["--prefix-cache-mb", "1e30"], "--prefix-cache-mb must be a finite number from 0 to"),
    (["--prefix-cache-mb", "nan"], "got nan"),
    (["--prefix-cache-mb", "inf"], "got inf"),
    (["--prefix-cache-mb", "-1"], "got -1"),
    (["--port", "65536"], "--port must be from 0 to 65535, got 65536"),
    (["--api-key", ""], "--api-key must be a non-empty string of printable ASCII"),
    (["--api-key", "s\u00e9cret"], "--api-key must be a non-empty string of printable ASCII"),
]


@pytest.mark.parametrize("argv,says", SERVE_BAD, ids=[" ".join(argv)[:30] for argv, _ in SERVE_BAD])
def test_serve_refuses_an_option_out_of_bounds_before_loading_a_model(monkeypatch, capsys, argv, says):
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    refused(capsys, ["serve", *argv], says)


def test_serve_takes_each_bound_and_its_help_names_it(monkeypatch, capsys):
    monkeypatch.delenv("SRM_MAX_API_KEY", raising=False)
    bounds = ["--max-batch", str(MAX_BATCH), "--max-waiting", str(MAX_WAITING),
              "--steps-per-call", str(MAX_STEPS_PER_CALL), "--prefix-cache-mb", "0"]
    assert checked_options(build_parser().parse_args(["serve", *bounds])) is None
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    usage = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for shown in (f"1 to {MAX_BATCH}", f"1 to {MAX_WAITING}", f"1 to {MAX_STEPS_PER_CALL}", "the machine's memory"):
        assert shown in usage, shown
