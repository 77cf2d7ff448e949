"""``srm-max serve``: an OpenAI-compatible HTTP server with continuous batching.

    from srm_max.serve.http import create_app
    app = create_app(generator, model_name="srm-max", max_batch=64)   # a FastAPI app
    # or: srm-max serve --model DIR --port 8000

Modules: ``app`` (routes), ``protocol`` (request checks, response shapes),
``engine_loop`` (the thread that runs the engine), ``sequence`` (a request's samples),
``guard`` (API key, body limit), ``metrics`` (Prometheus), ``chat``
(chat templates), ``run`` (the command). Needs the ``serve`` extra.
"""

__all__ = ["create_app"]


def __getattr__(name):
    # lazily, so that ``srm-max --help`` (which reads ``run``'s arguments) needs no web packages
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
