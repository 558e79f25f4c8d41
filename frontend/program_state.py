"""The program state: what a program body sees as ``s``.

A thin, user-facing wrapper over one :class:`StreamExecutor`. Building
(``s += expr``, role and ``var_scope`` blocks, ``fork``) never waits for
the backend; reading (``s["x"]``, ``text()``, ``messages()``, ``error()``)
waits for what it reads. ``text_iter`` / ``text_async_iter`` follow the
output as it streams (``run(stream=True)``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Iterator, Optional

from .executor import StreamExecutor
from .fork import ProgramStateGroup, fork_executors
from .nodes import SglExpr, SglRoleBegin, SglRoleEnd, SglVarScopeBegin, SglVarScopeEnd, role_turn


class ProgramState:
    """What a program body sees as ``s``."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None
        self._join_on_exit: Optional[ProgramStateGroup] = None  # set by `copy`: the group to join at `with`'s end

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

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """``size`` branches continuing from here (``position_ids_offset`` is
        accepted for compatibility and unused)."""
        return ProgramStateGroup([ProgramState(e) for e in fork_executors(self.stream_executor, size)], self)

    def copy(self, position_ids_offset: Any = None) -> "ProgramState":
        """One branch (``fork(1)``); used as ``with s.copy() as c:``, it is joined into this
        state when the block ends (SGLang's: ``c``'s new variables become lists here)."""
        group = self.fork(1, position_ids_offset)
        branch = group[0]
        branch._join_on_exit = group
        return branch

    def __enter__(self) -> "ProgramState":
        return self

    def __exit__(self, *exc: Any) -> None:
        group, self._join_on_exit = self._join_on_exit, None
        if group is not None:
            group.join()
            return
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
        """The program's first error, else the first error of a joined branch, else None."""
        self.stream_executor.sync()
        ex = self.stream_executor
        if ex.error_ is not None:
            return ex.error_
        return ex.branch_errors[0] if ex.branch_errors else None

    # --- streaming ----------------------------------------------------------
    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Yield text as it is produced (``run(stream=True)``): all text, or only
        the chunks of ``var_name``. Without streaming, yields the final text
        (or the variable) once."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        for chunk, _ in ex.log.iter_chunks(var_name):
            yield chunk

    async def text_async_iter(
        self, var_name: Optional[str] = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """:meth:`text_iter` for asyncio; with ``return_meta_data`` each item
        is ``(chunk, meta_info)``, as SGLang's frontend gives them: the output's
        logprob lists hold what is new since the previous item (the tokens of
        this chunk's text, and of chunks before it that brought no text), the
        counts (``completion_tokens``, ``output_token_logprobs_length``) are
        running totals."""
        ex = self.stream_executor
        if not ex.stream:
            value, meta = await self._final_async(var_name)
            yield (value, meta) if return_meta_data else value
            return
        sent: dict[str, int] = {}
        async for chunk, meta in ex.log.aiter_chunks(var_name):
            yield (chunk, _new_in_lists(meta, sent)) if return_meta_data else chunk

    async def _final_async(self, var_name: Optional[str]) -> tuple[Any, Any]:
        loop = asyncio.get_running_loop()
        if var_name is None:
            return await loop.run_in_executor(None, self.text), None
        value = await loop.run_in_executor(None, self.get_var, var_name)
        return value, self.stream_executor.meta_info.get(var_name)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    def __del__(self) -> None:
        """A state dropped without its branches joined (an abandoned fork) ends its executor's
        worker thread, as SGLang's does."""
        try:
            self.stream_executor.end()
        except Exception:  # noqa: BLE001 - __del__ must not raise
            pass


# the meta_info lists SGLang's frontend streams as deltas (its _INCREMENTAL_STREAMING_META_INFO_KEYS)
_STREAMED_LISTS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def _new_in_lists(meta: Any, sent: dict[str, int]) -> Any:
    """``meta`` with its streamed lists cut to what ``sent`` (their lengths already given) lacks."""
    if not isinstance(meta, dict):
        return meta
    out = dict(meta)
    for key in _STREAMED_LISTS:
        if isinstance(meta.get(key), list):
            out[key] = meta[key][sent.get(key, 0) :]
            sent[key] = len(meta[key])
    return out
