"""The server's ASGI guard: API key, request body (size limit, JSON check),
draining, HTTP metrics, and a last-resort error answer."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from starlette.responses import Response

from radixrt.server.api_keys import OPEN_PREFIXES
from radixrt.server.context import ServerContext
from radixrt.server.errors import ServerError
from radixrt.server.http_utils import SCOPE_JSON_KEY, error_response, parse_json_body_async
from radixrt.server.request_body import BodyTooLarge, ClientLeft, read_body, replaying

logger = logging.getLogger(__name__)

_BODY_METHODS = {"POST", "PUT", "PATCH"}


class GuardMiddleware:
    """Pure ASGI (streaming and disconnect detection pass through untouched):

    * API key on every route but /dashboard and, as SGLang, any path starting with /health, /ready
      or /metrics (probes and Prometheus scrapes need no secret; the metrics hold counts only) (401);
    * while the server drains for shutdown, 503 to every new request but
      /health, /metrics and /abort_request;
    * the request body is read here in full before the app runs: over the
      limit it is a 413 (at once when Content-Length says so, else when the
      bytes read pass it); a POST/PUT/PATCH body that is (or claims to be)
      JSON is parsed and checked by `parse_json_body` (400 on malformed
      UTF-8/JSON, too deep nesting, lone surrogates), and the parsed value is
      left in the scope for `read_json`. The app then reads the same bytes.
      A client that leaves mid-upload costs one log line at INFO;
    * an exception no handler took becomes a JSON 500 (logged once), and the
      connection stays usable;
    * in-flight requests are counted (``ctx.active_requests``; draining waits
      for them) and every answer in the HTTP metrics.
    """

    # /dashboard is the page's code only: everything it shows comes from routes that need the key
    OPEN_PATHS = ("/dashboard",)
    OPEN_PREFIXES = OPEN_PREFIXES
    OPEN_WHILE_DRAINING = ("/health", "/metrics", "/abort_request")

    def __init__(self, app: Any, ctx_getter: Callable[[], ServerContext]) -> None:
        self.app = app
        self.ctx_getter = ctx_getter
        self._paths: Optional[frozenset[str]] = None  # the app's route paths, read on first use

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = self.ctx_getter()
        path = scope.get("path", "")
        status_box = [0]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        ctx.active_requests += 1
        try:
            refusal = self._refusal(scope, ctx, path)
            if refusal is None:
                try:
                    body_receive = await self._read_body(scope, receive, ctx.max_request_bytes)
                except ClientLeft as e:
                    logger.info("%s %r: %s", scope.get("method"), path, e)  # %r: a client's path forges no line
                    return
                except ServerError as e:
                    refusal = error_response(e.status, e.message, e.param, e.err_type, path=path)
            if refusal is not None:
                await refusal(scope, receive, send_wrapper)
                return
            try:
                await self.app(scope, body_receive, send_wrapper)
            except Exception as exc:  # answered here, so that the connection stays usable
                logger.exception("unhandled error on %s %r", scope.get("method"), path)
                if not status_box[0]:
                    await error_response(500, f"Internal server error: {type(exc).__name__}: {exc}", path=path)(
                        scope, receive, send_wrapper
                    )
        finally:
            ctx.active_requests -= 1
            if status_box[0]:
                ctx.metrics.observe_http(self._route_label(scope, path), status_box[0])

    def _route_label(self, scope: dict, path: str) -> str:
        """The route an answer is counted under: the route the request matched (its path
        template, ``/v1/models/{model_id:path}``), else the path when it is one of the app's
        (a request refused before routing), else "other" (a bounded label set)."""
        route = scope.get("route")
        if route is not None:
            return str(getattr(route, "path", "other"))
        if self._paths is None:
            app = scope.get("app")
            self._paths = frozenset(str(getattr(r, "path", "")) for r in getattr(app, "routes", ()))
        return path if path in self._paths else "other"

    def _refusal(self, scope: dict, ctx: ServerContext, path: str) -> Optional[Response]:
        """The error answer for a request refused before its body is read, or None."""
        is_open = path in self.OPEN_PATHS or path.startswith(self.OPEN_PREFIXES)
        if not is_open and not ctx.authorized(scope.get("headers", [])):
            message = "Missing or invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')."
            return error_response(401, message, err_type="authentication_error", path=path)
        if ctx.draining and path not in self.OPEN_WHILE_DRAINING:
            resp = error_response(503, "The server is shutting down and takes no new requests.", path=path)
            resp.headers["connection"] = "close"
            return resp
        limit = ctx.max_request_bytes
        length = self._header(scope, b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return error_response(400, f"Invalid Content-Length header {length!r}.", path=path)
            if size > limit:
                message = f"The request body ({size} bytes) exceeds the limit of {limit} bytes."
                return error_response(413, message, path=path)
        return None

    async def _read_body(self, scope: dict, receive: Callable, limit: int) -> Callable:
        """Read the whole body (ServerError 413 past ``limit``, 400 for a bad
        JSON body; `ClientLeft` if the client leaves first); return a receive
        that hands the body to the app, then passes through."""
        try:
            body = await read_body(receive, limit)
        except BodyTooLarge:
            raise ServerError(413, f"The request body exceeds the limit of {limit} bytes.") from None
        if body.strip() and scope.get("method") in _BODY_METHODS and self._json_content(scope):
            scope[SCOPE_JSON_KEY] = await parse_json_body_async(body)
        return replaying(body, receive)

    @classmethod
    def _json_content(cls, scope: dict) -> bool:
        """Whether the body is JSON by its Content-Type (none counts: FastAPI parses it as JSON too)."""
        ctype = cls._header(scope, b"content-type")
        return ctype is None or "json" in ctype.lower()

    @staticmethod
    def _header(scope: dict, name: bytes) -> Optional[str]:
        for n, value in scope.get("headers", []):
            if n == name:
                return value.decode("latin-1")
        return None
