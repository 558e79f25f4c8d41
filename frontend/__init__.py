"""radixrt.frontend: the structured-program language (SGLang-compatible).

Imports no torch. What needs heavier packages loads on first use: the
engine (torch) and the HTTP backends (httpx) through ``__getattr__``, the
openai package when an ``OpenAI`` backend is created.

    import radixrt as rt

    @rt.function
    def qa(s, question):
        s += rt.user(question)
        s += rt.assistant(rt.gen("answer", max_tokens=64))

    rt.set_default_backend(rt.Engine())
    print(qa.run(question="What is 2+2?", temperature=0)["answer"])
"""

from __future__ import annotations

from typing import Any

from .api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from .backend import BaseBackend
from .choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from .engine_backend import EngineBackend as EngineBackend  # light: the engine itself (torch) loads only when created
from .errors import (
    BackendError,
    FrontendError,
    NoBackendError,
    ProgramError,
    UnsupportedByBackendError,
    UnsupportedModalityError,
)
from .fork import ProgramStateGroup
from .function import SglFunction
from .global_config import global_config
from .openai_backend import OpenAI as OpenAI  # light: the openai package loads only when an OpenAI backend is created
from .program_state import ProgramState

# Names resolved on first access: ``Engine`` imports torch, the HTTP backends
# httpx. (``OpenAI`` imports the openai package only when constructed.)
LAZY_NAMES = ("Engine", "RuntimeEndpoint", "Runtime")

__all__ = [
    # language
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "select",
    "separate_reasoning",
    "image",
    "video",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    # backends and admin
    "set_default_backend",
    "get_default_backend",
    "flush_cache",
    "get_server_info",
    "BaseBackend",
    # choice methods
    "token_length_normalized",
    "greedy_token_selection",
    "unconditional_likelihood_normalized",
    "ChoicesSamplingMethod",
    "ChoicesDecision",
    # state and errors
    "ProgramState",
    "ProgramStateGroup",
    "SglFunction",
    "global_config",
    "FrontendError",
    "BackendError",
    "NoBackendError",
    "ProgramError",
    "UnsupportedByBackendError",
    "UnsupportedModalityError",
]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixrt.engine import Engine  # torch lives behind this import

        return Engine
    if name in ("RuntimeEndpoint", "Runtime"):
        from . import runtime_endpoint  # httpx lives behind this import

        return getattr(runtime_endpoint, name)
    raise AttributeError(f"module 'radixrt.frontend' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY_NAMES))
