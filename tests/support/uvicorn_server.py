"""An ASGI app served for a test: uvicorn in a thread on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager


@contextmanager
def serving(app, start_limit_s: float = 60.0):
    """Serve ``app`` until the block ends; yields its base URL (``http://127.0.0.1:PORT``)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_limit_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
