"""The storage tier under the host tier (``--hicache-storage-backend``): KV
that survives restarts and is shared between servers.

Writes (write-through): when a node enters the radix tree, the whole blocks
of ``block_tokens`` that end inside it (counted from the sequence's start)
are queued as one `StoreOp` with the device slots of the path, ordered like
the host tier's copies (after the forward that computes them, or before the
next forward when they are computed already: no later forward can overwrite
those slots first). The forward thread packs them into host-page bytes and
hands them to the writer thread, which writes them to the store. Blocks the
store already holds (or that are queued) are skipped.

Reads (prefetch): a new request whose prompt has whole blocks beyond what the
tree holds (device or host) is *held* (not yet waiting) while the reader
thread counts how many of its next blocks are stored (the probe). `ready`
(on the scheduler's thread) then reserves host slots for them and the reader
reads the blocks straight into those slots of the host pool, verifying each;
when that is done, `ready` inserts the good blocks into the tree as host-only
nodes and the request waits as usual: its admission loads them back like any
host hit. A missing or corrupt block ends the read there (the rest is
computed). The scheduler's thread never does storage I/O (with the file
backend it checks that the first block exists, a ``stat``, before holding a
request, so a miss costs no thread hop).

Restore (storage_restore.py): at start, the store's most recently used
sequences are read back the same way, in chunks on the reader thread, before
any request asks; a probed request first drops the blocks the tree cached
since it was held (`_skip_cached`), so nothing is read twice.

Ownership: held requests have no KV. Host slots reserved for a read are
neither free nor the tree's until `ready` hands them over
(``host free + tree + reading == total``, `HostRadixCache.reserve_host`); an
aborted request's read finishes into its slots before they are freed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch

from radixrt.memory.host_pool import HostKVPool, page_runs
from radixrt.memory.host_radix_cache import HostRadixCache
from radixrt.memory.kv_events import KVEventRecorder, block_hashes, storage_medium
from radixrt.memory.kv_pool import KVPool, prefault
from radixrt.memory.kv_store import BlockMeta, KVStore, StoreIdentity, block_keys, namespace_seed
from radixrt.memory.radix_node import TreeNode
from radixrt.scheduler.request import Req
from radixrt.scheduler.storage_restore import StorageRestore, future_result

logger = logging.getLogger(__name__)

READ_THREADS = max(1, min(4, os.cpu_count() or 1))  # threads sharing one long read (see `read_blocks`)
MIN_BLOCKS_PER_READ_THREAD = 8
WRITE_QUEUE_BLOCKS = 4096  # blocks waiting for the writer; beyond it new blocks are skipped (counted)
MAX_ANNOUNCED = 1 << 20  # blocks whose KV event hash is kept (to announce their eviction)
PREFAULT_MAX_BYTES = 1 << 30  # of each pool, backed at start when the store holds blocks (`prefault_pools`)


@dataclass(eq=False)
class _Held:
    """A request held while its blocks are looked up (``slots`` None) and then
    read into host slots reserved for it (``slots``); or, when another held
    request is reading the same first block (``leader``), until that read is in."""

    req: Req
    start: int  # first token of the read (a block boundary)
    keys: list[bytes]
    future: Optional["Future[int]"]  # blocks found (probe), then blocks read intact; None for a follower
    leader: Optional["_Held"] = None
    slots: Optional[list[int]] = None
    aborted: bool = False  # the request was aborted: the result is only cleaned up


class StorageTier:
    """The storage tier's runtime: a `KVStore`, one reader thread (with helpers
    for long reads) and one writer thread."""

    def __init__(self, store: KVStore, pool: HostKVPool, tree: HostRadixCache) -> None:
        self.store = store
        self.pool = pool
        self.tree = tree
        self.identity: StoreIdentity = store.identity
        self.block_tokens = self.identity.block_tokens
        self.held: list[_Held] = []
        self._host_bytes = pool.buf.numpy()  # the host pool's memory, which reads land in
        self._queued: set[bytes] = set()  # keys handed to the writer, not yet written
        self._writes: "queue.Queue[Optional[tuple[bytes, memoryview, BlockMeta]]]" = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="radixrt-kv-store-writer", daemon=True)
        self._writer.start()
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="radixrt-kv-store-reader")
        self._read_helpers = ThreadPoolExecutor(READ_THREADS - 1 or 1, thread_name_prefix="radixrt-kv-store-read")
        self._bad_lock = threading.Lock()
        self.loaded_tokens = 0  # tokens read from storage into the host tier
        self.skipped_blocks = 0  # writes dropped because the writer was behind
        self.prefault_pages = 0  # pages of each pool backed at start (`prefault_pools`)
        self.restore: Optional[StorageRestore] = None  # reading the store back at start (`start_restore`)
        tree.on_cached = self.on_cached
        # KV events (set by the scheduler when they are published): each block written is announced
        # with the store's medium, each block the quota evicts removed (radixrt/memory/kv_events.py)
        self.events: Optional[KVEventRecorder] = None
        self.medium = storage_medium(f"{store.location}#{self.identity.digest.hex()}")
        self._announce: dict[bytes, tuple[int, Optional[int], list[int]]] = {}  # queued key -> its event
        self._announced: "OrderedDict[bytes, int]" = OrderedDict()  # written key -> its event hash
        store.on_evict = self._on_evict

    def prefault_pools(self, device_pool: KVPool) -> Optional[threading.Thread]:
        """When the store holds blocks and the pools are in CPU memory (lazily
        backed), back the pages a restart's first reads will land in (the
        allocators hand out their first pages first), up to what the store
        holds and `PREFAULT_MAX_BYTES` per pool, on a thread: each page of a
        fresh pool otherwise faults on its first write, which took a restart's
        read and load of a 229 MB prefix about 0.2 s. Contents are unchanged,
        so the pools may be used meanwhile."""
        stored = min(self.store.size_bytes(), PREFAULT_MAX_BYTES)
        pages = min(stored // self.pool.page_bytes, self.pool.allocator.num_pages, device_pool.num_pages)
        if pages <= 0 or device_pool.device.type != "cpu":
            return None
        self.prefault_pages = pages

        def run() -> None:
            prefault(self.pool.buf, pages * self.pool.page_bytes)
            device_pool.prefault_pages(pages)

        thread = threading.Thread(target=run, name="radixrt-kv-prefault", daemon=True)
        thread.start()
        return thread

    # ------------------------------------------------------------------ writes
    def on_cached(self, namespace: Hashable, leaf: TreeNode, computed: bool) -> None:
        """Queue the blocks that end inside new node ``leaf`` (see the module docstring)."""
        keys_path, slots_path = _path_to(leaf)
        B = self.block_tokens
        end = len(keys_path)
        first = (end - len(leaf.key)) // B  # blocks ending inside the leaf start at this index or later
        blocks = [j for j in range(first, end // B) if (j + 1) * B > end - len(leaf.key)]
        if not blocks:
            return
        keys = block_keys(self.identity, namespace, keys_path, blocks[-1] + 1)
        todo = [j for j in blocks if keys[j] not in self._queued and not self.store.known(keys[j])]
        if not todo:
            return
        if self._writes.qsize() + len(todo) > WRITE_QUEUE_BLOCKS:
            self.skipped_blocks += len(todo)
            return
        slots = [s for j in todo for s in slots_path[j * B : (j + 1) * B]]
        todo_keys = [keys[j] for j in todo]
        seed = namespace_seed(self.identity, namespace)  # type: ignore[arg-type]  # namespaces are str or None
        metas = [
            BlockMeta(keys[j - 1] if j else seed, tuple(keys_path[j * B : (j + 1) * B]), namespace)  # type: ignore[arg-type]
            for j in todo
        ]
        self._queued.update(todo_keys)
        if self.events is not None:
            hashes = list(block_hashes(namespace, keys_path[: (todo[-1] + 1) * B], B))
            for j, key in zip(todo, todo_keys):
                self._announce[key] = (hashes[j], hashes[j - 1] if j else None, keys_path[j * B : (j + 1) * B])
        self.tree.host.transfers.store(
            slots, lambda rows: self._deliver(todo_keys, metas, rows), after_forward=not computed
        )

    def holds(self, node: TreeNode) -> bool:
        """Whether the last block ending inside ``node`` is known to be stored (a
        node no block ends in: False). For the debug view; no I/O."""
        keys_path, _ = _path_to(node)
        last = len(keys_path) // self.block_tokens - 1
        if last < 0 or (last + 1) * self.block_tokens <= len(keys_path) - len(node.key):
            return False
        namespace = self.tree._namespace_of(node)
        return self.store.known(block_keys(self.identity, namespace, keys_path, last + 1)[last])

    def _deliver(self, keys: list[bytes], metas: list[BlockMeta], rows: torch.Tensor) -> None:
        """The forward thread's packed rows of ``keys``' blocks, for the writer."""
        data = rows.numpy().data.cast("B")  # the rows stay alive through the views
        n = self.identity.block_bytes
        for i, (key, meta) in enumerate(zip(keys, metas)):
            self._writes.put((key, data[i * n : (i + 1) * n], meta))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                key, payload, meta = item
                event = self._announce.pop(key, None)
                try:
                    self.store.put(key, payload, meta)
                    if event is not None and self.events is not None:
                        self._announced_write(key, event)
                except OSError as e:
                    logger.warning("KV store: writing block %s failed: %s", key.hex(), e)
                finally:
                    self._queued.discard(key)
            finally:
                self._writes.task_done()

    def _announced_write(self, key: bytes, event: tuple[int, Optional[int], list[int]]) -> None:
        assert self.events is not None
        self.events.on_storage_block(*event, self.medium)
        self._announced[key] = event[0]
        if len(self._announced) > MAX_ANNOUNCED:
            self._announced.popitem(last=False)

    def _on_evict(self, key: bytes) -> None:
        """The store dropped ``key`` for its quota (the writer's thread)."""
        h = self._announced.pop(key, None)
        if h is not None and self.events is not None:
            self.events.on_storage_removed([h], self.medium)

    # ------------------------------------------------------------------- reads
    def hold(self, req: Req) -> bool:
        """Start looking ``req``'s next blocks up in storage; True when the request
        is held until `ready` returns it (False: it needs nothing from storage)."""
        cap = req.max_prefix_len
        B = self.block_tokens
        num_blocks = cap // B
        match = self.tree.match_prefix(req.seq[:cap], namespace=req.namespace, record_stats=False)
        start = (match.length + match.host_length) // B
        if start >= num_blocks:
            return False
        keys = block_keys(self.identity, req.namespace, req.seq, num_blocks)[start:]
        if self.store.local and not self.store.contains(keys[0]):
            return False
        leader = next((h for h in self.held if h.leader is None and h.keys[0] == keys[0]), None)
        if leader is not None:  # the same blocks are on their way: wait for them rather than read them twice
            self.held.append(_Held(req, start * B, keys, None, leader=leader))
        else:
            self.held.append(_Held(req, start * B, keys, self.reader.submit(self._probe, keys)))
        return True

    def _probe(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are stored (the reader thread)."""
        n = 0
        while n < len(keys) and self.store.contains(keys[n]):
            n += 1
        return n

    def read_blocks(self, keys: list[bytes], host_slots: list[int]) -> int:
        """Read the blocks ``keys`` into host slots ``host_slots`` (the reader
        thread; the slots are reserved for it); how many leading blocks are good.
        A long read is split into runs of blocks read by up to `READ_THREADS`
        threads at once (file reads, checksums and copies release the GIL)."""
        P = self.pool.allocator.page_size
        per_block = self.block_tokens // P
        pages = torch.tensor([s // P for s in host_slots[::P]])  # page numbers, not their first slots
        parts = max(1, min(READ_THREADS, len(keys) // MIN_BLOCKS_PER_READ_THREAD))
        bounds = [len(keys) * i // parts for i in range(parts + 1)]
        first_bad = [len(keys)]  # the first missing or corrupt block ends the read: later runs stop there
        helpers = [
            self._read_helpers.submit(self._read_run, keys, pages, per_block, bounds[i], bounds[i + 1], first_bad)
            for i in range(1, parts)
        ]
        try:
            self._read_run(keys, pages, per_block, bounds[0], bounds[1], first_bad)
        finally:
            wait(helpers)  # none may still write into the slots once this returns (or raises)
        for f in helpers:
            f.result()  # a helper's error is the read's
        if first_bad[0] + 1 < len(keys):
            # the chain's later blocks cannot be reached past the bad one: drop them, so that the
            # request, which computes them now, writes the whole chain again (else one per request)
            self.store.discard(keys[first_bad[0] + 1 :])
        return first_bad[0]

    def _read_run(
        self, keys: list[bytes], pages: torch.Tensor, per_block: int, start: int, end: int, first_bad: list[int]
    ) -> None:
        """Read blocks ``start..end-1`` straight into their host pages, stopping at
        the first missing or corrupt one (lowering ``first_bad[0]`` to it) or at
        ``first_bad[0]``."""
        for i in range(start, end):
            if i >= first_bad[0]:
                return
            if not self.store.get_into(keys[i], self._page_views(pages[i * per_block : (i + 1) * per_block].tolist())):
                with self._bad_lock:
                    first_bad[0] = min(first_bad[0], i)
                return

    def _page_views(self, pages: list[int]) -> list[memoryview]:
        """Writable byte views of host pages ``pages`` (in order), one per run of consecutive pages."""
        views = []
        for _, page, length in page_runs(pages):
            views.append(memoryview(self._host_bytes[page : page + length]).cast("B"))  # type: ignore[arg-type]
        return views

    def ready(self, busy: bool = False) -> list[Req]:
        """Held requests whose reads are done, with what was read now in the tree
        (host-only nodes); they go back to the waiting queue. A request whose probe
        found blocks gets host slots now and stays held while they are read.
        ``busy``: requests are queued or running (a restore loads nothing onto the
        device meanwhile)."""
        if self.restore is not None:
            self.restore.advance(paused=bool(self.held), busy=busy)
        out = []
        for h in list(self.held):  # leaders come before their followers
            if h.leader is not None:
                if h.leader not in self.held:
                    self.held.remove(h)
                    out += [] if h.aborted else [h.req]
                continue
            assert h.future is not None
            if not h.future.done():
                continue
            self.held.remove(h)
            result = future_result(h.future, 0)
            if h.slots is None and result and not h.aborted:  # probed: now read them into host slots
                result = self._skip_cached(h, result)
            if h.slots is None and result and not h.aborted:
                h.slots = self.tree.reserve_host(result * self.block_tokens)
                if h.slots is not None:
                    h.keys = h.keys[:result]
                    h.future = self.reader.submit(self.read_blocks, h.keys, h.slots)
                    self.held.append(h)
                    continue
            if h.slots is not None:
                self._insert(h, result)
            if not h.aborted:
                out.append(h.req)
        return out

    def _skip_cached(self, h: _Held, found: int) -> int:
        """Drop from probed ``h`` its leading blocks the tree cached since it was
        held (a restore's, another request's); how many found blocks are left."""
        req = h.req
        match = self.tree.match_prefix(req.seq[: req.max_prefix_len], namespace=req.namespace, record_stats=False)
        skip = min(found, max(0, (match.length + match.host_length - h.start) // self.block_tokens))
        h.keys = h.keys[skip:]
        h.start += skip * self.block_tokens
        return found - skip

    def _insert(self, h: _Held, good_blocks: int) -> None:
        assert h.slots is not None
        n = good_blocks * self.block_tokens
        self.tree.release_host(h.slots[n:])
        if n and not h.aborted:
            added = self.tree.insert_on_host(h.req.seq[: h.start + n], h.slots[:n], h.start, h.req.namespace)
            h.req.storage_tokens = added
            self.loaded_tokens += added
        elif n:
            self.tree.release_host(h.slots[:n])

    @property
    def busy(self) -> bool:
        """Whether requests are held or a restore is under way."""
        return bool(self.held) or (self.restore is not None and not self.restore.done)

    def start_restore(self, max_tokens: int) -> None:
        """Read up to ``max_tokens`` of the store's most recently used sequences back
        (storage_restore.py), capped at what the host tier holds."""
        max_tokens = min(max_tokens, self.pool.allocator.total_slots)
        if max_tokens >= self.block_tokens and self.store.local:
            self.restore = StorageRestore(self, max_tokens)

    def finish_restore(self, idle: Callable[[], None]) -> None:
        """Block until the restore is done (before any request arrives): ``idle``
        runs the copies it queued onto the device and waits briefly for its reads."""
        while self.restore is not None and not self.restore.done:
            self.restore.advance()
            idle()

    def wait(self, timeout_s: float) -> None:
        """Block until a held request's read or a restore's is done or ``timeout_s`` passed."""
        futures = [h.future for h in self.held if h.future is not None]
        if self.restore is not None and self.restore.pending is not None:
            futures.append(self.restore.pending)
        if futures:
            wait(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def drop(self, hit: Callable[[Req], bool]) -> list[Req]:
        """Stop holding the requests ``hit`` selects (aborts); returns them. A read
        in progress finishes first (into its host slots), then its slots are freed."""
        out = []
        for h in self.held:
            if not h.aborted and hit(h.req):
                h.aborted = True
                out.append(h.req)
        return out

    # ---------------------------------------------------------------- lifetime
    def flush(self) -> None:
        """Wait until every block handed to the writer is in the store."""
        self._writes.join()

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(30.0)
        self.reader.shutdown(wait=True)
        self._read_helpers.shutdown(wait=True)
        self.store.close()

    def stats(self) -> dict[str, Any]:
        return {
            **self.store.stats(),
            "loaded_tokens": self.loaded_tokens,
            "held_requests": sum(1 for h in self.held if not h.aborted),
            "write_queue_blocks": self._writes.qsize(),
            "skipped_blocks": self.skipped_blocks,
            "prefault_pages": self.prefault_pages,
            "restore": None if self.restore is None else self.restore.stats(),
            "restored_tokens": 0 if self.restore is None else self.restore.host_tokens,
            "restored_device_tokens": 0 if self.restore is None else self.restore.device_tokens,
        }


def _path_to(leaf: TreeNode) -> tuple[list[int], list[int]]:
    """The tokens and device slots from the namespace's root down to ``leaf``'s end."""
    nodes = []
    x: Optional[TreeNode] = leaf
    while x is not None and x.key:
        nodes.append(x)
        x = x.parent
    keys: list[int] = []
    slots: list[int] = []
    for node in reversed(nodes):
        keys.extend(node.key)
        slots.extend(node.value)
    return keys, slots


def model_fingerprint(model: torch.nn.Module, config: Any) -> str:
    """A hex digest of the model's weights (every parameter and buffer, in order)
    and its config (a `ModelConfig`; the checkpoint's own config without its
    path): the storage tier's model identity."""
    hf = getattr(config, "hf_config", None)
    described = {k: v for k, v in (hf.to_dict() if hf is not None else {}).items() if not k.startswith("_")}
    described.pop("transformers_version", None)
    plain = dataclasses.replace(config, hf_config=None) if hasattr(config, "hf_config") else config
    h = hashlib.blake2b(repr((plain, sorted(described.items(), key=str))).encode(), digest_size=16)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(name.replace(".base.", ".").encode())  # a LoRA wrapper (lora/batch.py) changes no weight
        data = t.detach().contiguous().cpu()
        if data.numel():
            h.update(data.view(torch.uint8).reshape(-1).numpy().data)
    return h.hexdigest()
