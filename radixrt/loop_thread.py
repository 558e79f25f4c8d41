"""`LoopThread`: a private asyncio loop on a daemon thread, for the Engine's sync API."""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Awaitable, Iterator, TypeVar

T = TypeVar("T")

CLOSED_POLL_S = 0.5  # how often a waiting sync caller checks that the loop still runs


class LoopThread:
    """A private asyncio loop on a daemon thread; runs coroutines for sync callers."""

    def __init__(self) -> None:
        self.closed = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="radixrt-engine-loop", daemon=True)
        self.thread.start()

    def run(self, aw: Awaitable[T]) -> T:
        """Run ``aw`` on the loop and return its result; blocks the calling
        thread. If that thread is interrupted, the coroutine is cancelled."""
        if threading.current_thread() is self.thread:
            raise RuntimeError("a sync Engine method was called from the engine's own event loop")

        async def wrapped() -> T:
            return await aw

        if self.closed:
            raise RuntimeError("the engine was shut down")
        fut = asyncio.run_coroutine_threadsafe(wrapped(), self.loop)
        try:
            while True:
                try:
                    return fut.result(timeout=CLOSED_POLL_S)
                except TimeoutError:
                    if fut.done():  # the coroutine's own TimeoutError
                        raise
                    if self.closed and not self.thread.is_alive():  # nothing will ever run it
                        raise RuntimeError("the engine was shut down") from None
        finally:
            if not fut.done():
                fut.cancel()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        """A sync iterator over ``agen``; closing it (or leaving it early)
        closes ``agen`` on the loop."""
        try:
            while True:
                try:
                    item = self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if threading.current_thread() is self.thread:  # dropped on the loop itself: close it there
                asyncio.ensure_future(agen.aclose(), loop=self.loop)
            else:
                try:
                    self.run(agen.aclose())
                except RuntimeError:  # still running (its step was cancelled): it ends itself
                    pass

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the loop once the coroutines on it ended (their callers are waiting on them);
        those still running after ``grace_s`` are cancelled (their callers get CancelledError)
        rather than left waiting forever."""

        async def settle() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=grace_s)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=1.0)

        self.closed = True
        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(settle(), self.loop).result(timeout=grace_s + 2)
            except Exception:  # noqa: BLE001 - stopping regardless
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
