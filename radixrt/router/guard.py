"""The router's ASGI guard: what every request passes before a route sees it.

In order: a request that already passed this router is a 508 (a loop, `RouterState.came_back`); a
path with ``.`` or ``..`` segments is a 400 (the worker would be sent the resolved path); every
route but ``/health`` and ``/dashboard`` needs the API key (401); while draining, 503; a body larger
than ``RouterConfig.max_request_bytes`` is a 413, at once when ``Content-Length`` says so, else as
soon as the bytes read pass it (so the front never holds more than that of one request, as a
single server does); then the route runs on the body read, and the count of answers in progress
(streams included, until their last byte) covers it. A client that leaves before its body is
complete costs one log line at INFO, not a traceback.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from fastapi import Request
from starlette.responses import Response

from radixrt.router.state import RouterState, error_response
from radixrt.server.api_keys import OPEN_PREFIXES, has_dot_segments
from radixrt.server.request_body import BodyTooLarge, ClientLeft, read_body, replaying

logger = logging.getLogger("radixrt.router")


class RouterGuard:
    def __init__(self, app: Any, state: RouterState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(Request(scope), scope["path"])
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        self.state.active += 1
        try:
            try:
                body = await read_body(receive, self.state.config.max_request_bytes)
            except ClientLeft as e:
                logger.info("%s %r: %s", scope.get("method"), scope["path"], e)  # %r: no forged lines
                return
            except BodyTooLarge:
                await self._too_large()(scope, receive, send)
                return
            await self.app(scope, replaying(body, receive), send)
        finally:
            self.state.active -= 1

    def _refusal(self, request: Request, path: str) -> Optional[Response]:
        """The answer to a request refused before its body is read, or None."""
        if self.state.came_back(request):
            return error_response(
                508, "Request loop: this request already passed this router (is the router one of its own workers?)."
            )
        if has_dot_segments(path):  # checked as one path, it would reach the worker as another
            return error_response(400, "The path holds '.' or '..' segments; send it resolved.")
        if path == "/health":
            return None
        # /dashboard is the page's code only (a browser sends no key for it): what it shows comes from
        # routes that need the key, as on a worker
        # (and, as SGLang, probes and scrapes: paths starting with /health, /ready or /metrics)
        if path != "/dashboard" and not path.startswith(OPEN_PREFIXES) and not self.state.authorized(request):
            return error_response(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")
        if self.state.draining:
            return error_response(503, "The server is shutting down.")
        length = request.headers.get("content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return error_response(400, f"Invalid Content-Length header {length[:40]!r}.")
            if size > self.state.config.max_request_bytes:
                return self._too_large(size)
        return None

    def _too_large(self, size: Optional[int] = None) -> Response:
        limit = self.state.config.max_request_bytes
        what = f"The request body ({size} bytes)" if size is not None else "The request body"
        return error_response(413, f"{what} exceeds the limit of {limit} bytes.")
