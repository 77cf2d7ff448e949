"""A verifiable task generated in code: multi-digit addition.

    "12+345=" -> "357"      (then the end token)

Problems are drawn with operands of ``min_digits``..``max_digits`` digits. A
tiny character-level tokenizer (``tokenizers`` WordLevel over single
characters) has the digits, ``+``, ``=``, a pad token and an end token
``<e>``. The verifier parses the completion up to the end token (or the end of
the text) and scores 1 when it is exactly the sum, else 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PAD, END = "<pad>", "<e>"
CHARS = list("0123456789+=")
VOCAB = [PAD, END] + CHARS  # ids: <pad>=0, <e>=1, digits 2..11, + 12, = 13
PAD_ID, END_ID = 0, 1
VOCAB_SIZE = len(VOCAB)


def make_tokenizer():
    """A ``tokenizers.Tokenizer`` mapping each character to one id (decode joins without spaces)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, END])
    return tok


def encode(text: str) -> list[int]:
    """Fast path (no tokenizer object): characters of ``CHARS`` only."""
    return [VOCAB.index(c) for c in text]


def decode(ids) -> str:
    """Ids -> text; the end token decodes as nothing and cuts the text. A model's
    vocabulary may be larger than the task's: ids outside it decode as "?" (wrong)."""
    out = []
    for i in ids:
        i = int(i)
        if i == END_ID:
            break
        if i != PAD_ID:
            out.append(VOCAB[i] if 0 <= i < VOCAB_SIZE else "?")
    return "".join(out)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def prompt_ids(self) -> list[int]:
        return encode(self.prompt)

    def target_ids(self) -> list[int]:
        """The completion the model should produce: the answer then the end token."""
        return encode(self.answer) + [END_ID]

    def verify(self, completion) -> float:
        return verify(self, completion)


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    d = rng.randint(min_digits, max_digits)
    lo = 0 if d == 1 else 10 ** (d - 1)
    return rng.randrange(lo, 10**d)


def problems(count: int, min_digits: int = 1, max_digits: int = 2, seed: int = 0,
             exclude: set | None = None) -> list[Problem]:
    """``count`` problems, operands of min..max digits, never one in ``exclude`` (a held-out
    set); distinct while the draws find new ones (100 tries per problem), then repeating
    chosen ones where fewer problems than ``count`` exist."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    excluded = set(exclude or ())
    digits = range(min_digits, max_digits + 1)
    operands = sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in digits)
    drawable = {p for p in excluded if isinstance(p, Problem) and len(str(p.a)) in digits and len(str(p.b)) in digits}
    if count and len(drawable) >= operands ** 2:
        raise ValueError(f"every one of the {operands ** 2} problems of {min_digits}-{max_digits} digit operands "
                         "is excluded")
    rng = random.Random(seed)
    out, chosen = [], set()
    tries = 0
    while len(out) < count:
        p = Problem(_operand(rng, min_digits, max_digits), _operand(rng, min_digits, max_digits))
        tries += 1
        if p in excluded or (p in chosen and tries < 100 * count):
            continue
        chosen.add(p)
        out.append(p)
    return out


def parse_answer(completion) -> str:
    """The completion's text up to the end token (token ids or text; text is cut at ``<e>``)."""
    if isinstance(completion, str):
        return completion.split(END, 1)[0].strip()
    return decode(completion).strip()


def verify(problem: Problem, completion) -> float:
    """1.0 when the completion (text or ids) is exactly the sum up to the end token, else 0.0."""
    ans = parse_answer(completion)
    return 1.0 if ans.isdigit() and int(ans) == problem.a + problem.b and ans == problem.answer else 0.0


def verifier_for(problem_list: list[Problem]):
    """A verifier for ``sample_many``: ``score(prompt_index, completion)``."""
    def score(prompt_index: int, completion) -> float:
        return verify(problem_list[prompt_index], completion)
    return score


def max_length(max_digits: int) -> int:
    """Longest prompt + answer + end token for operands of ``max_digits`` digits."""
    return 2 * max_digits + 2 + (max_digits + 1) + 1


__all__ = ["Problem", "problems", "make_tokenizer", "encode", "decode", "verify", "verifier_for",
           "parse_answer", "VOCAB", "VOCAB_SIZE", "PAD_ID", "END_ID", "max_length"]
