"""The intermediate representation of frontend programs.

A program is ordinary Python that appends expressions to a program state
(``s += expr``). Expressions are small immutable-ish nodes: constant text,
generation calls, choice selection, role and variable-scope brackets, and
lists of those (built with ``+``). The interpreter (``interpreter.py``)
executes them in order against a backend; the tracer records them.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

_ids = itertools.count()

# Constraints used for ``dtype=int`` / ``gen_int`` (an optional leading space,
# as BPE vocabularies attach it to the number; bounded so a constrained decoder
# cannot run away with digits) and ``dtype=str`` / ``gen_string``.
REGEX_INT = r" ?[-+]?[0-9]{1,18}"
REGEX_STR = r" ?\"[^\"\n]{0,256}\""
REGEX_FLOAT = r" ?[-+]?[0-9]{1,18}(\.[0-9]{1,18})?"
REGEX_BOOL = r" ?(True|False)"


# ---------------------------------------------------------------------------
# Sampling parameters
# ---------------------------------------------------------------------------

@dataclass
class SamplingParams:
    """Sampling parameters of one generation call.

    Field names follow the frontend (``max_new_tokens`` etc.); ``to_wire()``
    gives SGLang's ``sampling_params`` keys. ``None`` means "not set here"
    so that call-level values can be layered over program defaults.
    """

    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    seed: Optional[int] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    dtype: Optional[Any] = None
    regex: Optional[str] = None
    json_schema: Optional[Union[str, dict]] = None
    ebnf: Optional[str] = None

    def merged_over(self, defaults: "SamplingParams") -> "SamplingParams":
        """A copy where every field unset here takes the value from ``defaults``."""
        vals = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            vals[f.name] = getattr(defaults, f.name) if v is None else v
        return SamplingParams(**vals)

    # --- what goes on the wire --------------------------------------------
    def effective_regex(self) -> Optional[str]:
        if self.regex is not None:
            return self.regex
        dt = self.dtype
        if dt in (int, "int"):
            return REGEX_INT
        if dt in (str, "str", "string"):
            return REGEX_STR
        if dt in (float, "float"):
            return REGEX_FLOAT
        if dt in (bool, "bool"):
            return REGEX_BOOL
        return None

    def to_wire(self) -> dict[str, Any]:
        """SGLang ``sampling_params`` (only the keys that are set)."""
        out: dict[str, Any] = {}
        simple = (
            "max_new_tokens", "min_new_tokens", "n", "stop_token_ids", "stop_regex", "temperature",
            "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
            "ignore_eos", "seed", "ebnf",
        )
        for k in simple:
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        if self.stop is not None and self.stop != [] and self.stop != ():
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.n in (None, 1):
            out.pop("n", None)
        rx = self.effective_regex()
        if rx is not None:
            out["regex"] = rx
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
        return out

    def logprob_kwargs(self) -> dict[str, Any]:
        """Top-level logprob options of a ``/generate`` request."""
        out: dict[str, Any] = {}
        if self.return_logprob:
            out["return_logprob"] = True
            if self.logprob_start_len is not None:
                out["logprob_start_len"] = self.logprob_start_len
            if self.top_logprobs_num:
                out["top_logprobs_num"] = self.top_logprobs_num
            if self.return_text_in_logprobs:
                out["return_text_in_logprobs"] = True
        return out


def default_sampling_params(**kwargs) -> SamplingParams:
    """Program-level defaults (what ``run()`` fills when a ``gen`` leaves a field unset)."""
    base = dict(
        max_new_tokens=128, min_new_tokens=0, n=1, stop=None, stop_token_ids=None, stop_regex=None,
        temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0,
        repetition_penalty=None, ignore_eos=False, seed=None, return_logprob=False, logprob_start_len=None,
        top_logprobs_num=None, return_text_in_logprobs=None, dtype=None, regex=None, json_schema=None, ebnf=None,
    )
    for k, v in kwargs.items():
        if k not in base:
            raise TypeError(f"unknown sampling parameter {k!r}")
        if v is not None:
            base[k] = v
    return SamplingParams(**base)


# ---------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------

class SglExpr:
    """Base of all program expressions. ``a + b`` builds an :class:`SglExprList`."""

    def __init__(self) -> None:
        self.node_id = next(_ids)

    def __add__(self, other: Any) -> "SglExprList":
        return SglExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> "SglExprList":
        return SglExprList([to_expr(other), self])

    def flatten(self) -> list["SglExpr"]:
        return [self]

    def _repr_fields(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._repr_fields()})"


class SglExprList(SglExpr):
    def __init__(self, exprs: list[Any]) -> None:
        super().__init__()
        flat: list[SglExpr] = []
        for e in exprs:
            if e is None:
                continue
            flat.extend(to_expr(e).flatten())
        self.expr_list = flat

    def flatten(self) -> list[SglExpr]:
        return list(self.expr_list)

    def _repr_fields(self) -> str:
        return ", ".join(repr(e) for e in self.expr_list)


class SglConstantText(SglExpr):
    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def _repr_fields(self) -> str:
        v = self.value if len(self.value) < 60 else self.value[:57] + "..."
        return repr(v)


class SglGen(SglExpr):
    def __init__(self, name: Optional[str], sampling: SamplingParams) -> None:
        super().__init__()
        self.name = name
        self.sampling = sampling

    def _repr_fields(self) -> str:
        set_fields = {f.name: getattr(self.sampling, f.name) for f in dataclasses.fields(self.sampling)
                      if getattr(self.sampling, f.name) is not None}
        return ", ".join([repr(self.name)] + [f"{k}={v!r}" for k, v in set_fields.items()])


class SglSelect(SglExpr):
    def __init__(self, name: Optional[str], choices: list[str], temperature: float, choices_method: Any) -> None:
        super().__init__()
        if not choices:
            raise ValueError("select needs a non-empty list of choices")
        self.name = name
        self.choices = [str(c) for c in choices]
        self.temperature = temperature
        self.choices_method = choices_method

    def _repr_fields(self) -> str:
        return f"{self.name!r}, choices={self.choices!r}"


class _SglLabeledExpr(SglExpr):
    """An expression that carries one string label and nothing else.

    Subclasses set ``label_attr`` to the attribute that holds the label
    (``"role"`` for role brackets, ``"name"`` for everything named by a
    variable or argument); the constructor takes the label positionally and
    ``repr`` shows it.
    """

    label_attr = "name"

    def __init__(self, label: str) -> None:
        super().__init__()
        setattr(self, self.label_attr, label)

    def _repr_fields(self) -> str:
        return repr(getattr(self, self.label_attr))


class SglRoleBegin(_SglLabeledExpr):
    """Opens a chat turn of ``role`` (the role's begin marker)."""

    label_attr = "role"


class SglRoleEnd(_SglLabeledExpr):
    """Closes a chat turn of ``role`` (the role's end marker)."""

    label_attr = "role"


class SglVarScopeBegin(_SglLabeledExpr):
    """Starts capturing the text appended from here into variable ``name``."""


class SglVarScopeEnd(_SglLabeledExpr):
    """Stores the text appended since the matching begin in variable ``name``."""


def role_turn(role: str, content: Any = None) -> SglExprList:
    """One chat turn of ``role``: its begin marker, ``content`` (left out when
    None) and its end marker."""
    return SglExprList([SglRoleBegin(role), content, SglRoleEnd(role)])


class SglCommitLazy(SglExpr):
    """Prefill the text so far (so that following concurrent requests hit the cache)."""


class SglImage(SglExpr):
    def __init__(self, path: Any) -> None:
        super().__init__()
        self.path = path


class SglVideo(SglExpr):
    def __init__(self, path: Any, num_frames: int) -> None:
        super().__init__()
        self.path = path
        self.num_frames = num_frames


class SglSeparateReasoning(SglExpr):
    """Accepted for compatibility; radixrt's default models do not emit reasoning blocks."""

    def __init__(self, model_type: Optional[str], expr: Optional[SglExpr]) -> None:
        super().__init__()
        self.model_type = model_type
        self.name = getattr(expr, "name", None)


class SglArgument(_SglLabeledExpr):
    """A program argument seen by the tracer."""


class SglVariable(_SglLabeledExpr):
    """A reference to a generated variable seen by the tracer."""


class SglFork(SglExpr):
    """Recorded by the tracer: ``size`` branches, each with its own node list."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.branches: list[list[SglExpr]] = []

    def _repr_fields(self) -> str:
        return str(self.size)


def to_expr(x: Any) -> SglExpr:
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    if isinstance(x, (int, float, bool)):
        return SglConstantText(str(x))
    if isinstance(x, (list, tuple)):
        return SglExprList(list(x))
    raise TypeError(f"cannot append a {type(x).__name__} to a program state; use a str or an expression")


# ---------------------------------------------------------------------------
# Functions
# ---------------------------------------------------------------------------

# The sampling options that ``run()`` and ``run_batch()`` take as keyword
# arguments: the program-level defaults under every ``gen`` of the program.
_RUN_SAMPLING_OPTIONS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs",
)


def _run_defaults(run_locals: dict[str, Any]) -> SamplingParams:
    """Program defaults from the ``locals()`` of ``run()`` / ``run_batch()``
    (their :data:`_RUN_SAMPLING_OPTIONS` parameters)."""
    return default_sampling_params(**{k: run_locals[k] for k in _RUN_SAMPLING_OPTIONS})


class SglFunction:
    """A program: a Python function whose first parameter is the program state.

    ``f.run(*args, **kwargs)`` executes it; ``f.run_batch([...])`` executes many
    concurrently; ``f.trace()`` records its expressions; ``f.bind(**kw)``
    fixes some arguments. Calling ``f(s, ...)`` with a program state as the
    first argument runs the body inline on that state (sub-programs);
    otherwise ``f(...)`` is ``f.run(...)``.
    """

    def __init__(self, func: Callable, num_api_spec_tokens: Optional[int] = None,
                 bind_arguments: Optional[dict[str, Any]] = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        sig = inspect.signature(func)
        params = list(sig.parameters.values())
        if not params:
            raise TypeError(f"@function {func.__name__} must take the program state as its first parameter")
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:]]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = getattr(func, "__doc__", None)
        self.__wrapped__ = func

    def __repr__(self) -> str:
        return f"<radixrt function {self.__name__}({', '.join(self.arg_names)})>"

    def bind(self, **kwargs: Any) -> "SglFunction":
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__} has no argument(s) {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, max_new_tokens: int = 128, stop: Optional[Union[str, list[str]]] = None,
            stop_token_ids: Optional[list[int]] = None, stop_regex: Optional[Union[str, list[str]]] = None,
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
            return_logprob: bool = False, logprob_start_len: Optional[int] = None,
            top_logprobs_num: Optional[int] = None, return_text_in_logprobs: Optional[bool] = None,
            stream: bool = False, backend: Any = None, use_thread: bool = True, **kwargs: Any):
        from .interpreter import run_program

        defaults = _run_defaults(locals())
        arguments = self.bind_args(args, kwargs)
        return run_program(self, backend, arguments, defaults, stream=stream, use_thread=use_thread)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, max_new_tokens: int = 128,
                  stop: Optional[Union[str, list[str]]] = None, stop_token_ids: Optional[list[int]] = None,
                  stop_regex: Optional[Union[str, list[str]]] = None, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool = False,
                  logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
                  return_text_in_logprobs: Optional[bool] = None, backend: Any = None,
                  num_threads: Union[str, int] = "auto", progress_bar: bool = False,
                  generator_style: bool = False, prefill_shared_prefix: bool = True):
        from .interpreter import run_program_batch

        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of keyword-argument dicts")
        defaults = _run_defaults(locals())
        batch_arguments = []
        for kw in batch_kwargs:
            if not isinstance(kw, dict):
                raise TypeError("each run_batch entry must be a dict of program arguments")
            batch_arguments.append(self.bind_args((), dict(kw)))
        return run_program_batch(self, backend, batch_arguments, defaults, num_threads=num_threads,
                                 progress_bar=progress_bar, generator_style=generator_style,
                                 prefill_shared_prefix=prefill_shared_prefix)

    def trace(self, *, backend: Any = None, **kwargs: Any):
        from .tracer import trace_program

        return trace_program(self, kwargs, backend=backend)

    def bind_args(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map positional and keyword program arguments to parameter names."""
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.__name__}() takes {len(self.arg_names)} program arguments, got {len(args)}")
        out = dict(self.bind_arguments)
        for name, v in zip(self.arg_names, args):
            out[name] = v
        for k, v in kwargs.items():
            if k not in self.arg_names and not self._has_var_kwargs():
                raise TypeError(f"{self.__name__}() got an unexpected argument {k!r}")
            out[k] = v
        for name, default in zip(self.arg_names, self.arg_defaults):
            if name not in out:
                if default is inspect.Parameter.empty:
                    kind = inspect.signature(self.func).parameters[name].kind
                    if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                        continue
                    raise TypeError(f"{self.__name__}() missing program argument {name!r}")
        return out

    def _has_var_kwargs(self) -> bool:
        return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(self.func).parameters.values())

    def call_body(self, state: Any, arguments: dict[str, Any]) -> Any:
        sig = inspect.signature(self.func)
        params = list(sig.parameters.values())[1:]
        pos, kw = [], {}
        for p in params:
            if p.kind == inspect.Parameter.VAR_POSITIONAL:
                continue
            if p.kind == inspect.Parameter.VAR_KEYWORD:
                kw.update({k: v for k, v in arguments.items() if k not in self.arg_names})
                continue
            if p.name in arguments:
                if p.kind == inspect.Parameter.POSITIONAL_ONLY:
                    pos.append(arguments[p.name])
                else:
                    kw[p.name] = arguments[p.name]
        return self.func(state, *pos, **kw)

    def __call__(self, *args: Any, **kwargs: Any):
        from .interpreter import ProgramState

        if args and isinstance(args[0], ProgramState):
            arguments = self.bind_args(args[1:], kwargs)
            return self.call_body(args[0], arguments)
        return self.run(*args, **kwargs)


def is_valid_regex(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"invalid regex {pattern!r}: {e}") from e
