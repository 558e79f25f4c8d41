"""`LoopThread`: a private asyncio loop on a daemon thread, for the Engine's sync API."""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Awaitable, Iterator, TypeVar

T = TypeVar("T")


class LoopThread:
    """A private asyncio loop on a daemon thread; runs coroutines for sync callers."""

    def __init__(self) -> None:
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

        fut = asyncio.run_coroutine_threadsafe(wrapped(), self.loop)
        try:
            return fut.result()
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

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
