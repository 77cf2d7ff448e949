"""``srm-max eval DIR --text FILE``: the perplexity of a text under a model.

The text is one document, tokenized whole and scored in lm-eval's
``loglikelihood_rolling`` windows (``serve.scoring.rolling_windows``): the first
window predicts the first ``max_length`` tokens after the end-of-text token (the
document separator `srm-max train` writes; a tokenizer without it leaves the first
token unscored), every later window the next ``max_length`` after the token before
it, each read from a fresh state. So every token is scored once, with at most
``max_length`` tokens of context, as lm-eval's ``word_perplexity`` tasks (wikitext)
and its ``hf`` model do. The numbers come from the engine's scoring (``serve.scoring``).
A byte order mark at the start of the file is not part of the text; a text with no token
to score is refused, not reported as a perplexity of nan.

    tokens       the tokens scored
    mean NLL     -(sum of their log-probabilities) / tokens, in nats
    perplexity   exp(mean NLL)
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import GenerationError
from ..files import check_regular_file
from ..progress import Progress
from .logprobs import check_max_length, rolling_prefix
from .scoring import rolling_windows, score_windows, tokens_per_call


@dataclass
class Perplexity:
    tokens: int  # tokens scored
    nll: float  # their negative log-likelihood, summed (nats)
    windows: int
    max_length: int

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens if self.tokens else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll) if self.tokens else math.nan


def perplexity(generator, ids: list[int], max_length: int | None = None,
               progress: Progress | None = None) -> Perplexity:
    """The perplexity of the token ids ``ids`` (module docs); ``progress`` counts tokens."""
    n = check_max_length(max_length, generator.config)
    prefix = rolling_prefix(generator)
    if prefix is None:
        if not ids:
            return Perplexity(0, 0.0, 0, n)
        prefix, ids = ids[0], ids[1:]
    windows = rolling_windows(list(ids), prefix, n)
    per_batch = max(1, tokens_per_call(generator.config) // n)  # windows per engine call
    nll = 0.0
    for start in range(0, len(windows), per_batch):
        batch = windows[start:start + per_batch]
        for s in score_windows(generator.engine, batch, 0):
            nll -= s.total
        if progress is not None:
            progress.update(sum(len(t) for _, t in batch))
    return Perplexity(len(ids), nll, len(windows), n)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..runtime.device import add_device_arguments

    p.add_argument("path", metavar="DIR", nargs="?", default=None,
                   help="checkpoint directory (default: the embedded model)")
    p.add_argument("--text", required=True, metavar="FILE",
                   help="a UTF-8 text file, scored as one document ('-': standard input)")
    p.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="tokens predicted per rolling window (default: the model's context length)")
    add_device_arguments(p)


def run_eval(args: argparse.Namespace) -> int:
    from .generator import Generator

    if args.text != "-":
        check_regular_file(args.text, GenerationError, f"--text {args.text}")
    try:
        # utf-8-sig: a byte order mark some editors write first is not part of the text
        raw = sys.stdin.buffer.read() if args.text == "-" else Path(args.text).read_bytes()
        text = raw.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"--text {args.text}: {e}") from None
    if not text:
        source = "standard input" if args.text == "-" else "the file"
        raise GenerationError(f"--text {args.text}: {source} is empty: there is no text to score")
    generator = Generator.from_pretrained(args.path, device=args.device, dtype=args.dtype)
    if generator.tokenizer is None:
        raise GenerationError(f"{args.path}: the checkpoint has no tokenizer.json, so a text cannot be scored")
    ids = generator.encode(text)
    if not ids:
        raise GenerationError(f"--text {args.text}: the text has no tokens (only characters the tokenizer "
                              "drops): there is nothing to score")
    quiet = getattr(args, "quiet", False)
    scored = len(ids) - (rolling_prefix(generator) is None)  # without <|endoftext|> the first is not scored
    if scored < 1:
        raise GenerationError(f"--text {args.text}: the text is one token, and without an <|endoftext|> in the "
                              "tokenizer to read before it the first token is not scored: there is nothing to score")
    with Progress(total=scored, desc="scoring", unit="tok", unit_scale=True, enabled=not quiet) as bar:
        result = perplexity(generator, ids, args.max_length, bar)
    print(f"tokens      {result.tokens}")
    print(f"windows     {result.windows} of up to {result.max_length} tokens")
    print(f"mean NLL    {result.mean_nll:.6f} nats/token")
    print(f"perplexity  {result.perplexity:.6f}")
    sys.stdout.flush()
    return 0


__all__ = ["Perplexity", "add_arguments", "perplexity", "run_eval"]
