"""Tracing programs without running the model.

A traced run executes the program body with a real (synchronous) executor
whose ``gen``/``select`` produce placeholders instead of calling a backend.
Program arguments that are not given become placeholders too. Placeholders
are strings wrapped in private-use sentinel characters, so they survive
f-strings and ``+`` and can be recognised in the text afterwards.

Two uses:

* ``f.trace()``: the expression graph of a program (``TracedProgram.nodes``);
* ``run_batch``: the *constant prefix* the programs of a batch share (text
  up to the first generation call or argument-dependent text), prefilled once
  before the batch so that every program starts from a cached prefix.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

from .backend import PLAIN_ROLE_MARKERS
from .default_backend import resolve_backend
from .errors import StopTracing
from .executor import StreamExecutor
from .global_config import global_config
from .nodes import SglArgument, SglConstantText, SglExpr, SglFork, SglGen, SglSelect, SglVariable
from .program import Program
from .program_state import ProgramState
from .sampling_params import SglSamplingParams, default_sampling_params

logger = logging.getLogger("radixrt.frontend")

_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(_OPEN + r"(arg|var):([^" + _CLOSE + r"]*)" + _CLOSE)


class Placeholder(str):
    """A string standing for an unknown value during tracing."""

    def __new__(cls, kind: str, name: str) -> "Placeholder":
        obj = super().__new__(cls, f"{_OPEN}{kind}:{name}{_CLOSE}")
        obj.kind = kind
        obj.name = name
        return obj


class _TraceBackend:
    """Stands in for a backend during tracing: role markers only."""

    supports_images = False

    def __init__(self, markers: dict[str, tuple[str, str]], default_system_prompt: Optional[str]) -> None:
        self._markers = markers
        self._default_system = default_system_prompt

    def get_role_markers(self) -> dict[str, tuple[str, str]]:
        return self._markers

    def get_default_system_prompt(self) -> Optional[str]:
        return self._default_system

    def cache_prefix(self, prefix: str) -> None:
        pass


class TraceRecorder:
    def __init__(self, stop_at_dynamic: bool) -> None:
        self.stop_at_dynamic = stop_at_dynamic
        self.nodes: list[SglExpr] = []
        self.first_dynamic_pos: Optional[int] = None

    def record(self, ex: Any, expr: SglExpr) -> None:
        if isinstance(expr, SglConstantText) and _OPEN in expr.value:
            pos = 0
            for m in _PLACEHOLDER.finditer(expr.value):
                if m.start() > pos:
                    self.nodes.append(SglConstantText(expr.value[pos : m.start()]))
                kind, name = m.group(1), m.group(2)
                self.nodes.append(SglArgument(name) if kind == "arg" else SglVariable(name))
                pos = m.end()
            if pos < len(expr.value):
                self.nodes.append(SglConstantText(expr.value[pos:]))
            return
        if isinstance(expr, (SglGen, SglSelect)):
            return  # recorded by dynamic()
        self.nodes.append(expr)

    def dynamic(self, ex: Any, expr: SglExpr) -> None:
        if self.first_dynamic_pos is None:
            self.first_dynamic_pos = len(ex.text_)
        if self.stop_at_dynamic:
            raise StopTracing()
        self.nodes.append(expr)
        name = getattr(expr, "name", None)
        if name is not None:
            value = Placeholder("var", name)
            ex.append(value)
            ex.store_var(name, value, None, has_meta=True)

    def child(self, ex: Any, index: int, size: int) -> "TraceRecorder":
        if self.first_dynamic_pos is None:
            self.first_dynamic_pos = len(ex.text_)
        if self.stop_at_dynamic:
            raise StopTracing()
        if index == 0:
            self._fork = SglFork(size)
            self.nodes.append(self._fork)
        rec = TraceRecorder(False)
        rec.first_dynamic_pos = 0
        self._fork.branches.append(rec.nodes)
        return rec


class TracedProgram:
    """Result of ``f.trace()``."""

    def __init__(self, func: Program, state: Any, recorder: TraceRecorder, error: Optional[BaseException]) -> None:
        self.func = func
        self.state = state
        self.nodes = recorder.nodes
        self.error = error
        ex = state.stream_executor
        self.text = ex.text_
        self.variables = dict(ex.variables)
        self.constant_prefix = constant_prefix_of(ex.text_, recorder.first_dynamic_pos)

    def print_graph(self) -> None:
        def show(nodes: list[SglExpr], indent: str) -> None:
            for n in nodes:
                print(f"{indent}{n!r}")
                if isinstance(n, SglFork):
                    for i, b in enumerate(n.branches):
                        print(f"{indent}  branch {i}:")
                        show(b, indent + "    ")

        show(self.nodes, "")

    print_graph_dfs = print_graph

    def __repr__(self) -> str:
        return f"TracedProgram({self.func.__name__}, {len(self.nodes)} nodes)"


def constant_prefix_of(text: str, first_dynamic_pos: Optional[int]) -> str:
    end = len(text) if first_dynamic_pos is None else first_dynamic_pos
    i = text.find(_OPEN)
    if 0 <= i < end:
        end = i
    return text[:end]


def _markers_of(backend: Any) -> tuple[dict[str, tuple[str, str]], Optional[str]]:
    """Role markers and default system prompt of ``backend`` (else of the
    default one; plain markers when there is none)."""
    if backend is None:
        backend = global_config.default_backend
    if backend is None:
        return dict(PLAIN_ROLE_MARKERS), None
    b = resolve_backend(backend)
    return b.get_role_markers(), b.get_default_system_prompt()


def _traced_run(
    func: Program,
    arguments: dict[str, Any],
    markers,
    default_system,
    stop_at_dynamic: bool,
    default_sampling: Optional[SglSamplingParams] = None,
):
    """Run ``func``'s body synchronously with a recorder and a stand-in
    backend; ``(state, recorder, error the body raised or None)``."""
    recorder = TraceRecorder(stop_at_dynamic)
    ex = StreamExecutor(
        _TraceBackend(markers, default_system),
        arguments,
        default_sampling or default_sampling_params(),
        stream=False,
        use_thread=False,
        tracer=recorder,
    )
    state = ProgramState(ex)
    error: Optional[BaseException] = None
    try:
        state.ret_value = func.call_body(state, arguments)
    except StopTracing:
        pass
    except Exception as e:  # noqa: BLE001 - the body did something a placeholder cannot do
        error = e
    ex.end()
    return state, recorder, error


def trace_program(func: Program, kwargs: dict[str, Any], backend: Any = None) -> TracedProgram:
    markers, default_system = _markers_of(backend)
    arguments = dict(func.bind_arguments)
    arguments.update(kwargs)
    for name in func.arg_names:
        if name not in arguments:
            arguments[name] = Placeholder("arg", name)
    state, recorder, error = _traced_run(func, arguments, markers, default_system, stop_at_dynamic=False)
    return TracedProgram(func, state, recorder, error)


def shared_constant_prefix(
    func: Program,
    backend: Any,
    batch_arguments: list[dict[str, Any]],
    default_sampling: Optional[SglSamplingParams] = None,
) -> str:
    """The text every program of the batch starts with before its first
    generation call, estimated from up to ``global_config.prefix_trace_samples``
    programs run up to their first ``gen``/``select``/``fork``."""
    markers, default_system = backend.get_role_markers(), backend.get_default_system_prompt()
    k = max(1, min(len(batch_arguments), global_config.prefix_trace_samples))
    # sample spread over the batch, always including the first and the last
    idx = sorted({round(i * (len(batch_arguments) - 1) / max(1, k - 1)) for i in range(k)})
    common: Optional[str] = None
    for i in idx:
        state, recorder, _ = _traced_run(func, batch_arguments[i], markers, default_system, True, default_sampling)
        p = constant_prefix_of(state.stream_executor.text_, recorder.first_dynamic_pos)
        if common is None:
            common = p
        else:
            j = 0
            m = min(len(common), len(p))
            while j < m and common[j] == p[j]:
                j += 1
            common = common[:j]
        if not common:
            break
    return common or ""
