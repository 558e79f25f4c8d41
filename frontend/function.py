"""The program object: what ``@function`` makes of a Python function.

:class:`SglFunction` wraps a function whose first parameter is the program
state. It binds program arguments to parameter names and starts runs; the
running itself is ``interpreter.py``'s and the tracing ``tracer.py``'s. This
module sits above both (they never import it: they type the program as
`program.Program`), so the frontend's imports form no cycle.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Union

from .interpreter import cache_program, run_program, run_program_batch
from .program_state import ProgramState
from .sampling_params import SglSamplingParams, default_sampling_params
from .tracer import TracedProgram, trace_program

# The sampling options that ``run()`` and ``run_batch()`` take as keyword
# arguments: the program-level defaults under every ``gen`` of the program.
_RUN_SAMPLING_OPTIONS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _run_defaults(run_locals: dict[str, Any]) -> SglSamplingParams:
    """Program defaults from the ``locals()`` of ``run()`` / ``run_batch()``
    (their :data:`_RUN_SAMPLING_OPTIONS` parameters)."""
    return default_sampling_params(**{k: run_locals[k] for k in _RUN_SAMPLING_OPTIONS})


def _one_sample(n: Any) -> None:
    """SGLang's run(n=...): 1 here (its own client fails for more)."""
    if n != 1:
        raise ValueError(f"run takes n=1 only (got {n!r}): fork the state for several samples")


class SglFunction:
    """A program: a Python function whose first parameter is the program state.

    ``f.run(*args, **kwargs)`` executes it; ``f.run_batch([...])`` executes many
    concurrently; ``f.trace()`` records its expressions; ``f.bind(**kw)``
    fixes some arguments. Calling ``f(s, ...)`` with a program state as the
    first argument runs the body inline on that state (sub-programs);
    otherwise ``f(...)`` is ``f.run(...)``.
    """

    def __init__(
        self, func: Callable, num_api_spec_tokens: Optional[int] = None, bind_arguments: Optional[dict[str, Any]] = None
    ) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"@function {func.__name__} must take the program state as its first parameter")
        self._params = params[1:]
        self.arg_names = [p.name for p in self._params]
        self.arg_defaults = [p.default for p in self._params]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = getattr(func, "__doc__", None)
        self.__wrapped__ = func

    def __repr__(self) -> str:
        return f"<radixrt function {self.__name__}({', '.join(self.arg_names)})>"

    def bind(self, **kwargs: Any) -> "SglFunction":
        """A copy of this program with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__} has no argument(s) {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    # --- running --------------------------------------------------------------
    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        stop: Optional[Union[str, list[str]]] = None,
        stop_token_ids: Optional[list[int]] = None,
        stop_regex: Optional[Union[str, list[str]]] = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool = False,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None,
        stream: bool = False,
        backend: Any = None,
        use_thread: bool = True,
        n: int = 1,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once; the sampling options are the defaults of its
        ``gen`` calls. Returns the finished state (``stream=True``: at once).
        ``n``: SGLang's, 1 only (fork the state for several samples)."""
        _one_sample(n)
        defaults = _run_defaults(locals())
        arguments = self.bind_args(args, kwargs)
        return run_program(self, backend, arguments, defaults, stream=stream, use_thread=use_thread)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        max_new_tokens: int = 128,
        stop: Optional[Union[str, list[str]]] = None,
        stop_token_ids: Optional[list[int]] = None,
        stop_regex: Optional[Union[str, list[str]]] = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool = False,
        logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None,
        backend: Any = None,
        num_threads: Union[str, int] = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        prefill_shared_prefix: bool = True,
        n: int = 1,
    ):
        """Run the program once per dict of arguments (or tuple of them in order), concurrently.
        Returns the states in input order (a generator of them with ``generator_style``);
        a program's failure, an exception its body raised included, is kept in its state's
        ``error()`` (SGLang's run_batch raises the body's exception: here the others' results stay)."""
        _one_sample(n)
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of keyword-argument dicts")
        defaults = _run_defaults(locals())
        batch_arguments = [self._batch_entry(kw) for kw in batch_kwargs]
        return run_program_batch(
            self,
            backend,
            batch_arguments,
            defaults,
            num_threads=num_threads,
            progress_bar=progress_bar,
            generator_style=generator_style,
            prefill_shared_prefix=prefill_shared_prefix,
        )

    def _batch_entry(self, kw: Any) -> dict[str, Any]:
        """A run_batch entry's arguments: a dict by name, or (as SGLang) a tuple or list in order."""
        if isinstance(kw, (tuple, list)):
            return self.bind_args(tuple(kw), {})
        if not isinstance(kw, dict):
            raise TypeError("each run_batch entry must be a dict of program arguments, or a tuple of them in order")
        return self.bind_args((), dict(kw))

    def trace(self, *, backend: Any = None, **kwargs: Any) -> TracedProgram:
        """Record the program's expressions without a model (see ``tracer.py``)."""
        return trace_program(self, kwargs, backend=backend)

    def cache(self, backend: Any = None) -> str:
        """Prefill the constant text the program starts with (SGLang's
        ``SglFunction.cache``; see :func:`.interpreter.cache_program`)."""
        return cache_program(self, backend)

    def __call__(self, *args: Any, **kwargs: Any):
        if args and isinstance(args[0], ProgramState):
            return self.call_body(args[0], self.bind_args(args[1:], kwargs))
        return self.run(*args, **kwargs)

    # --- arguments --------------------------------------------------------------
    def bind_args(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map positional and keyword program arguments (over the bound ones)
        to parameter names; ``TypeError`` for too many, unknown or missing ones."""
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.__name__}() takes {len(self.arg_names)} program arguments, got {len(args)}")
        out = dict(self.bind_arguments)
        out.update(zip(self.arg_names, args))
        for k, v in kwargs.items():
            if k not in self.arg_names and not self._has_var_kwargs():
                raise TypeError(f"{self.__name__}() got an unexpected argument {k!r}")
            out[k] = v
        self._check_none_missing(out)
        return out

    def _check_none_missing(self, arguments: dict[str, Any]) -> None:
        for p in self._params:
            if p.name not in arguments and p.default is inspect.Parameter.empty and p.kind not in _VARIADIC:
                raise TypeError(f"{self.__name__}() missing program argument {p.name!r}")

    def _has_var_kwargs(self) -> bool:
        return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in self._params)

    def call_body(self, state: Any, arguments: dict[str, Any]) -> Any:
        """Call the wrapped function on ``state`` with ``arguments`` (names not
        among its parameters go to its ``**kwargs``, when it has one)."""
        pos, kw = [], {}
        for p in self._params:
            if p.kind == inspect.Parameter.VAR_POSITIONAL:
                continue
            if p.kind == inspect.Parameter.VAR_KEYWORD:
                kw.update({k: v for k, v in arguments.items() if k not in self.arg_names})
            elif p.name in arguments:
                if p.kind == inspect.Parameter.POSITIONAL_ONLY:
                    pos.append(arguments[p.name])
                else:
                    kw[p.name] = arguments[p.name]
        return self.func(state, *pos, **kw)
