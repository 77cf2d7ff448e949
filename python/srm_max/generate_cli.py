"""``srm-max generate``: text in, text out, with progress on long runs.

Without ``--seed`` a sampled run draws a fresh seed and names it on stderr, so
``--seed`` with that value replays the run.
"""

from __future__ import annotations

import argparse
import sys

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


def run_generate(args: argparse.Namespace) -> int:
    from .embedded import model_dir
    from .serve.generator import Generator
    from .serve.sampling import resolve_seed

    path = model_dir(args.model)
    generator = Generator.from_pretrained(path, device=args.device, dtype=args.dtype)
    if generator.tokenizer is None:
        print(f"srm-max generate: error: {path} has no tokenizer.json; text prompts need one", file=sys.stderr)
        return 2
    seed = resolve_seed(getattr(args, "seed", None), "--seed")
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=seed, stop=args.stop)
    if args.temperature > 0:  # greedy output does not depend on the seed
        print(f"srm-max generate: seed {seed} (--seed {seed} replays this run)", file=sys.stderr)
    if args.stream:
        if len(args.prompt) != 1:
            print("srm-max generate: error: --stream takes exactly one prompt", file=sys.stderr)
            return 2
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
