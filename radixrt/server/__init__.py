"""The HTTP server: SGLang-native and OpenAI-compatible APIs over a
multi-process runtime.

Processes (started with multiprocessing "spawn", ZMQ PUSH/PULL on ``ipc://``
sockets in a private temporary folder):

* main: FastAPI + uvicorn and the asyncio TokenizerManager (tokenize, chat
  templates, validation -> 400, request state, results, metrics, watchdog);
* scheduler: ``radixrt.scheduler.scheduler.Scheduler.event_loop`` fed over ZMQ;
* detokenizer: one IncrementalDetokenizer per request.

Routes: ``POST /generate`` (SGLang wire format, single/batch, text/input_ids,
logprobs, ``stream`` as ``data: {...}`` events closed by ``data: [DONE]``),
``GET /get_model_info`` (``/model_info``), ``GET /get_server_info``
(``/server_info``), ``GET /health``, ``GET /health_generate``,
``POST /flush_cache``, ``POST /abort_request``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /metrics``
(Prometheus), ``GET /debug/kv`` (KV slots: free, tree, private, total),
``GET /debug/radix``, ``GET /debug/stream`` and ``GET /dashboard`` (the
cache's live view, debug_routes.py).

`radixrt serve` (or ``python -m radixrt.server``) takes the flags of
:func:`add_serve_args` (radixrt/server/args.py) and runs :func:`launch_server`
(radixrt/cli.py; with ``--dp N``, the replicas of radixrt/router/dp.py instead);
:class:`radixrt.server.local.LocalServer` runs one as a subprocess. The heavy
modules load only when a server starts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_serve_args", "serve_main", "launch_server", "ServerArgs"]


def __getattr__(name: str) -> Any:
    if name in ("add_serve_args", "ServerArgs"):
        from radixrt.server import args

        return getattr(args, name)
    if name in __all__:
        from radixrt.server import launch

        return getattr(launch, name)
    raise AttributeError(name)
