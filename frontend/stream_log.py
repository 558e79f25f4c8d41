"""The log a streaming program state writes and its text iterators read.

With ``run(stream=True)`` the state's worker thread records every piece of
text as it is appended, tagged with the variable it belongs to (None for
constant text), and marks each generated variable done. Readers replay the
log from its start, so an iterator created late still sees every chunk, and
block until more arrives or the log is finished.

Contract: one writer (the worker thread); any number of readers, sync or
async. Nothing is appended after :meth:`StreamLog.finish`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Iterator, Optional

# (variable or None, text chunk or None meaning "variable done", meta info)
Entry = tuple[Optional[str], Optional[str], Any]


class StreamLog:
    def __init__(self) -> None:
        self._entries: list[Entry] = []
        self._cond = threading.Condition()
        self._finished = False

    # --- writer -------------------------------------------------------------------
    def add_chunk(self, var: Optional[str], chunk: str, meta: Any) -> None:
        self._add((var, chunk, meta))

    def mark_done(self, var: Optional[str], meta: Any) -> None:
        self._add((var, None, meta))

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _add(self, entry: Entry) -> None:
        with self._cond:
            self._entries.append(entry)
            self._cond.notify_all()

    # --- readers ------------------------------------------------------------------
    def _wait(self, i: int, timeout: Optional[float]) -> tuple[list[Entry], bool]:
        """The entries from index ``i`` on (waiting up to ``timeout`` for one
        when there are none yet) and whether the log is finished."""
        with self._cond:
            if i >= len(self._entries) and not self._finished:
                self._cond.wait(timeout)
            return self._entries[i:], self._finished

    def iter_chunks(self, var_name: Optional[str]) -> Iterator[tuple[str, Any]]:
        """``(chunk, meta)`` pairs of ``var_name`` (of all text when None),
        blocking, until the variable is done or the log is finished."""
        i = 0
        while True:
            entries, finished = self._wait(i, None)
            i += len(entries)
            chunks, var_done = chunks_of(entries, var_name)
            yield from chunks
            if var_done or (finished and not entries):
                return

    async def aiter_chunks(self, var_name: Optional[str]) -> AsyncIterator[tuple[str, Any]]:
        """:meth:`iter_chunks` for asyncio: waits in the loop's executor, in
        half-second slices, so the event loop is never blocked."""
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            entries, finished = await loop.run_in_executor(None, self._wait, i, 0.5)
            i += len(entries)
            chunks, var_done = chunks_of(entries, var_name)
            for chunk in chunks:
                yield chunk
            if var_done or (finished and not entries):
                return


def chunks_of(entries: list[Entry], var_name: Optional[str]) -> tuple[list[tuple[str, Any]], bool]:
    """The ``(chunk, meta)`` pairs of ``entries`` that a text iterator over
    ``var_name`` yields (every text chunk when ``var_name`` is None), and
    whether ``var_name`` was marked done among them (the pairs stop there)."""
    out = []
    for var, chunk, meta in entries:
        if var_name is None:
            if chunk is not None:
                out.append((chunk, meta))
        elif var == var_name:
            if chunk is None:
                return out, True
            out.append((chunk, meta))
    return out, False
