"""Public constructors of the frontend language (``import radixrt as rt``).

Every public name of SGLang's ``sglang.lang.api`` is importable from here;
``Engine`` (torch) and ``Runtime`` (httpx) load on first access, as in
``radixrt.frontend``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from radixrt.requests.reasoning import REASONING_PARSERS

from .backend import BaseBackend  # noqa: F401  (SGLang's api exports it)
from .choices import ChoicesSamplingMethod, token_length_normalized
from .default_backend import backend_or_none, get_default_backend, set_default_backend  # noqa: F401  (public)
from .function import SglFunction
from .global_config import global_config  # noqa: F401  (SGLang's api exports it)
from .nodes import (
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglSeparateReasoning,
    SglVideo,
    role_turn,
)
from .sampling_params import SglSamplingParams, is_valid_regex


def function(func: Optional[Callable] = None, num_api_spec_tokens: Optional[int] = None):
    """Decorator making a program: ``@function`` or ``@function(num_api_spec_tokens=...)``
    (SGLang's API speculative execution on a completion model's API: api_speculation.py)."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def deco(f: Callable) -> SglFunction:
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return deco


# --- backends (set_default_backend / get_default_backend: default_backend.py) ------


def flush_cache(backend: Any = None, empty_cache: bool = True) -> bool:
    """Drop the backend's radix cache. False when there is no backend."""
    b = backend_or_none(backend)
    return False if b is None else bool(b.flush_cache())


def get_server_info(backend: Any = None) -> Optional[dict]:
    b = backend_or_none(backend)
    return None if b is None else b.get_server_info()


# --- generation ------------------------------------------------------------------


def gen(
    name: Optional[str] = None,
    max_tokens: Optional[int] = None,
    min_tokens: Optional[int] = None,
    n: Optional[int] = None,
    stop: Optional[Union[str, list[str]]] = None,
    stop_token_ids: Optional[list[int]] = None,
    stop_regex: Optional[Union[str, list[str]]] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    min_p: Optional[float] = None,
    frequency_penalty: Optional[float] = None,
    presence_penalty: Optional[float] = None,
    ignore_eos: Optional[bool] = None,
    return_logprob: Optional[bool] = None,
    logprob_start_len: Optional[int] = None,
    top_logprobs_num: Optional[int] = None,
    return_text_in_logprobs: Optional[bool] = None,
    dtype: Optional[Union[type, str]] = None,
    choices: Optional[list[str]] = None,
    choices_method: Optional[ChoicesSamplingMethod] = None,
    regex: Optional[str] = None,
    json_schema: Optional[Union[str, dict]] = None,
    repetition_penalty: Optional[float] = None,
    seed: Optional[int] = None,
    ebnf: Optional[str] = None,
    beam_width: Optional[int] = None,
    length_penalty: Optional[float] = None,
    early_stopping: Optional[Union[bool, str]] = None,
    lora: Optional[str] = None,
) -> SglExpr:
    """Generate text into variable ``name`` (unset options take the program's defaults). With
    ``choices``, this is :func:`select`; ``beam_width`` > 1: a beam search (its best, or ``n`` best);
    ``lora``: the server's LoRA adapter of that name generates it (``lora_path`` on the wire)."""
    if choices is not None:
        constrained = {"regex": regex, "json_schema": json_schema, "ebnf": ebnf, "dtype": dtype}
        taken = [k for k, v in constrained.items() if v is not None]
        if taken:  # a choice is picked by its score: no grammar would apply to it
            raise ValueError(f"gen takes choices or {taken[0]}, not both")
        return SglSelect(
            name,
            choices,
            0.0 if temperature is None else temperature,
            token_length_normalized if choices_method is None else choices_method,
            lora,
        )
    _check_gen_constraints(regex, stop_regex, json_schema, ebnf, dtype)
    return SglGen(
        name,
        SglSamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            n=n,
            stop=stop,
            stop_token_ids=stop_token_ids,
            stop_regex=stop_regex,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            repetition_penalty=repetition_penalty,
            ignore_eos=ignore_eos,
            seed=seed,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            dtype=dtype,
            regex=regex,
            json_schema=json_schema,
            ebnf=ebnf,
            beam_width=beam_width,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            lora=lora,
        ),
    )


def _check_gen_constraints(
    regex: Optional[str],
    stop_regex: Optional[Union[str, list[str]]],
    json_schema: Optional[Union[str, dict]],
    ebnf: Optional[str],
    dtype: Optional[Union[type, str]],
) -> None:
    """Raise ValueError, when the program is built, for a bad regex, more than
    one constraint, or an unsupported ``dtype``."""
    if regex is not None:
        is_valid_regex(regex)
    for pattern in [stop_regex] if isinstance(stop_regex, str) else (stop_regex or ()):
        is_valid_regex(pattern)
    constraints = [x for x in (regex, json_schema, ebnf) if x is not None]
    if len(constraints) > 1:
        raise ValueError("use only one of regex, json_schema and ebnf")
    if dtype is not None and dtype not in (int, str, float, bool, "int", "str", "string", "float", "bool"):
        raise ValueError(f"unsupported dtype {dtype!r}; use int, str, float or bool")


def _public(f: Callable, name: str, doc: str) -> Callable:
    """``f``, made by a factory below, under its public ``name`` and ``doc``
    (what ``help()`` and reprs show)."""
    f.__name__ = f.__qualname__ = name
    f.__doc__ = doc
    return f


def _typed_gen(public_name: str, dtype: type, default_max_tokens: Optional[int], doc: str) -> Callable[..., SglExpr]:
    """A ``gen`` of fixed ``dtype`` (SGLang's ``gen_int`` / ``gen_string``
    signature: no constraint or choice options), whose ``max_tokens`` falls
    back to ``default_max_tokens`` (None: the program's default)."""

    def typed_gen(
        name: Optional[str] = None,
        max_tokens: Optional[int] = None,
        n: Optional[int] = None,
        stop: Optional[Union[str, list[str]]] = None,
        stop_token_ids: Optional[list[int]] = None,
        stop_regex: Optional[Union[str, list[str]]] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        ignore_eos: Optional[bool] = None,
        return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None,
    ) -> SglExpr:
        return gen(
            name,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            n=n,
            stop=stop,
            stop_token_ids=stop_token_ids,
            stop_regex=stop_regex,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            ignore_eos=ignore_eos,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            dtype=dtype,
        )

    return _public(typed_gen, public_name, doc)


gen_int = _typed_gen(
    "gen_int",
    int,
    None,  # as SGLang's: the program's max_tokens (gen(dtype=int) is the same call)
    'Generate an integer (as its decimal string, e.g. ``"42"``): constrained by a regex '
    "where the backend supports constraints, and cut to the leading integer otherwise.",
)
gen_string = _typed_gen(
    "gen_string", str, None, "Generate a double-quoted string literal (constrained where supported)."
)


def select(
    name: Optional[str] = None,
    choices: Optional[list[str]] = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
    lora: Optional[str] = None,
) -> SglExpr:
    """Append the most likely of ``choices`` (scored by ``choices_method``) and
    store it in ``name``; ``lora``: the server's LoRA adapter of that name scores them."""
    if not choices:
        raise ValueError("select needs choices=[...]")
    return SglSelect(name, choices, temperature, choices_method, lora)


def separate_reasoning(expr: Optional[SglExpr] = None, model_type: Optional[str] = None) -> SglExpr:
    """``expr`` (a ``gen``/``select`` or a list), then its variables' ``<think>...</think>``
    blocks moved to ``<name>_reasoning_content`` and out of the text (SGLang's).
    ``model_type``: ``"qwen3"`` (the default: the model opens the block) or ``"deepseek-r1"``
    (the chat template opened it in the prompt)."""
    if model_type not in (None, *REASONING_PARSERS):
        raise ValueError(f"separate_reasoning: model_type must be one of {', '.join(REASONING_PARSERS)}")
    return SglExprList([expr, SglSeparateReasoning(model_type, expr)])


# --- multimodal --------------------------------------------------------------------


def image(expr: Any) -> SglExpr:
    """Image input. radixrt's models are text-only: appending it raises
    :class:`UnsupportedModalityError`."""
    return SglImage(expr)


def video(path: str, num_frames: int = 0) -> SglExpr:
    """Video input. radixrt's models are text-only: appending it raises
    :class:`UnsupportedModalityError`."""
    return SglVideo(path, num_frames)


# --- roles ---------------------------------------------------------------------------


def _role_constructors(
    role: str,
) -> tuple[Callable[..., SglExprList], Callable[[], SglRoleBegin], Callable[[], SglRoleEnd]]:
    """The public constructors of one chat role: ``<role>(expr=None)``, a
    whole turn (:func:`.ir.role_turn`), and ``<role>_begin()`` /
    ``<role>_end()``, its markers alone, for a turn built across several
    ``s += ...``."""

    def whole(expr: Any = None) -> SglExprList:
        return role_turn(role, expr)

    def begin() -> SglRoleBegin:
        return SglRoleBegin(role)

    def end() -> SglRoleEnd:
        return SglRoleEnd(role)

    return (
        _public(whole, role, f"A {role} turn holding ``expr`` (an empty one when None)."),
        _public(begin, f"{role}_begin", f"The begin marker of a {role} turn."),
        _public(end, f"{role}_end", f"The end marker of a {role} turn."),
    )


system, system_begin, system_end = _role_constructors("system")
user, user_begin, user_end = _role_constructors("user")
assistant, assistant_begin, assistant_end = _role_constructors("assistant")


def __getattr__(name: str) -> Any:
    if name == "Engine":  # torch lives behind this import
        from radixrt.engine import Engine

        return Engine
    if name == "Runtime":  # httpx lives behind this import
        from .runtime_endpoint import Runtime

        return Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
