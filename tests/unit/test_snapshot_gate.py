"""The pacing of ``/debug/radix`` snapshots (radixrt/server/snapshot_gate.py): one at a time, the
next no sooner than nine times the last one's scheduler time later, a 429 when that is more than
the wait allowed (many clients looping on full listings stalled every client's generation)."""

from __future__ import annotations

import asyncio
import time

import pytest

from radixrt.server.errors import ServerError
from radixrt.server.snapshot_gate import MAX_WAIT_S, SnapshotGate


def _snapshot(took_ms: float, log: list[float]):
    async def snap() -> dict:
        log.append(time.monotonic())
        return {"took_ms": took_ms}

    return snap


def test_snapshots_take_at_most_a_tenth_of_the_scheduler() -> None:
    async def main() -> None:
        gate, starts = SnapshotGate(), []
        await gate.run(_snapshot(50.0, starts))  # cost 50 ms: the next starts 450 ms later at the soonest
        await asyncio.gather(*(gate.run(_snapshot(10.0, starts)) for _ in range(2)))
        assert starts[1] - starts[0] >= 0.44 and starts[2] - starts[1] >= 0.08  # one at a time, paced
        await gate.run(_snapshot(1000.0 * MAX_WAIT_S, starts))  # its pause is 9x that: past the wait allowed
        with pytest.raises(ServerError) as refused:
            await gate.run(_snapshot(1.0, starts))
        assert refused.value.status == 429 and "ask again in" in refused.value.message
        assert len(starts) == 4

    asyncio.run(main())
