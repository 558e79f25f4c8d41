"""The Engine's streams: one event per update of a sample, as ``/generate`` streams them."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import AsyncIterator

from radixrt.requests.router import ReqGroup, ResultRouter


def stream_group(router: ResultRouter, group: ReqGroup, indexed: bool, incremental: bool) -> AsyncIterator[dict]:
    """The iterator of ``group``'s results (submitted on the running loop, whose loop it must be
    read in). Leaving it early aborts the requests, and so does dropping it unread (a generator
    that never started runs no ``finally``): its requests would run to their end for nobody."""
    stream = _events(router, group, indexed, incremental)
    weakref.finalize(stream, _abort_unread, router, group, asyncio.get_running_loop())
    return stream


async def _events(router: ResultRouter, group: ReqGroup, indexed: bool, incremental: bool) -> AsyncIterator[dict]:
    """Cumulative results, or only what is new with ``incremental`` (`ResultAccumulator.stream_chunk`);
    with ``indexed`` (a batch, or n > 1) each names its sample's position in the answer (``index``,
    as SGLang's)."""
    try:
        if asyncio.get_running_loop() is not group.mailbox.loop:  # its results go to the loop that started it
            raise RuntimeError("a stream must be read in the event loop that started it")
        while True:
            news = [(i, st) for i, st in enumerate(group.states) if st.has_news]
            for i, st in news:
                st.sent_version = st.version
                chunk = st.acc.stream_chunk(incremental)
                yield {**chunk, "index": i} if indexed else chunk
            if news:
                continue
            if all(st.done for st in group.states):
                return
            await group.event.wait()
            group.event.clear()
    finally:
        if not all(st.done for st in group.states):
            router.abort_group(group, "aborted: the stream was closed")


def _abort_unread(router: ResultRouter, group: ReqGroup, loop: asyncio.AbstractEventLoop) -> None:
    """Abort the requests of a stream collected unread, on the group's loop."""
    if not group.done:
        with contextlib.suppress(RuntimeError):  # that loop is closed: the router aborted them itself
            loop.call_soon_threadsafe(router.abort_group, group, "aborted: the stream was dropped unread")
