"""``srm-max generate``: text in, text out, with progress on long runs.

Without ``--seed`` a sampled run draws a fresh seed and names it on stderr, so
``--seed`` with that value replays the run.
"""

from __future__ import annotations

import argparse
import sys

from .errors import GenerationError
from .progress import Progress


class ProgressLine:
    """``progress(done, total)`` for ``Generator.generate``: new tokens on stderr (the package's
    ``Progress``), on a terminal, for runs longer than a second."""

    def __init__(self, enabled: bool):
        self.bar = Progress(desc="generating", unit="tok", enabled=enabled, delay=1.0)

    def __call__(self, done: int, total: int) -> None:
        self.bar.update_to(done, total)

    def close(self) -> None:
        self.bar.close()


def command_line_text(value: str, name: str) -> str:
    """``value``, a text argument, if its bytes are UTF-8: Python reads bytes that are not as
    lone surrogates (U+DC80 to U+DCFF), which no tokenizer can read."""
    try:
        value.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError as e:
        where = f": byte {e.start} is {e.object[e.start]:#04x}" if isinstance(e, UnicodeDecodeError) else ""
        raise GenerationError(f"{name} is not valid UTF-8 text{where}") from None
    return value


def run_generate(args: argparse.Namespace) -> int:
    """Every argument is checked (the prompts' text, the tokenizer's presence, the sampling
    options) before anything is printed, and the tokenizer before the engine is built."""
    from .checkpoints.format import TOKENIZER_FILE
    from .embedded import model_dir
    from .serve.generator import Generator
    from .serve.sampling import resolve_seed

    for i, prompt in enumerate(args.prompt):
        command_line_text(prompt, f"prompt {i}")
    for stop in args.stop or ():
        command_line_text(stop, "--stop")
    if args.stream and len(args.prompt) != 1:
        raise GenerationError("--stream takes exactly one prompt")
    path = model_dir(args.model)
    if path.is_dir() and not (path / TOKENIZER_FILE).exists():
        raise GenerationError(f"{path} has no {TOKENIZER_FILE}; text prompts need one")
    seed = resolve_seed(getattr(args, "seed", None), "--seed")
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=seed, stop=args.stop)
    generator = Generator.from_pretrained(path, device=args.device, dtype=args.dtype)
    generator.check(args.prompt, **options)
    if args.temperature > 0:  # greedy output does not depend on the seed
        print(f"srm-max generate: seed {seed} (--seed {seed} replays this run)", file=sys.stderr)
    if args.stream:
        print(args.prompt[0], end="", flush=True)
        for event in generator.stream(args.prompt, **options):
            print(event.texts.get(0, ""), end="", flush=True)
        print()
        return 0
    progress = ProgressLine(enabled=sys.stderr.isatty())
    completions = generator.generate(list(args.prompt), progress=progress, **options)
    progress.close()
    for prompt, completion in zip(args.prompt, completions):
        if len(args.prompt) > 1:
            print(f"--- [{completion.finish_reason}]")
        print(prompt + completion.text)
    return 0
