"""Running programs: :func:`run_program` (one) and :func:`run_program_batch` (many).

A run resolves the backend (``default_backend.py``), creates the program
state (``program_state.py``) over a stream executor (``executor.py``),
calls the program body on it and ends the state. ``run_program`` returns
once the body has returned and (unless streaming) every expression has run;
a failed request is kept in the state (``error()``, ``ProgramError`` on
read), while an exception raised by the body itself propagates, except in
batches, where it is kept too so that one bad program does not lose the
others.

Batches run each program on a thread pool with no per-state worker thread,
after prefilling once the constant prefix the programs share (found by
tracing a sample of them, ``tracer.shared_constant_prefix``).

Every public name of SGLang's ``sglang.lang.interpreter`` is importable from
here: the IR nodes it re-exports, ``run_internal``, ``cache_program`` and
``get_exception_traceback`` work as SGLang's do; ``encode_image_base64`` and
``encode_video_base64`` raise ``UnsupportedModalityError`` (radixrt serves
text-only models).
"""

from __future__ import annotations

import logging
import os
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Union

from .default_backend import resolve_backend
from .errors import UnsupportedModalityError
from .executor import StreamExecutor
from .fork import ProgramStateGroup  # noqa: F401  (re-exported: radixrt.frontend.interpreter.ProgramStateGroup)
from .global_config import global_config
from .nodes import (  # noqa: F401  (SGLang's interpreter exports these nodes)
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglSeparateReasoning,
    SglVariable,
    SglVarScopeBegin,
    SglVarScopeEnd,
    SglVideo,
)
from .program import Program
from .program_state import ProgramState
from .sampling_params import SglSamplingParams
from .tracer import Placeholder, shared_constant_prefix

logger = logging.getLogger("radixrt.frontend")


def run_program(
    func: Program,
    backend: Any,
    arguments: dict[str, Any],
    default_sampling: SglSamplingParams,
    stream: bool = False,
    use_thread: bool = True,
    catch_errors: bool = False,
) -> ProgramState:
    """Run program ``func`` (an ``SglFunction``) once with bound ``arguments``.
    ``catch_errors``: keep an ``Exception`` from the body in the state's
    ``error()`` instead of raising it."""
    backend = resolve_backend(backend)
    spec = getattr(func, "num_api_spec_tokens", None)
    ex = StreamExecutor(backend, arguments, default_sampling, stream, use_thread, num_api_spec_tokens=spec)
    state = ProgramState(ex)
    try:
        state.ret_value = func.call_body(state, arguments)
    except BaseException as e:
        if not catch_errors or not isinstance(e, Exception):
            ex.end()
            raise
        ex.sync()
        if ex.error_ is None:
            ex.error_ = e
    ex.end()
    if not stream:
        ex.sync()
    return state


def run_internal(state: ProgramState, program: Program, func_args: Any, func_kwargs: Any, sync: bool) -> None:
    """SGLang's: run ``program``'s body on an existing ``state`` with
    ``func_args`` / ``func_kwargs``, end the state, and wait for its
    expressions when ``sync``."""
    try:
        state.ret_value = program.call_body(state, program.bind_args(tuple(func_args), dict(func_kwargs)))
    finally:
        state.stream_executor.end()
    if sync:
        state.stream_executor.sync()


def cache_program(program: Program, backend: Any = None) -> str:
    """SGLang's: prefill, in ``backend``'s cache, the constant text
    ``program`` starts with before its first generation call (found by
    tracing it with placeholder arguments) when it has at least
    ``global_config.min_shared_prefix_chars`` characters. Returns the
    prefix found ("" when none)."""
    backend = resolve_backend(backend)
    arguments = dict(program.bind_arguments)
    for name in program.arg_names:
        arguments.setdefault(name, Placeholder("arg", name))
    prefix = shared_constant_prefix(program, backend, [arguments])
    if len(prefix) >= global_config.min_shared_prefix_chars:
        backend.cache_prefix(prefix)
    return prefix


def get_exception_traceback() -> str:
    """SGLang's: the traceback of the exception being handled, as text."""
    return traceback.format_exc()


def encode_image_base64(image_path: Any) -> str:
    """SGLang's image encoder for multimodal requests: radixrt serves
    text-only models, so this raises :class:`UnsupportedModalityError`."""
    raise UnsupportedModalityError("images are not supported: radixrt serves text-only models")


def encode_video_base64(video_path: Any, num_frames: int = 16) -> str:
    """SGLang's video encoder for multimodal requests: radixrt serves
    text-only models, so this raises :class:`UnsupportedModalityError`."""
    raise UnsupportedModalityError("videos are not supported: radixrt serves text-only models")


def run_program_batch(
    func: Program,
    backend: Any,
    batch_arguments: list[dict[str, Any]],
    default_sampling: SglSamplingParams,
    num_threads: Union[str, int] = "auto",
    progress_bar: bool = False,
    generator_style: bool = False,
    prefill_shared_prefix: bool = True,
):
    """Run ``func`` once per entry of ``batch_arguments`` on ``num_threads``
    threads; the states in input order (a generator with ``generator_style``)."""
    backend = resolve_backend(backend)
    if prefill_shared_prefix and len(batch_arguments) > 1:
        _prefill_shared_prefix(func, backend, batch_arguments, default_sampling)
    threads = _thread_count(num_threads, len(batch_arguments))

    def one(arguments: dict[str, Any]) -> ProgramState:
        return run_program(
            func, backend, arguments, default_sampling, stream=False, use_thread=False, catch_errors=True
        )

    states = _run_all(one, batch_arguments, threads, progress_bar)
    return states if generator_style else list(states)


def _prefill_shared_prefix(
    func: Program, backend: Any, batch_arguments: list[dict[str, Any]], default_sampling: SglSamplingParams
) -> None:
    """Prefill the batch's shared constant prefix when it is long enough
    (``global_config.min_shared_prefix_chars``). A hint only: never fails."""
    try:
        prefix = shared_constant_prefix(func, backend, batch_arguments, default_sampling)
        if len(prefix) >= global_config.min_shared_prefix_chars:
            backend.cache_prefix(prefix)
    except Exception as e:  # noqa: BLE001 - a hint only: never fails
        logger.warning("could not prefill the shared prefix: %s", e)


def _thread_count(num_threads: Union[str, int], n: int) -> int:
    if num_threads == "auto":
        threads = max(1, min(n, max(64, (os.cpu_count() or 1) * 16)))
    else:
        threads = max(1, int(num_threads))
    return min(threads, max(1, n))


def _run_all(
    one: Callable, batch_arguments: list[dict[str, Any]], threads: int, progress_bar: bool
) -> Iterator[ProgramState]:
    """Yield ``one(a)`` for each ``a`` in order, ``threads`` at a time."""
    bar = _progress_bar(len(batch_arguments)) if progress_bar else None
    try:
        if threads == 1:
            for a in batch_arguments:
                st = one(a)
                if bar is not None:
                    bar.update(1)
                yield st
            return
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="radixrt-batch") as pool:
            futures = [pool.submit(one, a) for a in batch_arguments]
            if bar is not None:
                for f in futures:
                    f.add_done_callback(lambda _f: bar.update(1))
            for f in futures:
                yield f.result()
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(total: int) -> Any:
    # tqdm is imported here, not at the top: it is an optional dependency that
    # only run_batch(progress_bar=True) needs.
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="run_batch", unit="prog")
