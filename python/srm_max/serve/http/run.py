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


def run_serve(args: argparse.Namespace) -> int:
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
    api_key = args.api_key if args.api_key is not None else os.environ.get("SRM_MAX_API_KEY") or None
    max_batch = max_batch_of(args.max_batch, generator.config)
    app = create_app(generator, model_name=name, max_batch=max_batch, max_waiting=args.max_waiting,
                     steps_per_call=args.steps_per_call, api_key=api_key, chat_template=find_chat_template(path))
    print(f"srm-max serve: {name} on http://{args.host}:{args.port}/v1 (max batch {max_batch}"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
