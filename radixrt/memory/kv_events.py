"""KV cache events for routers, in the schema vLLM and SGLang publish.

An external router that follows these events knows which prefixes a server
holds without guessing: ``BlockStored`` when KV enters the radix tree,
``BlockRemoved`` when it leaves, ``AllBlocksCleared`` when the tree is
flushed. The structs are vLLM's (``vllm/distributed/kv_events.py``):
msgspec structs, array-like and tagged, so that the msgpack bytes are the
ones vLLM's consumers decode (a ``KVEventBatch`` is ``[ts, [events...]]``,
an event ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium]``).

Blocks are the pool's pages (``block_size`` = ``page_size``). A block's hash
chains its page's tokens to the hash of the block before it, seeded by the
namespace (a request's ``cache_salt``), so equal prefixes in one namespace
get equal hashes and a router can rebuild the tree from ``token_ids`` and
``parent_block_hash`` alone. The hashes are 64-bit BLAKE2b.

`KVEventRecorder` watches the tree's nodes (radix_cache.py calls it on a new
leaf, a split, a node leaving, a reset): it keeps the hash at each node's end
(one int per node) and queues the events; `drain` hands them over.
Moving a node between the device and the host tier is not an event: the
prefix stays cached.

The storage tier (radixrt/scheduler/storage_tier.py) announces the blocks it
writes, and those its quota evicts, through the same recorder: events whose
``medium`` is ``STORAGE:<store>`` (`storage_medium`; the store's label is the
same on every server sharing that store) and whose blocks are the store's
(``block_size`` its ``--hicache-storage-block-tokens``), chained the same way.
A router then knows which prefixes a worker can read back from storage, and
which workers share a store. Torch-free; `KVEventRecorder` may be told of
storage blocks from the storage tier's writer thread.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Hashable, Optional, Union

import msgspec

if TYPE_CHECKING:
    from radixrt.memory.radix_node import TreeNode


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the three events (tagged with their class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


STORAGE_MEDIUM_PREFIX = "STORAGE:"


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a block of ``tokens`` after the block hashed ``parent``."""
    h = hashlib.blake2b(struct.pack(f"<Q{len(tokens)}q", parent, *tokens), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def namespace_seed(namespace: Hashable) -> int:
    """The hash a namespace's first block chains to."""
    tag = b"default" if namespace is None else b"ns:" + str(namespace).encode()
    return int.from_bytes(hashlib.blake2b(tag, digest_size=8).digest(), "little")


def block_hashes(namespace: Hashable, ids: Sequence[int], block_size: int) -> Iterable[int]:
    """The hashes of the whole blocks of ``ids`` in ``namespace``, lazily (a
    caller that stops early computes no more)."""
    parent = namespace_seed(namespace)
    for i in range(0, len(ids) - block_size + 1, block_size):
        parent = chain_hash(parent, ids[i : i + block_size])
        yield parent


def storage_medium(location: str) -> str:
    """The ``medium`` of a store's events: the same for every server that
    names the store by the same ``location``."""
    return STORAGE_MEDIUM_PREFIX + hashlib.blake2b(location.encode(), digest_size=6).hexdigest()


class KVEventRecorder:
    """Turns the tree's node changes into block events (see the module docstring).
    ``max_pending``: events kept while nobody drains (the oldest go first)."""

    def __init__(self, page_size: int, medium: Optional[str] = None, max_pending: int = 100_000) -> None:
        self.page_size = page_size
        self.medium = medium
        self.max_pending = max_pending
        self._end_hash: dict[int, int] = {}  # node id -> the hash of its last block
        self._pending: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]] = []
        self._lock = threading.Lock()  # the storage tier's writer thread pushes too
        self.dropped = 0  # events lost to max_pending

    # -- what the tree calls --------------------------------------------------------
    def on_node_insert(self, namespace: Hashable, node: "TreeNode") -> None:
        parent = self._parent_hash(namespace, node)
        hashes = self._hashes(parent, node.key)
        self._end_hash[node.id] = hashes[-1]
        first_parent = parent if node.parent is not None and node.parent.key else None  # None: a sequence's start
        self._push(BlockStored(hashes, first_parent, list(node.key), self.page_size, None, self.medium))

    def on_node_split(self, namespace: Hashable, upper: "TreeNode") -> None:
        """``upper`` was cut off the top of a node (which keeps its end and its hash)."""
        hashes = self._hashes(self._parent_hash(namespace, upper), upper.key)
        self._end_hash[upper.id] = hashes[-1]

    def on_node_remove(self, namespace: Hashable, node: "TreeNode") -> None:
        """``node`` leaves the tree (its parent still in it, or leaving after it)."""
        hashes = self._hashes(self._parent_hash(namespace, node), node.key)
        self._end_hash.pop(node.id, None)
        self._push(BlockRemoved(hashes, self.medium))

    def on_reset(self) -> None:
        self._end_hash.clear()
        self._push(AllBlocksCleared())

    # -- what the storage tier calls --------------------------------------------------
    def on_storage_block(self, block_hash: int, parent: Optional[int], tokens: list[int], medium: str) -> None:
        """A block of ``tokens`` (hash ``block_hash``, after the block hashed
        ``parent``; None at a sequence's start) was written to the store ``medium``."""
        self._push(BlockStored([block_hash], parent, tokens, len(tokens), None, medium))

    def on_storage_removed(self, hashes: list[int], medium: str) -> None:
        self._push(BlockRemoved(hashes, medium))

    # -- the consumer's side --------------------------------------------------------
    def drain(self) -> Optional[KVEventBatch]:
        """The events since the last call, as one batch (None when there are none)."""
        with self._lock:
            if not self._pending:
                return None
            events, self._pending = self._pending, []
        return KVEventBatch(ts=time.time(), events=events)

    # -- helpers --------------------------------------------------------------------
    def _parent_hash(self, namespace: Hashable, node: "TreeNode") -> int:
        parent = node.parent
        if parent is None or not parent.key:  # under a namespace's sub-root
            return namespace_seed(namespace)
        return self._end_hash[parent.id]

    def _hashes(self, parent: int, tokens: list[int]) -> list[int]:
        P = self.page_size
        out = []
        for i in range(0, len(tokens), P):
            parent = chain_hash(parent, tokens[i : i + P])
            out.append(parent)
        return out

    def _push(self, event: Union[BlockStored, BlockRemoved, AllBlocksCleared]) -> None:
        with self._lock:
            self._pending.append(event)
            if len(self._pending) > self.max_pending:
                del self._pending[0]
                self.dropped += 1


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes vLLM's consumers decode."""
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


def as_json(batch: KVEventBatch, with_tokens: bool) -> dict[str, Any]:
    """A batch for a JSON stream: each event a dict with its ``type`` (token ids
    left out unless ``with_tokens``)."""
    events = []
    for e in batch.events:
        d: dict[str, Any] = {"type": type(e).__name__, **msgspec.structs.asdict(e)}
        if not with_tokens:
            d.pop("token_ids", None)
        events.append(d)
    return {"ts": batch.ts, "events": events}
