"""The ``srm-max`` command line: convert, generate, compile, verify, serve, eval, train."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .errors import SRMError
from .files import check_no_empty_paths

# The arguments of each command that name a file or folder, by attribute and how the usage names
# them: an empty one is refused (files.check_no_empty_paths).
_PATH_ARGUMENTS = {
    "convert": {"src": "SRC", "dst": "DST", "tokenizer": "--tokenizer", "config": "--config"},
    "generate": {"model": "--model"},
    "compile": {"path": "DIR"},
    "verify": {"path": "DIR"},
    "eval": {"path": "DIR", "text": "--text"},
}


def _check_paths(args: argparse.Namespace) -> None:
    check_no_empty_paths(args, _PATH_ARGUMENTS.get(args.command, {}), SRMError)


class _OutputError(Exception):
    """Writing the command's output (stdout) failed: a full disk, a closed terminal."""


class _Output:
    """``sys.stdout`` while a command runs: a failed write raises ``_OutputError``, so that it is
    told apart from the OSErrors of the files the command reads and writes. A reader that went
    away stays a ``BrokenPipeError``, which is not an error to report."""

    def __init__(self, stream):
        self._stream = stream

    def _checked(self, method, *args):
        try:
            return method(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _OutputError(e.strerror or str(e)) from e

    def write(self, text: str) -> int:
        return self._checked(self._stream.write, text)

    def flush(self) -> None:
        self._checked(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of what could not be
    written does not fail again (with a message of its own and exit status 120)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout without a file descriptor (a test's capture)
        pass


def _convert(args: argparse.Namespace) -> int:
    from .checkpoints.convert import convert, parse_override

    overrides = dict(parse_override(o) for o in args.override)
    certificate = convert(
        args.src, args.dst, dtype=args.dtype, tokenizer=args.tokenizer, overrides=overrides, config=args.config,
        force=args.force, parity_tokens=args.parity_tokens,
    )
    print(f"wrote {args.dst}")
    print(json.dumps({k: certificate[k] for k in ("tokens", "max_abs_delta", "tolerance", "passed")}, indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .generate_cli import run_generate

    return run_generate(args)


def _compile(args: argparse.Namespace) -> int:
    import time

    from .runtime.compile_cache import cache_dir
    from .serve.generator import Generator

    t = time.perf_counter()
    generator = Generator.from_pretrained(args.path, device=args.device, dtype=args.dtype, warmup=False)
    engine = generator.engine
    engine.warmup()  # cold graphs compile side by side, with progress on stderr
    kinds = engine.graph_kinds()
    print(f"ready: {', '.join(kinds)} graphs ({engine.dtype}, {engine.graph_job(kinds[0]).device}) "
          f"in {time.perf_counter() - t:.0f} s, cached under {cache_dir() / 'mef'}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .checkpoints.verify import verify

    checks = verify(args.path, engine=not args.no_engine)
    for check in checks:
        print(f"{'ok  ' if check.passed else 'FAIL'} {check.name}: {check.detail}")
    return 0 if all(c.passed for c in checks) else 1


def _serve(args: argparse.Namespace) -> int:
    from .serve.http.run import run_serve

    return run_serve(args)


def _eval(args: argparse.Namespace) -> int:
    from .serve.evaluate import run_eval

    return run_eval(args)


def _train(args: argparse.Namespace) -> int:
    from .train import main as train_main

    return train_main(args.arguments) or 0


def _show_progress(on: bool) -> None:
    """The package's log messages (what is compiling, for how long) on stderr."""
    logger = logging.getLogger("srm_max")
    if on and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("srm-max: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # a root handler (set up by other libraries) would print it twice
    logger.setLevel(logging.INFO if on else logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    from .checkpoints.safetensors_io import FLOAT_DTYPES as STORED_DTYPES
    from .runtime.device import add_device_arguments

    parser = argparse.ArgumentParser(prog="srm-max", description="Structured Recurrent Mixers on MAX")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress messages on stderr (such as what is being compiled)")
    sub = parser.add_subparsers(dest="command", required=True)
    # --quiet after the command too; SUPPRESS keeps the subcommand from resetting it
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="no progress messages on stderr")

    p = sub.add_parser("convert", parents=[quiet], help="convert a PyTorch/safetensors SRM checkpoint, with a parity certificate")
    p.add_argument("src", help="state-dict file (.pt/.pth/.bin), .safetensors file, or Trainer checkpoint folder")
    p.add_argument("dst", help="output checkpoint directory")
    p.add_argument("--dtype", choices=list(STORED_DTYPES), help="weights dtype (default: the source's)")
    p.add_argument("--tokenizer", help="tokenizer.json to copy into the checkpoint")
    p.add_argument("--config", help="config.json to use instead of inferring it (required for PHA)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config field to set instead of inferring it (JSON value), repeatable")
    p.add_argument("--parity-tokens", type=int, default=None, help="tokens per sequence in the parity check (default 256)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")

    g = sub.add_parser("generate", parents=[quiet], help="generate text with a model (default: the embedded one)")
    g.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: a fresh one, printed so the run can be replayed)")
    g.add_argument("--stop", action="append", default=None, help="stop string, repeatable")
    add_device_arguments(g)
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated (one prompt)")

    c = sub.add_parser("compile", parents=[quiet],
                       help="compile a model's graphs for this machine now, so its first generate starts at once")
    c.add_argument("path", nargs="?", default=None, metavar="DIR",
                   help="checkpoint directory (default: the embedded model)")
    add_device_arguments(c, dtype_help="the dtype generate will run in (default: the checkpoint's)")

    v = sub.add_parser("verify", parents=[quiet], help="re-check a model directory: integrity, parity, MAX against the reference")
    v.add_argument("path", help="checkpoint directory")
    v.add_argument("--no-engine", action="store_true", help="skip the MAX-against-reference check")

    s = sub.add_parser("serve", parents=[quiet], help="an OpenAI-compatible HTTP server with continuous batching")
    from .serve.http.run import add_arguments as add_serve_arguments  # argparse only: no web packages

    add_serve_arguments(s)

    e = sub.add_parser("eval", parents=[quiet],
                       help="the perplexity of a text file under a model (lm-eval's rolling windows)")
    from .serve.evaluate import add_arguments as add_eval_arguments

    add_eval_arguments(e)

    sub.add_parser("train", help="train a reference model (see `srm-max train --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "train":
        # train parses its own arguments (it is also `python -m srm_max.train`); its errors are reported below
        args = argparse.Namespace(command="train", arguments=argv[1:])
    else:
        args = build_parser().parse_args(argv)
        _show_progress(not args.quiet)
    stdout = sys.stdout
    sys.stdout = _Output(stdout)
    try:
        _check_paths(args)
        status = {"convert": _convert, "generate": _generate, "compile": _compile, "verify": _verify,
                  "serve": _serve, "eval": _eval, "train": _train}[args.command](args)
        sys.stdout.flush()  # a failed write of buffered output is reported here, not at exit
        return status
    except _OutputError as e:
        print(f"srm-max {args.command}: error: cannot write the output to stdout: {e}", file=sys.stderr)
        sys.stdout = stdout
        _discard_stdout()
        return 1
    except SRMError as e:
        print(f"srm-max {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"srm-max {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # whoever read the output went away (``... | head``): nothing to report
        sys.stdout = stdout
        _discard_stdout()
        return 1
    finally:
        if isinstance(sys.stdout, _Output):
            sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
