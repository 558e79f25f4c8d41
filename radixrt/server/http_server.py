"""The FastAPI app: the native, OpenAI, Anthropic and admin routers over one
`ServerContext`, behind `GuardMiddleware`.

Error bodies follow OpenAI's shape on every route:
``{"error": {"message", "type", "param", "code"}}``, but Anthropic's on its
Messages routes (`radixrt.server.errors.anthropic_error_body`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from radixrt.requests.intake import RequestError
from radixrt.server import (
    admin_routes,
    anthropic_api,
    debug_routes,
    load_routes,
    lora_routes,
    native_routes,
    openai_api,
    responses_api,
    score_routes,
    session_routes,
    text_parse_routes,
    tokenize_routes,
    weight_routes,
)
from radixrt.server.context import ServerContext
from radixrt.server.errors import ServerError
from radixrt.server.http_utils import error_response
from radixrt.server.middleware import GuardMiddleware
from radixrt.server.protocol import field_path

__all__ = ["ServerContext", "build_app"]

logger = logging.getLogger(__name__)


def build_app(ctx: ServerContext, lifespan: Any = None) -> FastAPI:
    """The server's app; ``ctx`` is what every route reads (``app.state.ctx``)."""
    app = FastAPI(title="radixrt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.add_middleware(GuardMiddleware, ctx_getter=lambda: app.state.ctx)
    _add_error_handlers(app)
    routes = (admin_routes, anthropic_api, debug_routes, lora_routes, native_routes, openai_api, responses_api)
    others = (load_routes, score_routes, session_routes, text_parse_routes, tokenize_routes, weight_routes)
    for module in routes + others:
        app.include_router(module.router)
    return app


def _validation_message(exc: RequestValidationError) -> tuple[str, Any]:
    """(message, param) for a request body that failed its pydantic model."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    field_name = field_path(first.get("loc", ()))
    msg = first.get("msg", "invalid request")
    if field_name:
        message = f"Invalid value for '{field_name}': {msg}"
        if "input" in first and kind != "missing":
            message += f" (got {first['input']!r})"
    else:
        message = f"Invalid request: {msg}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return message, field_name


def _error(request: Request, status: int, message: str, param: Any = None, err_type: Any = None) -> Response:
    """OpenAI's error answer, or Anthropic's on its Messages routes."""
    return error_response(status, message, param, err_type, path=request.url.path)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error becomes an OpenAI-shaped (or Anthropic-shaped) body with the right status."""

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError) -> Response:
        return _error(request, exc.status, exc.message, exc.param, exc.err_type)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        return _error(request, 400, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return _error(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        cause = exc.__cause__
        if isinstance(cause, ServerError):  # e.g. the body limit hit while FastAPI read a model's body
            return _error(request, cause.status, cause.message, cause.param, cause.err_type)
        message = {404: "Not found: no such route.", 405: "Method not allowed on this route."}.get(
            exc.status_code, str(exc.detail)
        )
        return _error(request, exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return _error(request, 500, f"Internal server error: {type(exc).__name__}: {exc}")
