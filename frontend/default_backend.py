"""Which backend a program runs on.

``backend=`` when given, else the process-wide default set with
:func:`set_default_backend`. A ``radixrt.Engine`` (anything with
``generate`` / ``async_generate`` that is not a :class:`BaseBackend`) is
wrapped once in the in-process :class:`EngineBackend`.
"""

from __future__ import annotations

from typing import Any, Optional

from .backend import BaseBackend
from .engine_backend import backend_for_engine
from .errors import NoBackendError
from .global_config import global_config


def set_default_backend(backend: Any) -> None:
    """Backend for programs run without ``backend=``: an ``Engine`` (wrapped
    automatically), ``RuntimeEndpoint``, ``Runtime`` or ``OpenAI``."""
    global_config.default_backend = backend


def get_default_backend() -> Any:
    return global_config.default_backend


def resolve_backend(backend: Any = None) -> BaseBackend:
    """The backend to run on: ``backend``, else the default one.
    ``NoBackendError`` when there is neither; ``TypeError`` for an object
    that is no backend and no engine."""
    b = backend if backend is not None else global_config.default_backend
    if b is None:
        raise NoBackendError(
            "no backend: call radixrt.set_default_backend(radixrt.Engine()) "
            "(or RuntimeEndpoint(url) / Runtime(...) / OpenAI(model)), or pass backend=..."
        )
    if isinstance(b, BaseBackend):
        return b
    if hasattr(b, "async_generate") or hasattr(b, "generate"):
        return backend_for_engine(b)
    raise TypeError(f"{type(b).__name__} is not a radixrt backend")


def backend_or_none(backend: Any = None) -> Optional[BaseBackend]:
    """Like :func:`resolve_backend`, but None when there is no backend at all."""
    b = backend if backend is not None else global_config.default_backend
    return None if b is None else resolve_backend(b)
