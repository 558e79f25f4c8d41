"""radixrt: a runtime for structured LLM programs built around RadixAttention.

``import radixrt`` stays light (no torch): heavy names such as `Engine` load
on first use.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from radixrt.frontend import *  # noqa: F401,F403  (the DSL: function, gen, select, fork, roles, ...)
from radixrt.frontend import __all__ as _frontend_all

_LAZY = {
    "Engine": ("radixrt.engine", "Engine"),
    "EngineConfig": ("radixrt.config", "EngineConfig"),
    "SamplingParams": ("radixrt.sampling_params", "SamplingParams"),
    "RuntimeEndpoint": ("radixrt.frontend.runtime_endpoint", "RuntimeEndpoint"),
    "Runtime": ("radixrt.frontend.runtime_endpoint", "Runtime"),
    "OpenAI": ("radixrt.frontend.openai_backend", "OpenAI"),
    "EngineBackend": ("radixrt.frontend.engine_backend", "EngineBackend"),
}
__all__ = list(_frontend_all) + list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")
