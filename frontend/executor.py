"""The stream executor: one per program state, running its expressions in order.

``s += expr`` hands the expression to the state's executor and returns at
once; the executor's worker thread runs expressions in submission order
(``execute.py`` says what each does), sending each ``gen``/``select`` to the
backend with the text so far as the prompt. Reading ``s["x"]`` waits until
every queued expression that produces ``x`` has run. Because submission does
not block, the branches of ``s.fork(n)`` run concurrently and their requests
reach the backend together, where they batch and share the cached prefix.

Contract:

* :meth:`StreamExecutor.submit` never waits for the backend when
  ``use_thread`` (without it, the expression runs before ``submit`` returns);
* the first failure is kept in ``error_``: the expressions after it do not
  run, and every variable they would have produced is marked failed, so
  reading it raises :class:`ProgramError` instead of blocking or KeyError;
* backends read the prompt from ``text_`` (and ``messages_``, ``cur_role``,
  ``cur_role_begin_pos`` for chat APIs); only the worker writes them.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from typing import Any, Optional

from .api_speculation import consume
from .errors import FrontendError, ProgramError, StopTracing
from .execute import check_supported, execute, produced_names
from .nodes import SglExpr, to_expr
from .sampling_params import SglSamplingParams
from .stream_log import StreamLog

logger = logging.getLogger("radixrt.frontend")

_END = object()  # queued by end(): the worker stops after it


class StreamExecutor:
    """Runs one program state's expressions (on a worker thread when
    ``use_thread``) and holds its text, messages, variables and meta info."""

    def __init__(
        self,
        backend: Any,
        arguments: dict[str, Any],
        default_sampling: SglSamplingParams,
        stream: bool = False,
        use_thread: bool = True,
        tracer: Any = None,
        num_api_spec_tokens: Optional[int] = None,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling = default_sampling
        self.stream = stream
        self.use_thread = use_thread
        self.tracer = tracer
        self.num_api_spec_tokens = num_api_spec_tokens  # api_speculation.py
        self.speculated_text = ""
        self.role_markers: dict[str, tuple[str, str]] = backend.get_role_markers()
        self.default_system_prompt: Optional[str] = backend.get_default_system_prompt()

        # what the program produced (written by the worker only)
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos: Optional[int] = None
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.var_scope_begin: dict[str, int] = {}
        self.assigned: list[str] = []  # names set on this state (in order), for join()
        self.fork_start_text_pos = 0

        # failures
        self.error_: Optional[BaseException] = None
        self.branch_errors: list[BaseException] = []
        self.failed_vars: dict[str, BaseException] = {}

        # variables still to be produced by queued expressions: name -> count, and their events
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._events: dict[str, threading.Event] = {}

        self.log = StreamLog()  # written only when ``stream``
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._ended = False

    # ------------------------------------------------------------------ submit
    def submit(self, expr: Any) -> None:
        """Queue ``expr`` (run it at once without a worker thread)."""
        expr = to_expr(expr)
        check_supported(self.backend, expr)
        if self._ended:
            raise FrontendError("this program state has ended (it was joined or its program finished)")
        self._expect(produced_names(expr))
        if not self.use_thread:
            self._run_one(expr)
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name=f"radixrt-state-{self.sid[:8]}", daemon=True)
            self._worker.start()
        self._queue.put(expr)

    def _expect(self, names: list[str]) -> None:
        """Mark ``names`` as pending (readers wait) until :meth:`_produced`."""
        with self._lock:
            for n in names:
                self._pending[n] = self._pending.get(n, 0) + 1
                self._events.setdefault(n, threading.Event()).clear()

    def _produced(self, names: list[str]) -> None:
        with self._lock:
            for n in names:
                self._pending[n] -= 1
                if self._pending[n] <= 0:
                    del self._pending[n]
                    self._events.setdefault(n, threading.Event()).set()

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    break
                self._run_one(expr)
            finally:
                self._queue.task_done()
        self.log.finish()

    def _run_one(self, expr: SglExpr) -> None:
        names = produced_names(expr)
        try:
            if self.error_ is not None:
                for n in names:
                    self.failed_vars[n] = self.error_
                return
            execute(self, expr)
        except StopTracing:
            raise
        except BaseException as e:  # recorded, surfaced on read
            self._record_failure(e, names)
            if self.tracer is not None:
                raise
        finally:
            if names:
                self._produced(names)

    def _record_failure(self, e: BaseException, names: list[str]) -> None:
        if self.error_ is None:
            self.error_ = e
        for n in names:
            if n not in self.variables or n in self._pending:
                self.failed_vars[n] = e
        logger.warning("program state %s: %s: %s", self.sid[:8], type(e).__name__, e)

    def sync(self) -> None:
        """Wait until every queued expression has run."""
        if self.use_thread and self._worker is not None:
            self._queue.join()

    def end(self) -> None:
        """No more expressions: the worker stops after the queued ones, and
        the stream log finishes."""
        if self._ended:
            return
        self._ended = True
        if self.use_thread and self._worker is not None:
            self._queue.put(_END)
        else:
            self.log.finish()

    # ------------------------------------------------- writing (worker side)
    def append(self, text: str, var: Optional[str] = None, meta: Any = None, speculated: bool = False) -> None:
        """Append ``text`` to the program text (and to the stream log, as a
        chunk of ``var``); text not taken from the speculated text consumes it (api_speculation.py)."""
        if not text:
            return
        if self.speculated_text and not speculated:
            consume(self, text)
        self.text_ += text
        if self.stream:
            self.log.add_chunk(var, text, meta)

    def mark_var_done(self, var: Optional[str], meta: Any) -> None:
        if self.stream:
            self.log.mark_done(var, meta)

    def store_var(self, name: Optional[str], value: Any, meta: Any = None, has_meta: bool = False) -> None:
        """Set variable ``name`` (no-op for None), and its meta info when ``has_meta``."""
        if name is None:
            return
        self.variables[name] = value
        if has_meta:
            self.meta_info[name] = meta
        self.failed_vars.pop(name, None)
        if name not in self.assigned:
            self.assigned.append(name)

    # ------------------------------------------------------ reading (any thread)
    def get_var(self, name: str) -> Any:
        """The value of ``name`` once produced. ``ProgramError`` when its
        request failed or the program failed before producing it;
        ``KeyError`` when nothing ever set it."""
        self._wait_for(name)
        if name in self.failed_vars:
            err = self.failed_vars[name]
            raise ProgramError(
                f"variable {name!r} is unavailable: its request failed ({type(err).__name__}: {err})"
            ) from err
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(
                f"variable {name!r} was never produced: the program failed earlier "
                f"({type(self.error_).__name__}: {self.error_})"
            ) from self.error_
        raise KeyError(name)

    def _wait_for(self, name: str) -> None:
        with self._lock:
            ev = self._events.get(name) if name in self._pending else None
        if ev is not None:
            ev.wait()
        elif name not in self.variables and name not in self.failed_vars:
            self.sync()

    def set_var(self, name: str, value: Any) -> None:
        """Set ``name`` from the program body (after the queued expressions)."""
        self.sync()
        self.store_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """Meta info of ``name`` once produced (None when never set)."""
        try:
            self.get_var(name)
        except KeyError:
            return None
        except ProgramError:
            pass
        return self.meta_info.get(name)
