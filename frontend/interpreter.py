"""Executing programs: one stream executor (and worker thread) per program state.

``s += expr`` hands the expression to the state's executor and returns at
once; the executor's worker thread runs expressions in order, sending each
``gen``/``select`` to the backend with the text so far as the prompt. Reading
``s["x"]`` waits until ``x`` has been produced. Because submission does not
block, the branches of ``s.fork(n)`` run concurrently and their requests reach
the backend together, where they batch and share the cached prefix.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

from .errors import FrontendError, NoBackendError, ProgramError, StopTracing, UnsupportedModalityError
from .global_config import global_config
from .ir import (
    SamplingParams,
    SglCommitLazy,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglFunction,
    SglGen,
    SglImage,
    SglRoleBegin,
    SglRoleEnd,
    SglSelect,
    SglSeparateReasoning,
    SglVarScopeBegin,
    SglVarScopeEnd,
    SglVideo,
    role_turn,
    to_expr,
)

logger = logging.getLogger("radixrt.frontend")

_END = object()
_INT_PREFIX = re.compile(r"\s*([-+]?[0-9]+)")
_FLOAT_PREFIX = re.compile(r"\s*([-+]?[0-9]+(?:\.[0-9]+)?)")


def resolve_backend(backend: Any = None) -> Any:
    """The backend to run on: the given one, else the default one. A
    ``radixrt.Engine`` object is wrapped in the in-process engine backend."""
    from .backend import BaseBackend

    b = backend if backend is not None else global_config.default_backend
    if b is None:
        raise NoBackendError(
            "no backend: call radixrt.set_default_backend(radixrt.Engine()) "
            "(or RuntimeEndpoint(url) / Runtime(...) / OpenAI(model)), or pass backend=..."
        )
    if isinstance(b, BaseBackend):
        return b
    if hasattr(b, "async_generate") or hasattr(b, "generate"):
        from .engine_backend import backend_for_engine

        return backend_for_engine(b)
    raise TypeError(f"{type(b).__name__} is not a radixrt backend")


def _produced_names(expr: SglExpr) -> list[str]:
    out = []
    for e in expr.flatten():
        if isinstance(e, (SglGen, SglSelect)) and e.name is not None:
            out.append(e.name)
        elif isinstance(e, SglVarScopeEnd):
            out.append(e.name)
    return out


class StreamExecutor:
    """Runs one program state's expressions in order (on a worker thread when
    ``use_thread``) and holds its text, messages, variables and meta info."""

    def __init__(self, backend: Any, arguments: dict[str, Any], default_sampling: SamplingParams,
                 stream: bool = False, use_thread: bool = True, tracer: Any = None) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling = default_sampling
        self.stream = stream
        self.use_thread = use_thread
        self.tracer = tracer
        self.role_markers: dict[str, tuple[str, str]] = backend.get_role_markers()
        self.default_system_prompt: Optional[str] = backend.get_default_system_prompt()

        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos: Optional[int] = None
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.var_scope_begin: dict[str, int] = {}
        self.assigned: list[str] = []  # names set on this state (in order), for join()
        self.fork_start_text_pos = 0

        self.error_: Optional[BaseException] = None
        self.branch_errors: list[BaseException] = []
        self.failed_vars: dict[str, BaseException] = {}

        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._events: dict[str, threading.Event] = {}

        self._log: list[tuple[Optional[str], Optional[str], Any]] = []  # (var, chunk or None=var done, meta)
        self._cond = threading.Condition()
        self._finished = False

        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._ended = False

    # ------------------------------------------------------------------ submit
    def submit(self, expr: Any) -> None:
        expr = to_expr(expr)
        for e in expr.flatten():
            if isinstance(e, (SglImage, SglVideo)) and not getattr(self.backend, "supports_images", False):
                kind = "image" if isinstance(e, SglImage) else "video"
                raise UnsupportedModalityError(
                    f"{kind} inputs are not supported by this model: radixrt serves text-only models "
                    f"(backend {type(self.backend).__name__})"
                )
        if self._ended:
            raise FrontendError("this program state has ended (it was joined or its program finished)")
        names = _produced_names(expr)
        if names:
            with self._lock:
                for n in names:
                    self._pending[n] = self._pending.get(n, 0) + 1
                    self._events.setdefault(n, threading.Event()).clear()
        if self.use_thread:
            if self._worker is None:
                self._worker = threading.Thread(target=self._loop, name=f"radixrt-state-{self.sid[:8]}", daemon=True)
                self._worker.start()
            self._queue.put(expr)
        else:
            self._run_one(expr)

    def _loop(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    break
                self._run_one(expr)
            finally:
                self._queue.task_done()
        self._finish_stream()

    def _run_one(self, expr: SglExpr) -> None:
        names = _produced_names(expr)
        try:
            if self.error_ is not None:
                for n in names:
                    self.failed_vars[n] = self.error_
                return
            self._execute(expr)
        except StopTracing:
            raise
        except BaseException as e:  # noqa: BLE001 - recorded, surfaced on read
            if self.error_ is None:
                self.error_ = e
            for n in names:
                if n not in self.variables or n in self._pending:
                    self.failed_vars[n] = e
            logger.warning("program state %s: %s: %s", self.sid[:8], type(e).__name__, e)
            if self.tracer is not None:
                raise
        finally:
            if names:
                with self._lock:
                    for n in names:
                        self._pending[n] -= 1
                        if self._pending[n] <= 0:
                            del self._pending[n]
                            self._events.setdefault(n, threading.Event()).set()

    def sync(self) -> None:
        if self.use_thread and self._worker is not None:
            self._queue.join()

    def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self.use_thread and self._worker is not None:
            self._queue.put(_END)
        else:
            self._finish_stream()

    def _finish_stream(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    # ---------------------------------------------------------------- execute
    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._execute(e)
            return
        if self.tracer is not None:
            self.tracer.record(self, expr)
        if isinstance(expr, SglConstantText):
            self._append(expr.value)
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            self._execute_select(expr)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self.var_scope_begin[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            if expr.name not in self.var_scope_begin:
                raise FrontendError(f"var_scope {expr.name!r} ended without beginning")
            self._set_var(expr.name, self.text_[self.var_scope_begin.pop(expr.name):])
        elif isinstance(expr, SglCommitLazy):
            if self.tracer is None and self.text_:
                self.backend.cache_prefix(self.text_)
        elif isinstance(expr, SglSeparateReasoning):
            pass
        elif isinstance(expr, (SglImage, SglVideo)):
            raise UnsupportedModalityError("image/video inputs are not supported by this model")
        else:
            raise TypeError(f"cannot execute {expr!r}")

    def _append(self, text: str, var: Optional[str] = None, meta: Any = None) -> None:
        if not text:
            return
        self.text_ += text
        if self.stream:
            with self._cond:
                self._log.append((var, text, meta))
                self._cond.notify_all()

    def _mark_var_done(self, var: Optional[str], meta: Any) -> None:
        if self.stream:
            with self._cond:
                self._log.append((var, None, meta))
                self._cond.notify_all()

    def _set_var(self, name: Optional[str], value: Any, meta: Any = None, has_meta: bool = False) -> None:
        if name is None:
            return
        self.variables[name] = value
        if has_meta:
            self.meta_info[name] = meta
        self.failed_vars.pop(name, None)
        if name not in self.assigned:
            self.assigned.append(name)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise FrontendError(f"role {role!r} opened inside role {self.cur_role!r}: roles cannot nest")
        if role not in self.role_markers:
            raise FrontendError(f"unknown role {role!r}")
        if (role != "system" and not self.messages_ and not self.text_ and self.default_system_prompt
                and global_config.insert_default_system_prompt):
            self._role_begin("system")
            self._append(self.default_system_prompt)
            self._role_end("system")
        self._append(self.role_markers[role][0])
        self.cur_role = role
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise FrontendError(f"role {role!r} closed while {self.cur_role!r} is open")
        content = self.text_[self.cur_role_begin_pos:]
        self._append(self.role_markers[role][1])
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None

    def _execute_gen(self, expr: SglGen) -> None:
        sp = expr.sampling.merged_over(self.default_sampling)
        name = expr.name
        if self.tracer is not None:
            self.tracer.dynamic(self, expr)
            return
        n = sp.n or 1
        start = len(self.text_)
        if self.stream and n == 1:
            streamed = ""
            final_text, meta = "", {}
            for cum_text, meta_so_far in self.backend.generate_stream(self, sp):
                final_text, meta = cum_text, meta_so_far
                if cum_text.startswith(streamed) and len(cum_text) > len(streamed):
                    self._append(cum_text[len(streamed):], var=name, meta=meta_so_far)
                    streamed = cum_text
            if final_text != streamed:  # e.g. a stop string trimmed at the end
                self.text_ = self.text_[:start] + final_text
            comp = final_text
        else:
            comp, meta = self.backend.generate(self, sp)
            if n > 1:
                self._append(comp[0] if comp else "", var=name, meta=meta)
            else:
                self._append(comp, var=name, meta=meta)
        if n == 1:
            comp = self._apply_dtype(sp, comp, start, meta)
        self._set_var(name, comp, meta, has_meta=True)
        self._mark_var_done(name, meta)

    def _apply_dtype(self, sp: SamplingParams, comp: str, start: int, meta: Any) -> str:
        """Client-side fallback for constraints a backend may not enforce.

        ``regex``: when the output does not match, keep its longest prefix that
        does (meta ``constraint_fallback: "trimmed"``), or flag it
        (``constraint_violated``). ``dtype=int``/``float``: keep the leading
        number. Where the backend enforces the constraint this changes nothing."""
        dt = sp.dtype
        if sp.regex is not None:
            try:
                rx = re.compile(sp.regex)
            except re.error:
                return comp
            if rx.fullmatch(comp):
                return comp
            for k in range(len(comp) - 1, 0, -1):
                if rx.fullmatch(comp, 0, k):
                    self.text_ = self.text_[:start] + comp[:k]
                    if isinstance(meta, dict):
                        meta["constraint_fallback"] = "trimmed"
                    return comp[:k]
            if isinstance(meta, dict):
                meta["constraint_violated"] = True
            return comp
        if dt is None:
            return comp
        pat = _INT_PREFIX if dt in (int, "int") else _FLOAT_PREFIX if dt in (float, "float") else None
        if pat is None:
            return comp
        m = pat.match(comp)
        if m is None:
            if isinstance(meta, dict):
                meta["dtype_mismatch"] = True
            return comp.strip()
        if m.end() != len(comp):
            self.text_ = self.text_[:start] + comp[: m.end()]
        return m.group(1)

    def _execute_select(self, expr: SglSelect) -> None:
        if self.tracer is not None:
            self.tracer.dynamic(self, expr)
            return
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self._append(decision.decision, var=expr.name, meta=decision.meta_info)
        self._set_var(expr.name, decision.decision, decision.meta_info, has_meta=True)
        self._mark_var_done(expr.name, decision.meta_info)

    # ------------------------------------------------------------- variables
    def get_var(self, name: str) -> Any:
        with self._lock:
            ev = self._events.get(name) if name in self._pending else None
        if ev is not None:
            ev.wait()
        elif name not in self.variables and name not in self.failed_vars:
            self.sync()
        if name in self.failed_vars:
            err = self.failed_vars[name]
            raise ProgramError(f"variable {name!r} is unavailable: its request failed ({type(err).__name__}: {err})") from err
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(f"variable {name!r} was never produced: the program failed earlier "
                               f"({type(self.error_).__name__}: {self.error_})") from self.error_
        raise KeyError(name)

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        try:
            self.get_var(name)
        except KeyError:
            return None
        except ProgramError:
            pass
        return self.meta_info.get(name)

    # ----------------------------------------------------------------- forks
    def fork(self, size: int, position_ids_offset: Any = None) -> list["StreamExecutor"]:
        size = int(size)
        if size < 1:
            raise ValueError("fork size must be >= 1")
        if size > 1 and global_config.prefill_before_fork and self.tracer is None:
            self.submit(SglCommitLazy())
        self.sync()
        children = []
        for i in range(size):
            child_tracer = self.tracer.child(self, i, size) if self.tracer is not None else None
            c = StreamExecutor(self.backend, self.arguments, self.default_sampling, stream=self.stream,
                               use_thread=self.tracer is None, tracer=child_tracer)
            c.text_ = self.text_
            c.messages_ = [dict(m) for m in self.messages_]
            c.cur_role = self.cur_role
            c.cur_role_begin_pos = self.cur_role_begin_pos
            c.variables = dict(self.variables)
            c.meta_info = dict(self.meta_info)
            c.var_scope_begin = dict(self.var_scope_begin)
            c.failed_vars = dict(self.failed_vars)
            c.error_ = self.error_
            c.fork_start_text_pos = len(self.text_)
            children.append(c)
        return children

    # ---------------------------------------------------------------- stream
    def _wait_log(self, i: int, timeout: Optional[float]) -> tuple[list, bool]:
        with self._cond:
            if i >= len(self._log) and not self._finished:
                self._cond.wait(timeout)
            return self._log[i:], self._finished

    def iter_log(self, var_name: Optional[str]) -> Iterator[tuple[str, Any]]:
        i = 0
        while True:
            items, finished = self._wait_log(i, None)
            i += len(items)
            chunks, var_done = _chunks_of(items, var_name)
            yield from chunks
            if var_done or (finished and not items):
                return

    async def aiter_log(self, var_name: Optional[str]) -> AsyncIterator[tuple[str, Any]]:
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            items, finished = await loop.run_in_executor(None, self._wait_log, i, 0.5)
            i += len(items)
            chunks, var_done = _chunks_of(items, var_name)
            for chunk in chunks:
                yield chunk
            if var_done:
                return
            if finished and not items:
                with self._cond:
                    if i >= len(self._log):
                        return


def _chunks_of(items: list[tuple[Optional[str], Optional[str], Any]],
               var_name: Optional[str]) -> tuple[list[tuple[str, Any]], bool]:
    """The ``(chunk, meta)`` pairs of stream-log ``items`` that a text iterator
    over ``var_name`` yields (every text chunk when ``var_name`` is None), and
    whether ``var_name`` was marked done among them (the pairs stop there)."""
    out = []
    for var, chunk, meta in items:
        if var_name is None:
            if chunk is not None:
                out.append((chunk, meta))
        elif var == var_name:
            if chunk is None:
                return out, True
            out.append((chunk, meta))
    return out, False


class ProgramState:
    """What a program body sees as ``s``."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # --- building -----------------------------------------------------------
    def __iadd__(self, other: Any) -> "ProgramState":
        self.stream_executor.submit(other)
        return self

    @contextlib.contextmanager
    def _bracketed(self, begin: SglExpr, end: SglExpr):
        """Submit ``begin`` on entering the ``with`` block and ``end`` on
        leaving it normally (an exception inside leaves the bracket open)."""
        self.stream_executor.submit(begin)
        yield
        self.stream_executor.submit(end)

    def _role_common(self, role: str, expr: Any = None):
        """With ``expr``: append a whole ``role`` turn holding it and return
        that turn. Without: a context manager whose block is the turn."""
        if expr is not None:
            turn = role_turn(role, expr)
            self.stream_executor.submit(turn)
            return turn
        return self._bracketed(SglRoleBegin(role), SglRoleEnd(role))

    def system(self, expr: Any = None):
        return self._role_common("system", expr)

    def user(self, expr: Any = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None):
        return self._role_common("assistant", expr)

    def var_scope(self, name: str):
        """A context manager: the text appended inside its block is stored in variable ``name``."""
        return self._bracketed(SglVarScopeBegin(name), SglVarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> "ProgramStateGroup":
        execs = self.stream_executor.fork(size, position_ids_offset)
        return ProgramStateGroup([ProgramState(e) for e in execs], self)

    def copy(self, position_ids_offset: Any = None) -> "ProgramState":
        return self.fork(1, position_ids_offset)[0]

    def __enter__(self) -> "ProgramState":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stream_executor.sync()
        self.stream_executor.end()

    # --- reading ------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.stream_executor.sync()
        return name in self.stream_executor.variables

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.stream_executor.sync()
        return [dict(m) for m in self.stream_executor.messages_]

    def variables(self) -> dict[str, Any]:
        self.stream_executor.sync()
        return dict(self.stream_executor.variables)

    def sync(self) -> "ProgramState":
        self.stream_executor.sync()
        return self

    def error(self) -> Optional[BaseException]:
        self.stream_executor.sync()
        ex = self.stream_executor
        if ex.error_ is not None:
            return ex.error_
        return ex.branch_errors[0] if ex.branch_errors else None

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Yield text as it is produced (``run(stream=True)``): all text, or only
        the chunks of ``var_name``. Without streaming, yields the final text
        (or the variable) once."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        for chunk, _ in ex.iter_log(var_name):
            yield chunk

    async def text_async_iter(self, var_name: Optional[str] = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        ex = self.stream_executor
        if not ex.stream:
            loop = asyncio.get_running_loop()
            if var_name is None:
                value = await loop.run_in_executor(None, self.text)
                meta = None
            else:
                value = await loop.run_in_executor(None, self.get_var, var_name)
                meta = ex.meta_info.get(var_name)
            yield (value, meta) if return_meta_data else value
            return
        async for chunk, meta in ex.aiter_log(var_name):
            yield (chunk, meta) if return_meta_data else chunk

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    def __del__(self) -> None:
        try:
            self.stream_executor.end()
        except Exception:
            pass


class ProgramStateGroup:
    """The branches of ``s.fork(n)``."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise TypeError("fork branches cannot be replaced; use `forks[i] += expr`")

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        if callable(other) and not isinstance(other, SglExpr):
            parts = [other(i) for i in range(len(self.states))]
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} branches")
            parts = list(other)
        else:
            parts = [other] * len(self.states)
        for st, part in zip(self.states, parts):
            st += part
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. ``gather_variable`` (default): each variable
        set in the branches becomes, on the parent, the list of the branches'
        values (None where a branch did not set it), meta info likewise.
        ``concate_and_append``: append the branches' new text to the parent."""
        parent = self.src_state.stream_executor
        parent.sync()
        for st in self.states:
            st.stream_executor.sync()
        execs = [st.stream_executor for st in self.states]
        for e in execs:
            if e.error_ is not None and e.error_ is not parent.error_:
                parent.branch_errors.append(e.error_)
        if mode == "gather_variable":
            names: list[str] = []
            for e in execs:
                for n in e.assigned:
                    if n not in names:
                        names.append(n)
            for n in names:
                values = [e.variables.get(n) if n in e.assigned else None for e in execs]
                metas = [e.meta_info.get(n) if n in e.assigned else None for e in execs]
                parent._set_var(n, values, metas, has_meta=True)
                errs = [e.failed_vars[n] for e in execs if n in e.failed_vars]
                if errs:
                    parent.failed_vars[n] = errs[0]
        elif mode in ("concate_and_append", "concatenate_and_append"):
            new_text = "".join(e.text_[e.fork_start_text_pos:] for e in execs)
            self.src_state += SglConstantText(new_text)
        else:
            raise ValueError(f"unknown join mode {mode!r}; use 'gather_variable' or 'concate_and_append'")
        for e in execs:
            e.end()


# ---------------------------------------------------------------------------
# Running programs
# ---------------------------------------------------------------------------

def run_program(func: SglFunction, backend: Any, arguments: dict[str, Any], default_sampling: SamplingParams,
                stream: bool = False, use_thread: bool = True, catch_errors: bool = False) -> ProgramState:
    backend = resolve_backend(backend)
    ex = StreamExecutor(backend, arguments, default_sampling, stream=stream, use_thread=use_thread)
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


def _auto_threads(n: int) -> int:
    return max(1, min(n, max(64, (os.cpu_count() or 1) * 16)))


def run_program_batch(func: SglFunction, backend: Any, batch_arguments: list[dict[str, Any]],
                      default_sampling: SamplingParams, num_threads: Union[str, int] = "auto",
                      progress_bar: bool = False, generator_style: bool = False,
                      prefill_shared_prefix: bool = True):
    backend = resolve_backend(backend)
    if prefill_shared_prefix and len(batch_arguments) > 1:
        from .tracer import shared_constant_prefix

        try:
            prefix = shared_constant_prefix(func, backend, batch_arguments, default_sampling)
            if len(prefix) >= global_config.min_shared_prefix_chars:
                backend.cache_prefix(prefix)
        except Exception as e:  # a hint only: never fail the batch for it
            logger.warning("could not prefill the shared prefix: %s", e)

    threads = _auto_threads(len(batch_arguments)) if num_threads == "auto" else max(1, int(num_threads))
    threads = min(threads, max(1, len(batch_arguments)))

    def one(arguments: dict[str, Any]) -> ProgramState:
        return run_program(func, backend, arguments, default_sampling, stream=False, use_thread=False,
                           catch_errors=True)

    if generator_style:
        return _batch_generator(one, batch_arguments, threads, progress_bar)
    return list(_batch_generator(one, batch_arguments, threads, progress_bar))


def _batch_generator(one: Callable, batch_arguments: list[dict[str, Any]], threads: int, progress_bar: bool):
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batch_arguments), desc="run_batch", unit="prog")
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
