"""A restarted server reads its store back before any request asks
(``--hicache-storage-restore-tokens``): the most recently used stored
sequences are cached again, in the host tier and, while the device has room
to spare, on the device, so the first requests after a restart hit memory.

The reader thread plans the restore (kv_store_restore.py: frame heads only),
then reads the planned runs a chunk of at most `CHUNK_BLOCKS` blocks at a
time, and none while requests are held for their own storage reads, so a
request's lookup, queued on the same thread, waits for one chunk at most. `advance` (the scheduler's thread, from
`StorageTier.ready`, never blocking) reserves host slots for the next chunk
and, once it is read, caches each run as a host-only node (`insert_on_host`:
a run is cut at its first missing or corrupt block, and the runs below it are
then not cached), then loads it onto the device when at least half of the
device pool stays free afterwards (nothing is evicted for it: restored
sequences are ordinary, evictable cache) and no request is held, queued or
running: those copies run before the next forward, which would make a
request wait for sequences it may not need (it loads its own host hits).

Ownership: host slots reserved for a chunk are neither free nor the tree's
until `_cache` hands them to the tree or releases them, as for a held
request's read (``host free + tree + reading == total``). The restore never
reserves more than the host tier holds (its budget is capped there), so it
does not evict what it restored itself.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Executor, Future
from typing import Any, Optional, Protocol

from radixrt.memory.host_radix_cache import HostRadixCache
from radixrt.memory.kv_store import KVStore
from radixrt.memory.kv_store_restore import RestoreRun, plan_restore

logger = logging.getLogger(__name__)

CHUNK_BLOCKS = 48  # blocks read per chunk (about 18 MB of float32 KV of the embedded model)


class StorageReads(Protocol):
    """What a restore needs of the storage tier (`StorageTier`)."""

    store: KVStore
    tree: HostRadixCache
    block_tokens: int

    @property
    def reader(self) -> Executor:  # the tier's one reader thread
        ...

    def read_blocks(self, keys: list[bytes], host_slots: list[int]) -> int: ...


class StorageRestore:
    """One restore of up to ``max_tokens`` stored tokens into ``tier``'s tree."""

    def __init__(self, tier: StorageReads, max_tokens: int) -> None:
        self.tier = tier
        self.block_tokens = B = tier.block_tokens
        self.started = time.perf_counter()
        self.max_tokens = max_tokens
        self._planned: Optional["Future[list[RestoreRun]]"] = tier.reader.submit(
            plan_restore, tier.store, max_tokens // B, CHUNK_BLOCKS
        )
        self._runs: deque[RestoreRun] = deque()
        self._chunk: Optional[tuple[list[RestoreRun], list[int], "Future[list[int]]"]] = None
        self.done = False
        self.seconds: Optional[float] = None  # from the start to the last chunk cached
        self.host_tokens = 0  # tokens cached (host-only nodes)
        self.device_tokens = 0  # of them, loaded onto the device

    @property
    def pending(self) -> Optional[Future]:
        """What `advance` waits for (None when done)."""
        if self._planned is not None:
            return self._planned
        return self._chunk[2] if self._chunk is not None else None

    def advance(self, paused: bool = False, busy: bool = False) -> None:
        """Move the restore on as far as its reads allow (the scheduler's thread).
        ``paused``: start no new chunk (requests are waiting for their own reads);
        ``busy``: requests are queued or running, so load nothing onto the device."""
        if self.done:
            return
        if self._planned is not None:
            if not self._planned.done():
                return
            self._runs.extend(future_result(self._planned, []))
            self._planned = None
        if self._chunk is not None:
            runs, slots, read = self._chunk
            if not read.done():
                return
            self._chunk = None
            self._cache(runs, slots, future_result(read, [0] * len(runs)), to_device=not (paused or busy))
        if paused:
            return
        if self._runs:
            self._read_next()
        if self._chunk is None:
            self._finish()

    def _read_next(self) -> None:
        runs: list[RestoreRun] = []
        blocks = 0
        while self._runs and (not runs or blocks + len(self._runs[0].keys) <= CHUNK_BLOCKS):
            runs.append(self._runs.popleft())
            blocks += len(runs[-1].keys)
        slots = self.tier.tree.reserve_host(blocks * self.block_tokens)
        if slots is None:  # the host tier is full of what requests cached meanwhile
            self._runs.clear()
            return
        self._chunk = (runs, slots, self.tier.reader.submit(self._read, runs, slots))

    def _read(self, runs: list[RestoreRun], slots: list[int]) -> list[int]:
        """Each run's good leading blocks, read into its part of ``slots`` (the reader thread)."""
        good, at = [], 0
        for run in runs:
            n = len(run.keys) * self.block_tokens
            good.append(self.tier.read_blocks(run.keys, slots[at : at + n]))
            at += n
        return good

    def _cache(self, runs: list[RestoreRun], slots: list[int], good: list[int], to_device: bool) -> None:
        tree = self.tier.tree
        at = 0
        for run, blocks in zip(runs, good):
            part = slots[at : at + len(run.keys) * self.block_tokens]
            at += len(part)
            n = blocks * self.block_tokens
            tree.release_host(part[n:])
            if not n:
                continue
            key = run.tokens[: run.start + n]
            self.host_tokens += tree.insert_on_host(key, part[:n], run.start, run.namespace)
            if to_device:
                self._to_device(key, run.namespace)

    def _to_device(self, key: list[int], namespace: Optional[str]) -> None:
        """Load the host-only part of cached ``key`` onto the device if half the pool stays free."""
        tree = self.tier.tree
        need = tree.match_prefix(key, namespace=namespace, record_stats=False).host_length
        device = tree.allocator
        assert device is not None
        if need and device.num_free_slots - need >= device.total_slots // 2:
            self.device_tokens += tree.match_prefix(key, namespace=namespace, record_stats=False, load_back=True).loaded

    def _finish(self) -> None:
        self.done = True
        self.seconds = time.perf_counter() - self.started
        if self.host_tokens:
            logger.info(
                "KV storage tier: restored %d tokens (%d onto the device) in %.2f s",
                self.host_tokens,
                self.device_tokens,
                self.seconds,
            )

    def stats(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "done": self.done,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "host_tokens": self.host_tokens,
            "device_tokens": self.device_tokens,
        }


def future_result(future: Future, default: Any) -> Any:
    """A storage read's result, or ``default`` when it raised (logged): a backend
    error is a miss, never a failed request or a stopped scheduler."""
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001
        logger.warning("KV store: read failed: %s", e)
        return default
