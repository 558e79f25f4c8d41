"""Exceptions raised by the frontend."""

from __future__ import annotations


class FrontendError(Exception):
    """Base of the frontend's own errors."""


class NoBackendError(FrontendError):
    pass


class BackendError(FrontendError):
    """A request to the backend failed (HTTP error, engine error, abort)."""


class UnsupportedByBackendError(FrontendError):
    """The program uses something the backend (or its API) cannot express."""


class UnsupportedModalityError(UnsupportedByBackendError):
    """Image/video input on a text-only model."""


class ProgramError(FrontendError):
    """Reading a variable whose request failed; ``__cause__`` is the original error."""


class StopTracing(Exception):
    """Internal: ends a tracing run early."""
