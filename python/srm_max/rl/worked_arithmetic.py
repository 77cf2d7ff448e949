"""A verifiable task generated in code: two-step arithmetic with a worked answer.

    prompt      "\\n347+85-129="
    completion  "347+85=432;432-129=303\\n"

Each problem is ``a op1 b op2 c`` with ``op1, op2`` in ``+ -`` and operands of
``min_digits``..``max_digits`` digits, evaluated left to right; the worked answer
writes the first step, then the second one starting from its result. Results may
be negative (``12-345=-333``). The prompt starts with the line separator so that a
model trained on a stream of problems, one per line, sees where a problem begins.

The checker scores the *final* answer, the number after the last ``=`` of the
completion (up to the line end), as GSM8K graders do: 1.0 when it is exactly the
canonical decimal of the result, else 0.0. ``worked_correct`` is the stricter
check of the whole worked line.

Tokens are single characters (a ``tokenizers`` WordLevel model), with
``<|endoftext|>`` at id 0 as ``srm-max train`` requires: 16 tokens in all.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"  # the trainer's document separator (train.corpus.END_OF_TEXT)
NEWLINE = "\n"
CHARS = list("0123456789+-=;") + [NEWLINE]
VOCAB = [END_OF_TEXT] + CHARS
VOCAB_SIZE = len(VOCAB)
EOT_ID = 0
NEWLINE_ID = VOCAB.index(NEWLINE)  # the stop token: a completion ends its line
_ID = {c: i for i, c in enumerate(VOCAB)}
OPS = ("+", "-")


def make_tokenizer():
    """A ``tokenizers.Tokenizer`` mapping each character (newline included) to one id."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(dict(_ID), unk_token=END_OF_TEXT))
    # "[\s\S]": one piece per character; "." would not match the newline.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([END_OF_TEXT])
    return tok


def save_tokenizer(path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    make_tokenizer().save(str(path))
    return path


def encode(text: str) -> list[int]:
    """Text of ``CHARS`` -> ids (no tokenizer object needed)."""
    try:
        return [_ID[c] for c in text]
    except KeyError as e:
        raise ValueError(f"encode: character {e.args[0]!r} is not in the task's vocabulary") from None


def decode(ids) -> str:
    """Ids -> text; ``<|endoftext|>`` cuts the text. Ids outside the task's
    vocabulary (a model's vocabulary may be larger) decode as "?", which no answer contains."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOT_ID:
            break
        out.append(VOCAB[i] if 0 <= i < VOCAB_SIZE else "?")
    return "".join(out)


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y


@dataclass(frozen=True)
class Problem:
    a: int
    op1: str
    b: int
    op2: str
    c: int

    def __post_init__(self) -> None:
        if self.op1 not in OPS or self.op2 not in OPS:
            raise ValueError(f"Problem: operators must be in {OPS}, got {self.op1!r}, {self.op2!r}")
        if min(self.a, self.b, self.c) < 0:
            raise ValueError("Problem: operands must be >= 0")

    @property
    def first(self) -> int:
        return _apply(self.a, self.op1, self.b)

    @property
    def result(self) -> int:
        return _apply(self.first, self.op2, self.c)

    @property
    def question(self) -> str:
        return f"{self.a}{self.op1}{self.b}{self.op2}{self.c}="

    @property
    def prompt(self) -> str:
        return NEWLINE + self.question

    @property
    def worked(self) -> str:
        """The worked answer, without the line end."""
        s = self.first
        return f"{self.a}{self.op1}{self.b}={s};{s}{self.op2}{self.c}={self.result}"

    def line(self) -> str:
        """One training line: question, worked answer, newline."""
        return self.question + self.worked + NEWLINE

    def prompt_ids(self) -> list[int]:
        return encode(self.prompt)

    def target_ids(self) -> list[int]:
        return encode(self.worked + NEWLINE)

    def verify(self, completion) -> float:
        return verify(self, completion)


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    d = rng.randint(min_digits, max_digits)
    return rng.randrange(0 if d == 1 else 10 ** (d - 1), 10**d)


def problems(count: int, min_digits: int = 2, max_digits: int = 3, seed: int = 0,
             exclude: set | None = None) -> list[Problem]:
    """``count`` distinct problems, never one in ``exclude`` (a held-out set); the same
    arguments give the same list on every machine (``random.Random(seed)``)."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    space = 4 * sum(9 * 10 ** (d - 1) + (d == 1) for d in range(min_digits, max_digits + 1)) ** 3
    if count + len(exclude or ()) > space // 2:
        raise ValueError(f"{count} distinct problems asked of only {space} with "
                         f"{min_digits}-{max_digits} digit operands")
    rng = random.Random(seed)
    out, seen = [], set(exclude or ())
    while len(out) < count:
        p = Problem(_operand(rng, min_digits, max_digits), rng.choice(OPS), _operand(rng, min_digits, max_digits),
                    rng.choice(OPS), _operand(rng, min_digits, max_digits))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def corpus_text(problem_list: list[Problem]) -> str:
    """The training text: one problem per line (question then worked answer)."""
    return "".join(p.line() for p in problem_list)


def completion_text(completion) -> str:
    """The completion (ids or text) up to its first line end."""
    text = completion if isinstance(completion, str) else decode(completion)
    return text.split(NEWLINE, 1)[0]


def final_answer(completion) -> str:
    """The text after the completion's last ``=`` ("" when it has none)."""
    line = completion_text(completion)
    return line.rsplit("=", 1)[1] if "=" in line else ""


def verify(problem: Problem, completion) -> float:
    """1.0 when the final answer is exactly ``str(problem.result)``, else 0.0."""
    return 1.0 if final_answer(completion) == str(problem.result) else 0.0


def worked_correct(problem: Problem, completion) -> bool:
    """The whole worked line is exactly right (both steps, not only the final answer)."""
    return completion_text(completion) == problem.worked


def max_length(max_digits: int) -> int:
    """Longest prompt + completion in tokens for operands of ``max_digits`` digits."""
    d, r = max_digits, max_digits + 2  # a result: a sign, and one digit more than an operand
    prompt = 1 + 3 * d + 3
    worked = (2 * d + 2 + r) + 1 + (r + d + 2 + r) + 1
    return prompt + worked


__all__ = ["Problem", "problems", "corpus_text", "make_tokenizer", "save_tokenizer", "encode", "decode",
           "verify", "worked_correct", "final_answer", "completion_text", "max_length", "VOCAB",
           "VOCAB_SIZE", "EOT_ID", "NEWLINE_ID", "END_OF_TEXT"]
