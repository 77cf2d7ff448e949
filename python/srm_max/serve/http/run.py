"""``srm-max serve``: load a model, build the app, run it under uvicorn.

Binds the loopback address by default: the server has no TLS, and without
``--api-key`` (or ``SRM_MAX_API_KEY``) anyone who reaches the port can use it.
"""

from __future__ import annotations

import argparse
import os
import sys

SERVE_MAX_BATCH = 256  # "auto" caps the memory plan here: beyond it a step's latency grows, not throughput


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ...runtime.device import add_device_arguments
    from ..sampling import DEFAULT_STEPS_PER_CALL

    p.add_argument("--model", default=None, metavar="DIR", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the directory's name, or srm-max for the embedded one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", default="auto",
                   help=f"most samples decoded together, or auto (what fits in memory, at most {SERVE_MAX_BATCH})")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="most samples waiting for a slot; beyond it requests get 429 (default 1024)")
    p.add_argument("--steps-per-call", type=int, default=DEFAULT_STEPS_PER_CALL,
                   help="decode steps per engine call, so tokens per streamed chunk: more is faster (each chunk "
                        f"costs HTTP work on the engine's cores), fewer lets requests join sooner (default "
                        f"{DEFAULT_STEPS_PER_CALL}, as Generator.generate)")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="memory for the prefix-state cache: a prompt that begins with a prompt (or a shared prefix) "
                        "seen before prefills only the rest; 0 turns it off (default 64; SRM models only)")
    add_device_arguments(p)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every request (default: $SRM_MAX_API_KEY)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def max_batch_of(value: str, config) -> int:
    from ...errors import GenerationError
    from ..sample_many import plan_max_batch

    if value == "auto":
        return min(SERVE_MAX_BATCH, plan_max_batch(config))
    if not value.isdigit() or int(value) < 1:
        raise GenerationError(f"--max-batch must be 'auto' or an integer >= 1, got {value!r}")
    return int(value)


def checked_options(args: argparse.Namespace) -> str | None:
    """Refuse bad options before the model loads (GenerationError naming the option); -> the
    API key (None: no key)."""
    from ...errors import GenerationError

    if not 0 <= args.port <= 65535:
        raise GenerationError(f"--port must be from 0 to 65535, got {args.port}")
    for option, value in (("--max-waiting", args.max_waiting), ("--steps-per-call", args.steps_per_call)):
        if value < 1:
            raise GenerationError(f"{option} must be an integer >= 1, got {value}")
    if args.api_key is None:
        return os.environ.get("SRM_MAX_API_KEY") or None
    # a client sends the key in an HTTP header: printable ASCII, as every client library writes it
    if not args.api_key or not all(33 <= ord(c) <= 126 for c in args.api_key):
        raise GenerationError("--api-key must be a non-empty string of printable ASCII characters without spaces")
    return args.api_key


def run_serve(args: argparse.Namespace) -> int:
    api_key = checked_options(args)
    try:
        import uvicorn

        from .app import create_app
    except ImportError as e:
        print(f"srm-max serve: error: {e.name} is missing; install the serve extra: pip install 'srm-max[serve]'",
              file=sys.stderr)
        return 2
    from ...embedded import model_dir
    from ..generator import Generator
    from .chat import find_chat_template

    path = model_dir(args.model)
    name = args.model_name or ("srm-max" if args.model is None else path.resolve().name)
    generator = Generator.from_pretrained(path, device=args.device, dtype=args.dtype,
                                          prefix_cache_mb=args.prefix_cache_mb)
    max_batch = max_batch_of(args.max_batch, generator.config)

    def engine_failed(error: BaseException) -> None:
        # every later request would get a 503: exit instead, so that a supervisor restarts the server
        server.should_exit = True

    app = create_app(generator, model_name=name, max_batch=max_batch, max_waiting=args.max_waiting,
                     steps_per_call=args.steps_per_call, api_key=api_key, chat_template=find_chat_template(path),
                     on_engine_failure=engine_failed)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    print(f"srm-max serve: {name} on http://{args.host}:{args.port}/v1 (max batch {max_batch}"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    server.run()
    failure = app.state.server.engine_loop.failure
    if failure is not None:
        print(f"srm-max serve: error: the engine loop failed: {failure}", file=sys.stderr)
        return 1
    return 0
