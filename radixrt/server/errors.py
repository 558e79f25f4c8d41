"""Errors answered to HTTP clients, in OpenAI's body shape on every route:
``{"error": {"message", "type", "param", "code"}}``; on Anthropic's Messages routes
(``/v1/messages...``) in Anthropic's: ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from radixrt.requests.intake import RequestError

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class ServerError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, err_type: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status, "server_error")


def bad_request(message: str, param: Optional[str] = None) -> ServerError:
    """A 400 naming the request field ``param``."""
    return ServerError(400, message, param)


def error_body(status: int, message: str, param: Optional[str] = None, err_type: Optional[str] = None) -> dict:
    """The JSON body of an error answer (also sent as an SSE event mid-stream)."""
    e = ServerError(status, message, param, err_type)
    return {"error": {"message": message, "type": e.err_type, "param": param, "code": status}}


ANTHROPIC_PREFIX = "/v1/messages"  # the routes that answer errors in Anthropic's shape
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error body (also its stream's ``error`` event)."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


@contextlib.contextmanager
def as_bad_request() -> Iterator[None]:
    """Re-raise the front door's RequestError as a 400 ServerError with its param."""
    try:
        yield
    except RequestError as e:
        raise bad_request(e.message, e.param) from None
