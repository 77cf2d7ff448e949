"""``srm-max serve``: load a model, build the app, run it under uvicorn.

Binds the loopback address by default: the server has no TLS, and without
``--api-key`` (or ``SRM_MAX_API_KEY``) anyone who reaches the port can use it.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import sys

# an explicit --max-batch above the plan's cap is refused at once, and once the model has loaded
# above what the device's memory holds (max_batch_of)
from ..sampling import MAX_SLOTS as MAX_BATCH

SERVE_MAX_BATCH = 256  # "auto" caps the memory plan here: beyond it a step's latency grows, not throughput
# Waiting samples hold their prompts (and their requests) in memory until a slot frees up: the
# queue's length bounds that memory, and this bounds the queue's length.
MAX_WAITING = 1 << 20
# A call's steps are one streamed chunk, and a request that arrives during a call waits for its
# end; the scheduler never runs more steps than a sample can still take, so a bigger value only
# turns a stream into one answer.
MAX_STEPS_PER_CALL = 1024
_MEMORY_UNKNOWN_MB = 1 << 20  # --prefix-cache-mb's bound where the machine's memory cannot be read


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ...runtime.device import add_device_arguments
    from ..sampling import DEFAULT_STEPS_PER_CALL

    p.add_argument("--model", default=None, metavar="DIR", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the directory's name, or srm-max for the embedded one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on; 0 takes a free one, printed at the start (default 8000)")
    p.add_argument("--max-batch", default="auto",
                   help=f"most samples decoded together: 1 to {MAX_BATCH}, no more than the device's memory holds, "
                        f"or auto (what fits a 4 GiB plan, at most {SERVE_MAX_BATCH})")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help=f"most samples waiting for a slot, 1 to {MAX_WAITING}; beyond it requests get 429 "
                        "(default 1024)")
    p.add_argument("--steps-per-call", type=int, default=DEFAULT_STEPS_PER_CALL,
                   help=f"decode steps per engine call (1 to {MAX_STEPS_PER_CALL}), so tokens per streamed chunk: "
                        "more is faster (each chunk costs HTTP work on the engine's cores), fewer lets requests join "
                        f"sooner (default {DEFAULT_STEPS_PER_CALL}, as Generator.generate)")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="memory for the prefix-state cache: a prompt that begins with a prompt (or a shared prefix) "
                        "seen before prefills only the rest; 0 turns it off, at most the machine's memory "
                        "(default 64; SRM models only)")
    add_device_arguments(p)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every request (default: $SRM_MAX_API_KEY)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def machine_memory_mb() -> float:
    """The machine's physical memory in MiB (``_MEMORY_UNKNOWN_MB`` where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 20)
    except (AttributeError, ValueError, OSError):
        return _MEMORY_UNKNOWN_MB


def device_memory_bytes(engine) -> int:
    """The memory of the device ``engine`` runs on (the machine's for the CPU or an engine without one)."""
    try:
        return int(engine.device.stats["total_memory"])
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError):
        return int(machine_memory_mb() * (1 << 20))


def parsed_max_batch(value: str) -> int | None:
    """``--max-batch`` as a number of slots (None: auto), within 1 to ``MAX_BATCH``."""
    from ...errors import GenerationError
    from ..sampling import brief_repr

    if value == "auto":
        return None
    # isdigit alone takes "²", which int() refuses; the length keeps int() within its digit limit
    if not (value.isascii() and value.isdigit() and len(value) <= len(str(MAX_BATCH))) \
            or not 1 <= int(value) <= MAX_BATCH:
        raise GenerationError(f"--max-batch must be 'auto' or an integer from 1 to {MAX_BATCH}, got "
                              f"{brief_repr(value)}")
    return int(value)


def max_batch_of(value: str, config, memory_bytes: int | None = None, weight_bytes_per_param: int = 4) -> int:
    """The slots for ``--max-batch``: auto's plan, or the number asked for, refused when it is more
    than ``memory_bytes`` (the device's memory; None: not checked) holds beside the weights."""
    from ...errors import GenerationError
    from ..sample_many import plan_max_batch

    asked = parsed_max_batch(value)
    if asked is None:
        return min(SERVE_MAX_BATCH, plan_max_batch(config))
    if memory_bytes is not None:
        try:
            fits = plan_max_batch(config, memory_bytes, weight_bytes_per_param, max_batch=MAX_BATCH)
        except GenerationError:  # the plan's estimate of the weights is off: the model has loaded
            return asked
        if asked > fits:
            raise GenerationError(f"--max-batch {asked} does not fit the device's {memory_bytes / 2**20:.0f} MiB "
                                  f"of memory: at most {fits} samples' states and activations do")
    return asked


def checked_options(args: argparse.Namespace) -> str | None:
    """Refuse bad options before the model loads (GenerationError naming the option); -> the
    API key (None: no key)."""
    from ...errors import GenerationError
    from ..sampling import brief_repr

    if not 0 <= args.port <= 65535:
        raise GenerationError(f"--port must be from 0 to 65535, got {brief_repr(args.port)}")
    parsed_max_batch(args.max_batch)
    for option, value, most in (("--max-waiting", args.max_waiting, MAX_WAITING),
                                ("--steps-per-call", args.steps_per_call, MAX_STEPS_PER_CALL)):
        if not 1 <= value <= most:
            raise GenerationError(f"{option} must be an integer from 1 to {most}, got {brief_repr(value)}")
    mb = args.prefix_cache_mb
    if mb is not None and not (math.isfinite(mb) and 0 <= mb <= machine_memory_mb()):
        raise GenerationError(f"--prefix-cache-mb must be a finite number from 0 to {machine_memory_mb():.0f} "
                              f"(the machine's memory in MiB; 0 turns the cache off), got {mb:g}")
    if args.api_key is None:
        return os.environ.get("SRM_MAX_API_KEY") or None
    # a client sends the key in an HTTP header: printable ASCII, as every client library writes it
    if not args.api_key or not all(33 <= ord(c) <= 126 for c in args.api_key):
        raise GenerationError("--api-key must be a non-empty string of printable ASCII characters without spaces")
    return args.api_key


def bound_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` at ``port``, as uvicorn's own server binds them
    (asyncio's create_server), but before it starts: not listening yet, so a client is refused
    rather than left waiting while the model loads. A failure is a GenerationError naming both."""
    from ...errors import GenerationError
    from ..sampling import brief_repr

    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        skipped = None
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as e:  # a family this machine does not run (IPv6 off)
                skipped = e
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
            if family == socket.AF_INET6:  # else Linux's dual stack would claim the IPv4 socket's port too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # every address on the one port that is printed
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
                sockets.pop().close()  # as asyncio takes it: that family is not enabled here
                skipped = e
        if not sockets:
            raise skipped or OSError("no address to bind")
    except (OSError, UnicodeError, ValueError) as e:
        # OSError: a busy port, an address not of this machine, a name that does not resolve;
        # UnicodeError and ValueError: a name the resolver cannot even encode (empty labels, NUL)
        for sock in sockets:
            sock.close()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise GenerationError(f"cannot listen on --host {brief_repr(host)} --port {port}: {reason}") from None
    return sockets


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_serve(args: argparse.Namespace) -> int:
    api_key = checked_options(args)
    try:  # the serve extra's packages, asked for before anything else is done
        import uvicorn  # noqa: F401

        from .app import create_app  # noqa: F401
    except ImportError as e:
        print(f"srm-max serve: error: {e.name} is missing; install the serve extra: pip install 'srm-max[serve]'",
              file=sys.stderr)
        return 2
    # bound before the model loads: a busy port or a bad host fails in a second, not after the load
    sockets = bound_sockets(args.host, args.port)
    try:
        return _serve(args, api_key, sockets)
    finally:
        for sock in sockets:
            sock.close()


def _serve(args: argparse.Namespace, api_key: str | None, sockets: list[socket.socket]) -> int:
    import uvicorn

    from ...embedded import model_dir
    from ...runtime.device import DTYPES
    from ..generator import Generator
    from .app import create_app
    from .chat import find_chat_template

    path = model_dir(args.model)
    name = args.model_name or ("srm-max" if args.model is None else path.resolve().name)
    generator = Generator.from_pretrained(path, device=args.device, dtype=args.dtype,
                                          prefix_cache_mb=args.prefix_cache_mb)
    engine = generator.engine
    dtype = DTYPES.get(getattr(engine, "dtype", None))
    max_batch = max_batch_of(args.max_batch, generator.config, device_memory_bytes(engine),
                             dtype.size_in_bytes if dtype is not None else 4)

    def engine_failed(error: BaseException) -> None:
        # every later request would get a 503: exit instead, so that a supervisor restarts the server
        server.should_exit = True

    app = create_app(generator, model_name=name, max_batch=max_batch, max_waiting=args.max_waiting,
                     steps_per_call=args.steps_per_call, api_key=api_key, chat_template=find_chat_template(path),
                     on_engine_failure=engine_failed)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    server = uvicorn.Server(config)
    for sock in sockets:
        sock.listen(config.backlog)  # from here a client that read the URL below is answered
    print(f"srm-max serve: {name} on {url_of(args.host, sockets[0].getsockname()[1])}/v1 (max batch {max_batch}"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    server.run(sockets=sockets)
    failure = app.state.server.engine_loop.failure
    if failure is not None:
        print(f"srm-max serve: error: the engine loop failed: {failure}", file=sys.stderr)
        return 1
    return 0
