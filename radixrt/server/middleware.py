"""The server's ASGI guard: API key, request body limit, HTTP metrics."""
from __future__ import annotations

from typing import Any, Callable, Optional

from starlette.responses import Response

from radixrt.server.context import ServerContext
from radixrt.server.errors import ServerError
from radixrt.server.http_utils import error_response

# Paths counted by name in the HTTP metrics; anything else counts as "other".
KNOWN_ROUTES = {
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/health_generate",
    "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/flush_cache", "/abort_request",
    "/metrics", "/debug/kv",
}


class GuardMiddleware:
    """API key (every route but /health), request body size limit, HTTP metrics.
    Pure ASGI, so streaming and disconnect detection pass through untouched.

    A body over the limit is a 413: at once when Content-Length says so,
    else when the bytes read pass it (raised as ServerError from ``receive``)."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app: Any, ctx_getter: Callable[[], ServerContext]) -> None:
        self.app = app
        self.ctx_getter = ctx_getter

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

        try:
            refusal = self._refusal(scope, ctx, path)
            if refusal is not None:
                await refusal(scope, receive, send_wrapper)
                return
            await self.app(scope, self._limited(receive, ctx.max_request_bytes), send_wrapper)
        finally:
            if status_box[0]:
                ctx.metrics.observe_http(path if path in KNOWN_ROUTES else "other", status_box[0])

    def _refusal(self, scope: dict, ctx: ServerContext, path: str) -> Optional[Response]:
        """The error answer for a request refused before it runs, or None."""
        if ctx.api_key and path not in self.OPEN_PATHS and not self._authorized(scope, ctx.api_key):
            return error_response(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                                  err_type="authentication_error")
        limit = ctx.max_request_bytes
        length = self._content_length(scope)
        if length is not None and length > limit:
            return error_response(413, f"The request body ({length} bytes) exceeds the limit of {limit} bytes.")
        return None

    @staticmethod
    def _limited(receive: Callable, limit: int) -> Callable:
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise ServerError(413, f"The request body exceeds the limit of {limit} bytes.")
            return message

        return limited_receive

    @staticmethod
    def _authorized(scope: dict, key: str) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                v = value.decode("latin-1").strip()
                if v.lower().startswith("bearer ") and v[7:].strip() == key:
                    return True
            elif name == b"x-api-key" and value.decode("latin-1").strip() == key:
                return True
        return False

    @staticmethod
    def _content_length(scope: dict) -> Optional[int]:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None
