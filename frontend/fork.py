"""Fork and join: ``s.fork(n)`` branches and ``forks.join()``.

Forking waits for the parent's queued expressions, then gives each branch
its own executor holding a copy of the parent's text, messages, open role,
variables and failures; the branches then run concurrently. With more than
one branch the parent's text is prefilled first
(``global_config.prefill_before_fork``) so that every branch hits the cached
prefix instead of computing it again.

Joining waits for the parent and every branch, records the branches' errors
on the parent (``error()`` reports them), merges their results into the
parent (see :meth:`ProgramStateGroup.join`) and ends the branches.
"""

from __future__ import annotations

from typing import Any

from .executor import StreamExecutor
from .global_config import global_config
from .nodes import SglCommitLazy, SglConcateAndAppend, SglExpr


def fork_executors(parent: StreamExecutor, size: int) -> list[StreamExecutor]:
    """``size`` new executors continuing from ``parent``'s current state."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:  # (2.5, "3" and True were taken)
        raise ValueError(f"fork size must be an integer >= 0, got {size!r}")
    if size > 1 and global_config.prefill_before_fork and parent.tracer is None:
        parent.submit(SglCommitLazy())
    parent.sync()
    return [_branch(parent, i, size) for i in range(size)]


def _branch(parent: StreamExecutor, index: int, size: int) -> StreamExecutor:
    tracer = parent.tracer.child(parent, index, size) if parent.tracer is not None else None
    c = StreamExecutor(
        parent.backend,
        parent.arguments,
        parent.default_sampling,
        stream=parent.stream,
        use_thread=parent.tracer is None,
        tracer=tracer,
    )
    c.text_ = parent.text_
    c.messages_ = [dict(m) for m in parent.messages_]
    c.cur_role = parent.cur_role
    c.cur_role_begin_pos = parent.cur_role_begin_pos
    c.variables = dict(parent.variables)
    c.meta_info = dict(parent.meta_info)
    c.var_scope_begin = dict(parent.var_scope_begin)
    c.failed_vars = dict(parent.failed_vars)
    c.error_ = parent.error_
    c.fork_start_text_pos = len(parent.text_)
    return c


class ProgramStateGroup:
    """The branches of ``s.fork(n)``: index or iterate them, ``forks += expr``
    appends to every branch, ``forks.join()`` merges them back."""

    def __init__(self, states: list[Any], src_state: Any) -> None:
        self.states = states
        self.src_state = src_state

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, i: int) -> Any:
        return self.states[i]

    def __setitem__(self, i: int, value: Any) -> None:
        if value is not self.states[i]:
            raise TypeError("fork branches cannot be replaced; use `forks[i] += expr`")

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        """``other`` to every branch: the same expression, a list with one
        per branch, or a function of the branch index."""
        for st, part in zip(self.states, self._parts(other)):
            st += part
        return self

    def _parts(self, other: Any) -> list[Any]:
        if callable(other) and not isinstance(other, SglExpr):
            return [other(i) for i in range(len(self.states))]
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} branches")
            return list(other)
        return [other] * len(self.states)

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. ``gather_variable`` (default, as SGLang's): each
        variable the branches set that the parent does not have becomes, on the
        parent, the list of the values of the branches that set it (in branch
        order), meta info likewise; the parent's own variables stay as they are.
        ``concate_and_append``: append the branches' new text to the parent."""
        parent = self.src_state.stream_executor
        branches = [st.stream_executor for st in self.states]
        _wait_all(parent, branches)
        if mode == "gather_variable":
            _gather_variables(parent, branches)
        elif mode in ("concate_and_append", "concatenate_and_append"):
            self.src_state += SglConcateAndAppend(self.states)
        else:
            raise ValueError(f"unknown join mode {mode!r}; use 'gather_variable' or 'concate_and_append'")
        for b in branches:
            b.end()


def _wait_all(parent: StreamExecutor, branches: list[StreamExecutor]) -> None:
    """Wait for ``parent`` and the branches; add the branches' own errors to
    the parent's ``branch_errors``."""
    parent.sync()
    for b in branches:
        b.sync()
    for b in branches:
        if b.error_ is not None and b.error_ is not parent.error_:
            parent.branch_errors.append(b.error_)


def _gather_variables(parent: StreamExecutor, branches: list[StreamExecutor]) -> None:
    for name in _new_in_branches(parent, branches):
        setting = [b for b in branches if name in b.variables or name in b.failed_vars]
        values = [b.variables.get(name) for b in setting]
        metas = [b.meta_info.get(name) for b in setting]
        parent.store_var(name, values, metas, has_meta=True)
        errs = [b.failed_vars[name] for b in setting if name in b.failed_vars]
        if errs:
            parent.failed_vars[name] = errs[0]


def _new_in_branches(parent: StreamExecutor, branches: list[StreamExecutor]) -> list[str]:
    """Every name some branch set that the parent does not have, in first-seen order."""
    have = set(parent.variables) | set(parent.failed_vars)
    return [n for n in dict.fromkeys(n for b in branches for n in b.assigned) if n not in have]
