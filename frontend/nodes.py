"""The expression nodes of frontend programs: pure data.

A program is ordinary Python that appends expressions to a program state
(``s += expr``). Expressions are small nodes: constant text, generation calls,
choice selection, role and variable-scope brackets, and lists of those (built
with ``+``). This module only defines them; of the frontend it imports only
the sampling-parameter record a ``gen`` carries. ``execute.py`` says what
each node does to a program state, ``tracer.py`` records them, and
``function.py`` holds the program object (``@function``). ``ir.py`` exports
them under SGLang's names, with the rest of ``sglang.lang.ir``.

``SglGetForkItem``, a node of SGLang's tracer that radixrt's does not use,
raises ``NotImplementedError``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional

from .sampling_params import SglSamplingParams

_ids = itertools.count()


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
    """A flat sequence of expressions (nested lists are flattened, ``None`` dropped)."""

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
    """Literal text appended to the program."""

    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def _repr_fields(self) -> str:
        v = self.value if len(self.value) < 60 else self.value[:57] + "..."
        return repr(v)


class SglGen(SglExpr):
    """A generation call: its completion is appended and stored in ``name``
    (when given). ``sampling`` holds only the options the call set."""

    def __init__(self, name: Optional[str], sampling: SglSamplingParams) -> None:
        super().__init__()
        self.name = name
        self.sampling = sampling

    def _repr_fields(self) -> str:
        set_fields = {
            f.name: getattr(self.sampling, f.name)
            for f in dataclasses.fields(self.sampling)
            if getattr(self.sampling, f.name) is not None
        }
        return ", ".join([repr(self.name)] + [f"{k}={v!r}" for k, v in set_fields.items()])


class SglSelect(SglExpr):
    """Append the ``choices`` entry picked by ``choices_method`` and store it in ``name``."""

    def __init__(
        self,
        name: Optional[str],
        choices: list[str],
        temperature: float,
        choices_method: Any,
        lora: Optional[str] = None,
    ) -> None:
        super().__init__()
        if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)):
            # a string would be picked from character by character
            raise ValueError(f"choices must be a list of strings, got {type(choices).__name__}")
        if not choices:
            raise ValueError("select needs a non-empty list of choices")
        self.name = name
        self.choices = [str(c) for c in choices]
        self.temperature = temperature
        self.choices_method = choices_method
        self.lora = lora  # the LoRA adapter that scores the choices (None: the base model)

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
    """Image input (radixrt's models are text-only: executing it is an error)."""

    def __init__(self, path: Any) -> None:
        super().__init__()
        self.path = path


class SglVideo(SglExpr):
    """Video input (radixrt's models are text-only: executing it is an error)."""

    def __init__(self, path: Any, num_frames: int) -> None:
        super().__init__()
        self.path = path
        self.num_frames = num_frames


class SglSeparateReasoning(SglExpr):
    """After ``expr`` (a ``gen`` or ``select``, or a list of them): its variable's
    ``<think>...</think>`` block moves to ``<name>_reasoning_content`` (SGLang's
    ``separate_reasoning``; executed in frontend/execute.py)."""

    def __init__(self, model_type: Optional[str], expr: Optional[SglExpr]) -> None:
        super().__init__()
        self.model_type = model_type
        parts = expr.flatten() if isinstance(expr, SglExpr) else []
        self.names = [p.name for p in parts if isinstance(p, (SglGen, SglSelect)) and p.name is not None]
        self.name = self.names[0] if self.names else None


class SglArgument(_SglLabeledExpr):
    """A program argument seen by the tracer."""


class SglVariable(_SglLabeledExpr):
    """A reference to a generated variable seen by the tracer."""


class SglConcateAndAppend(SglExpr):
    """Append the text each of ``states`` (fork branches, already joined)
    added since the fork: ``forks.join("concate_and_append")``."""

    def __init__(self, states: list[Any]) -> None:
        super().__init__()
        self.states = list(states)


class SglGetForkItem(SglExpr):
    """SGLang's tracer node for ``forks[i]`` of a traced fork. radixrt's tracer
    records a fork as one :class:`SglFork` holding each branch's nodes, so
    there is no such node to build: constructing one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "SglGetForkItem is a node of SGLang's tracer; radixrt records a traced fork as one SglFork with "
            "each branch's nodes (TracedProgram.print_graph shows them)"
        )


class SglFork(SglExpr):
    """Recorded by the tracer: ``size`` branches, each with its own node list."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.branches: list[list[SglExpr]] = []

    def _repr_fields(self) -> str:
        return str(self.size)


def to_expr(x: Any) -> SglExpr:
    """``x`` as an expression: expressions as they are, str/int/float/bool as
    constant text, lists and tuples as an :class:`SglExprList`."""
    if isinstance(x, SglExpr):
        return x
    if isinstance(x, str):
        return SglConstantText(x)
    if isinstance(x, (int, float, bool)):
        return SglConstantText(str(x))
    if isinstance(x, (list, tuple)):
        return SglExprList(list(x))
    raise TypeError(f"cannot append a {type(x).__name__} to a program state; use a str or an expression")
