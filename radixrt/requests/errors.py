"""The error every front-door check raises."""

from __future__ import annotations

from typing import Optional


class RequestError(ValueError):
    """A request that can never be served. ``param`` names the request field
    at fault (OpenAI's error ``param``), or is None."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
