"""Pacing for the tree snapshots of ``GET /debug/radix``: the scheduler builds each one between
steps, so every client's generation waits for it. `SnapshotGate` lets one snapshot run at a
time, and after one that took ``t`` of the scheduler's time starts the next no sooner than
``DUTY_FACTOR * t`` later: snapshots take at most about a tenth of the scheduler's time, however
many clients ask (the page's default view, about 8 ms, leaves the next one free after 72 ms). A
request waits for its turn up to `MAX_WAIT_S`, then gets a 429 saying when to come back."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Awaitable, Callable, Optional

from radixrt.server.errors import ServerError

DUTY_FACTOR = 9.0  # the pause after a snapshot, in units of its own time: a tenth of the scheduler's at most
MAX_WAIT_S = 2.0


class SnapshotGate:
    """One per server (its event loop's): see the module docstring."""

    def __init__(self) -> None:
        self._lock: Optional[asyncio.Lock] = None
        self._next_at = 0.0  # time.monotonic() before which no snapshot starts

    async def run(self, snapshot: Callable[[], Awaitable[dict]]) -> dict:
        """``snapshot()``'s view (whose ``took_ms`` is its time on the scheduler) in its turn;
        ServerError 429 when the turn is more than `MAX_WAIT_S` away."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        deadline = time.monotonic() + MAX_WAIT_S
        try:
            await asyncio.wait_for(self._lock.acquire(), MAX_WAIT_S)
        except TimeoutError:
            raise self._busy(MAX_WAIT_S) from None
        try:
            wait = self._next_at - time.monotonic()
            if time.monotonic() + wait > deadline:
                raise self._busy(wait)
            if wait > 0:
                await asyncio.sleep(wait)
            view = await snapshot()
            self._next_at = time.monotonic() + DUTY_FACTOR * float(view.get("took_ms", 0.0)) / 1000
            return view
        finally:
            self._lock.release()

    @staticmethod
    def _busy(seconds: float) -> ServerError:
        return ServerError(
            429,
            f"tree snapshots are paced to a tenth of the scheduler's time; ask again in {math.ceil(seconds)} s "
            "(or ask for fewer nodes: max_nodes).",
        )
