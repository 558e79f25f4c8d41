"""What each worker's radix cache holds, from its KV cache events.

A worker started with ``--kv-events-config`` publishes ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared`` (radixrt/memory/kv_events.py, vLLM's
schema) in batches numbered 0, 1, 2, ... on a ZMQ PUB socket. `KVEventIndex`
keeps, per worker, the set of block hashes it holds, and answers how many
leading blocks of a request's chain each worker holds (`match_tokens`).

A block's hash chains its ``block_size`` tokens to the hash of the block
before it, the first block to ``namespace_seed(namespace)``
(`block_hashes`; the same 64-bit BLAKE2b as the worker's recorder). So a
router that knows a request's token ids and namespace (its ``cache_salt``)
computes the same hashes the worker published.

Sync. The events describe changes, so the set is right only when the router
saw every event since the worker's cache was empty: its stream from batch 0
(a fresh worker), or from an ``AllBlocksCleared`` (a ``/flush_cache``). A
worker is *live* (`live`) from then on, until a batch is missed (a gap in the
numbers: the set is cleared and the worker waits for the next
``AllBlocksCleared``), its publisher restarts (numbers start again: live
again if at 0) or its connection drops (`disconnected`: cleared, not live).
The policy uses the events only while the workers it chooses among are live.

Storage. Events whose medium is ``STORAGE:<store>`` (radixrt/memory/kv_events.py)
describe a worker's storage tier: they go into a set per store, shared by
every worker that announces that store (a shared Redis), not into the
worker's own set, and a flush leaves them. A worker's match is the longer of
its own prefix and its stores'. A store's set is a hint: a block evicted by
Redis itself, or written before the router started, is not known.

Memory: at most ``max_blocks`` hashes per worker and per store, and at most
`MAX_STORES` stores (events naming another are ignored and counted); past
``max_blocks`` the oldest stored go first (the index then under-counts, never
over-counts). Thread-safe: the subscriber thread writes, the router's event
loop reads; a batch is applied `APPLY_CHUNK` hashes at a time, the lock
released between them, so one huge batch from a worker cannot hold a routing
decision for seconds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from radixrt.memory.kv_events import (
    STORAGE_MEDIUM_PREFIX,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hashes,
    chain_hash,
)

__all__ = ["KVEventIndex", "TokenKey", "WorkerBlocks", "block_hashes", "chain_hash"]

DEFAULT_MAX_BLOCKS = 2**20
MAX_STORES = 16  # distinct storage media the index keeps sets for (a worker announces one or two)
APPLY_CHUNK = 4096  # hashes applied per hold of the lock


class TokenKey(NamedTuple):
    """A request's prompt as the worker's radix cache sees it: its cache
    namespace (None: the shared one) and its token ids."""

    namespace: Optional[str]
    ids: tuple[int, ...]


@dataclass
class WorkerBlocks:
    """One worker's blocks and the state of its event stream."""

    blocks: "OrderedDict[int, None]" = field(default_factory=OrderedDict)
    block_size: Optional[int] = None  # from its BlockStored events
    synced: bool = False  # every event since an empty cache was seen
    last_seq: Optional[int] = None
    connected: bool = False
    batches: int = 0
    gaps: int = 0  # batches missed (sequence numbers skipped)
    restarts: int = 0  # the sequence numbers started again
    overflow: int = 0  # hashes dropped past max_blocks
    ignored: int = 0  # events ignored: a store past MAX_STORES, a block size below 1
    last_event: Optional[float] = None  # time.monotonic() of the last batch
    stores: set[str] = field(default_factory=set)  # the storage media it announced

    def clear(self) -> None:
        self.blocks.clear()


@dataclass
class StoreBlocks:
    """The blocks one store holds, as its workers announced them."""

    blocks: "OrderedDict[int, None]" = field(default_factory=OrderedDict)
    block_size: Optional[int] = None


class KVEventIndex:
    """Per worker url, the block hashes its cache holds (see the module docstring)."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._workers: dict[str, WorkerBlocks] = {}
        self._stores: dict[str, StoreBlocks] = {}
        self._lock = threading.Lock()

    def _get(self, worker: str) -> WorkerBlocks:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = WorkerBlocks()
        return w

    # ------------------------------------------------------------------ the stream
    def apply(self, worker: str, seq: int, batch: KVEventBatch) -> None:
        """Apply batch number ``seq`` of ``worker``'s stream (sync rules: module docstring)."""
        with self._lock:
            w = self._get(worker)
            w.connected = True
            last = w.last_seq
            if last is None or seq <= last:  # the first batch seen, or a publisher that restarted
                if last is not None:
                    w.restarts += 1
                w.clear()
                w.synced = seq == 0
            elif seq != last + 1:
                w.gaps += seq - last - 1
                w.clear()
                w.synced = False
            w.last_seq = seq
            w.batches += 1
            w.last_event = time.monotonic()
        for event in batch.events:
            hashes = getattr(event, "block_hashes", ())
            for start in range(0, max(len(hashes), 1), APPLY_CHUNK):
                with self._lock:
                    self._apply_event(w, event, hashes[start : start + APPLY_CHUNK])

    def _apply_event(self, w: WorkerBlocks, event: Any, hashes: Sequence[int]) -> None:
        """Apply ``event`` to ``w`` (or its store) for ``hashes``, a slice of its block hashes."""
        medium = getattr(event, "medium", None)
        target: Any = w
        if isinstance(medium, str) and medium.startswith(STORAGE_MEDIUM_PREFIX):
            if medium not in self._stores and len(self._stores) >= MAX_STORES:
                w.ignored += 1
                return
            w.stores.add(medium)
            target = self._stores.setdefault(medium, StoreBlocks())
        if isinstance(event, BlockStored):
            if not isinstance(event.block_size, int) or event.block_size < 1:
                w.ignored += 1
                return
            target.block_size = event.block_size
            for h in hashes:
                target.blocks[h] = None
                target.blocks.move_to_end(h)
            while len(target.blocks) > self.max_blocks:
                target.blocks.popitem(last=False)
                w.overflow += 1
        elif isinstance(event, BlockRemoved):
            for h in hashes:
                target.blocks.pop(h, None)
        elif isinstance(event, AllBlocksCleared):
            w.clear()
            w.synced = True

    def next_seq(self, worker: str) -> int:
        """The batch number that follows the last one seen from ``worker`` (0 before any)."""
        with self._lock:
            w = self._workers.get(worker)
            return 0 if w is None or w.last_seq is None else w.last_seq + 1

    def empty(self, worker: str) -> None:
        """``worker``'s publisher has published nothing yet (its replay socket
        says so): its cache is empty, and the worker is live."""
        with self._lock:
            w = self._get(worker)
            w.clear()
            w.synced = True
            w.last_seq = None

    def connected(self, worker: str) -> None:
        """The subscriber's connection to ``worker``'s publisher is up (it is not
        live before a batch 0 or an ``AllBlocksCleared`` comes through it)."""
        with self._lock:
            self._get(worker).connected = True

    def disconnected(self, worker: str) -> None:
        """The connection dropped (the worker stopped or restarted): forget its blocks."""
        with self._lock:
            w = self._get(worker)
            w.connected = False
            w.synced = False
            w.last_seq = None
            w.clear()

    # ------------------------------------------------------------------ queries
    def live(self, worker: str) -> bool:
        """Whether ``worker``'s set is known to be complete (see Sync)."""
        with self._lock:
            w = self._workers.get(worker)
            return w is not None and w.synced

    def match(self, worker: str, hashes: Iterable[int]) -> int:
        """How many leading hashes of ``hashes`` (a request's chain) ``worker`` holds."""
        with self._lock:
            w = self._workers.get(worker)
            held = w.blocks if w is not None else {}
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            return n

    def match_tokens(self, workers: Sequence[str], key: TokenKey) -> Optional[dict[str, int]]:
        """Per worker of ``workers``, how many leading tokens of ``key`` its cache
        holds (whole blocks); None unless every one of them is live. Hashes are
        computed only as far as some worker still matches."""
        with self._lock:
            states = [self._workers.get(u) for u in workers]
            if not workers or any(s is None or not s.synced for s in states):
                return None
            out = {u: 0 for u in workers}
            by_size: dict[int, list[str]] = {}
            for u, s in zip(workers, states):
                if s is not None and s.block_size and s.blocks:
                    by_size.setdefault(s.block_size, []).append(u)
            for size, group in by_size.items():
                alive = list(group)
                for i, h in enumerate(block_hashes(key.namespace, key.ids, size)):
                    alive = [u for u in alive if h in self._workers[u].blocks]
                    if not alive:
                        break
                    for u in alive:
                        out[u] = (i + 1) * size
            stored = {m: self._store_match(m, key) for s in states if s is not None for m in s.stores}
            for u, s in zip(workers, states):
                for m in s.stores if s is not None else ():
                    out[u] = max(out[u], stored[m])
            return out

    def _store_match(self, medium: str, key: TokenKey) -> int:
        """Leading tokens of ``key`` the store ``medium`` holds (whole blocks)."""
        store = self._stores[medium]
        if not store.block_size:
            return 0
        n = 0
        for h in block_hashes(key.namespace, key.ids, store.block_size):
            if h not in store.blocks:
                break
            n += 1
        return n * store.block_size

    def held_tokens(self, worker: str) -> int:
        """Tokens ``worker`` holds per its events (blocks x block size)."""
        with self._lock:
            w = self._workers.get(worker)
            return len(w.blocks) * (w.block_size or 0) if w is not None else 0

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: live, connected, blocks, block_size, batches, gaps, restarts,
        overflow, ignored events, seconds since its last batch and its stores' sizes."""
        now = time.monotonic()
        with self._lock:
            return {
                u: {
                    "live": w.synced,
                    "connected": w.connected,
                    "blocks": len(w.blocks),
                    "block_size": w.block_size,
                    "batches": w.batches,
                    "gaps": w.gaps,
                    "restarts": w.restarts,
                    "overflow": w.overflow,
                    "ignored": w.ignored,
                    "last_event_age_s": None if w.last_event is None else round(now - w.last_event, 3),
                    "stores": {m: len(self._stores[m].blocks) for m in sorted(w.stores)},
                }
                for u, w in self._workers.items()
            }
