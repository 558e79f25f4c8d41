"""The storage tier's contract: KV blocks that outlive the process, keyed by
what they hold (torch-free).

A *block* is ``block_tokens`` consecutive tokens of a cached sequence, from a
multiple of ``block_tokens`` on; its payload is the host tier's page-first
bytes of those tokens (host_pool.py: every layer's K and V per page), so a
block crosses between storage and the host pool as it is.

Keys (`block_keys`): block ``j`` of a sequence is keyed by a 128-bit BLAKE2b
chained over the sequence's blocks ``0..j`` and seeded with the store's
`StoreIdentity` (the model's weights and config, the KV dtype, the page and
block sizes) and the cache namespace, so equal keys mean equal KV and no
tenant's key names another tenant's text.

Every stored value is framed (`frame`): a magic, the identity digest, the
key, its parent's key, the payload's length and the XXH3-64 checksum of the
block's tokens and payload; then the tokens (`BlockMeta`), then the payload.
`unframe` returns the payload only when all of them agree, so a torn or
flipped page is never served: a backend deletes it and reports a miss. The
tokens and the parent make a block self-describing: a store can be read back
into a radix tree without any request naming its text (`BlockMeta.verify`
checks them against the key, so they are as trustworthy as the key itself;
kv_store_restore.py).

Backends: kv_store_file.py (a directory: restart-warm, a quota with LRU
eviction) and kv_store_redis.py (one store shared by many servers).
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

import xxhash

MAGIC = b"RXKVBLK3"
# magic, identity digest, key, parent key, payload length, XXH3-64 of the tokens and the payload
HEADER = struct.Struct("<8s16s16s16sQQ")
# 1: CRC-32 frames; 2: XXH3-64 frames; 3: frames carrying their tokens and parent (a store of another
# format is refused)
FRAME_FORMAT = 3


class StoreMismatchError(ValueError):
    """The store was written by another model, KV dtype or page layout."""


@dataclass(frozen=True)
class StoreIdentity:
    """What makes stored KV usable by this server: equal identities, equal KV."""

    model: str  # hex digest of the model's weights and config (`model_fingerprint`)
    kv_dtype: str  # what the host tier stores (its payload format)
    page_size: int
    block_tokens: int
    page_bytes: int  # bytes of one host page (every layer's K and V of page_size tokens)
    frame_format: int = FRAME_FORMAT
    # "deterministic": the batch-invariant arithmetic of --enable-deterministic-inference, whose KV differs from
    # the default kernels' in the last bits (its promise: the same answer whether KV was cached or not)
    arithmetic: str = "default"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["arithmetic"] == "default":  # as stores written before the field: their blocks keep their keys
            del d["arithmetic"]
        return d

    @cached_property  # checked on every block read: computing it cost as much as the block's checksum
    def digest(self) -> bytes:
        text = repr(sorted(self.as_dict().items())).encode()
        return hashlib.blake2b(text, digest_size=16).digest()

    @property
    def block_bytes(self) -> int:
        return self.block_tokens // self.page_size * self.page_bytes

    def mismatch(self, other: dict[str, Any]) -> Optional[str]:
        """None when ``other`` (a stored identity) equals this one, else what differs."""
        ours, theirs = asdict(self), {"arithmetic": "default", **other}
        diffs = [f"{k}: store has {theirs.get(k)!r}, server has {v!r}" for k, v in ours.items() if theirs.get(k) != v]
        return "; ".join(diffs) or None


def namespace_seed(identity: StoreIdentity, namespace: Optional[str]) -> bytes:
    """The parent key of a sequence's first block in ``namespace``."""
    ns = b"default" if namespace is None else b"ns:" + str(namespace).encode()
    return hashlib.blake2b(identity.digest + ns, digest_size=16).digest()


def chain_key(parent: bytes, block: Sequence[int]) -> bytes:
    """The key of the block of tokens ``block`` that follows the block keyed ``parent``."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(block)}q", *block), digest_size=16).digest()


def block_keys(identity: StoreIdentity, namespace: Hashable, tokens: Sequence[int], num_blocks: int) -> list[bytes]:
    """Keys of the first ``num_blocks`` whole blocks of ``tokens`` in ``namespace``."""
    B = identity.block_tokens
    parent = namespace_seed(identity, namespace)  # type: ignore[arg-type]  # namespaces are str or None
    keys = []
    for j in range(num_blocks):
        parent = chain_key(parent, tokens[j * B : (j + 1) * B])
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class BlockMeta:
    """What a block holds: its tokens and the key of the block before it (the
    namespace's seed for a sequence's first block), both stored in its frame,
    and its cache namespace (None: the shared one), which a store keeps once per
    namespace rather than in every frame."""

    parent: bytes
    tokens: tuple[int, ...]
    namespace: Optional[str] = None

    def packed_tokens(self) -> bytes:
        return struct.pack(f"<{len(self.tokens)}i", *self.tokens)

    def verify(self, key: bytes) -> bool:
        """Whether this is what block ``key`` holds (its key chains from them)."""
        return chain_key(self.parent, self.tokens) == key


def token_bytes(identity: StoreIdentity) -> int:
    """Bytes of a frame's tokens (int32 each)."""
    return 4 * identity.block_tokens


def read_tokens(identity: StoreIdentity, data: bytes | bytearray | memoryview) -> tuple[int, ...]:
    return struct.unpack(f"<{identity.block_tokens}i", data)


def checksum(payload: Sequence[bytes | bytearray | memoryview]) -> int:
    """XXH3-64 of a payload given in parts (the same value as over their concatenation): catches
    torn writes and flipped bytes at about 12 GB/s on one core here, against CRC-32's 3 GB/s, which
    was most of a restart's read of a long prefix (the keys, not the checksum, must not collide)."""
    h = xxhash.xxh3_64()
    for part in payload:
        h.update(part)
    return h.intdigest()


def frame(identity: StoreIdentity, key: bytes, payload: bytes | memoryview, meta: BlockMeta) -> bytes:
    """The stored bytes of one block (header, tokens, payload)."""
    tokens = meta.packed_tokens()
    assert len(tokens) == token_bytes(identity)
    header = HEADER.pack(MAGIC, identity.digest, key, meta.parent, len(payload), checksum([tokens, payload]))
    return header + tokens + bytes(payload)


def unframe(identity: StoreIdentity, key: bytes, data: bytes | memoryview) -> Optional[memoryview]:
    """The payload of ``data`` if it is an intact frame of block ``key`` written
    under ``identity`` with the expected size, else None."""
    start = HEADER.size + token_bytes(identity)
    if len(data) < start:
        return None
    view = memoryview(data)
    payload = view[start:]
    return payload if intact(identity, key, view[: HEADER.size], view[HEADER.size : start], [payload]) else None


def intact(
    identity: StoreIdentity,
    key: bytes,
    header: bytes | bytearray | memoryview,
    tokens: bytes | bytearray | memoryview,
    payload: Sequence[memoryview],
) -> bool:
    """Whether ``header``, ``tokens`` and the payload read into the views
    ``payload`` (in order) are an intact frame of block ``key`` written under
    ``identity``."""
    fields = _header_of(identity, key, header)
    if fields is None or len(tokens) != token_bytes(identity):
        return False
    _, length, digest = fields
    if length != sum(v.nbytes for v in payload) or length != identity.block_bytes:
        return False
    return checksum([tokens, *payload]) == digest


def _header_of(
    identity: StoreIdentity, key: bytes, header: bytes | bytearray | memoryview
) -> Optional[tuple[bytes, int, int]]:
    """(parent key, payload length, checksum) of a frame header of block ``key``
    written under ``identity``; None for another magic, identity or key."""
    magic, ident, stored_key, parent, length, digest = HEADER.unpack_from(header)
    if magic != MAGIC or ident != identity.digest or stored_key != key:
        return None
    return parent, length, digest


def frame_meta(identity: StoreIdentity, key: bytes, head: bytes | bytearray | memoryview) -> Optional[BlockMeta]:
    """The `BlockMeta` a frame's first ``HEADER.size + token_bytes`` bytes state,
    when they belong to block ``key`` under ``identity`` and its key chains from
    them (the payload is not checked here: reading it does), else None. The
    namespace is left None: frames do not carry it (a sequence's first block
    names it by its parent, `KVStore.namespaces`)."""
    fields = _header_of(identity, key, head) if len(head) == HEADER.size + token_bytes(identity) else None
    if fields is None:
        return None
    meta = BlockMeta(fields[0], read_tokens(identity, memoryview(head)[HEADER.size :]))
    return meta if meta.verify(key) else None


class KVStore(ABC):
    """A store of framed blocks. Thread-safe: the scheduler's reader and writer
    threads call it; the scheduler's own thread only calls `known`.

    Counters (`stats`): blocks written, hits, misses, corrupt blocks refused,
    blocks evicted by a quota, bytes held.

    ``location`` names the store the same way on every server that shares it
    (the KV events' storage medium); ``on_evict``, when set, is called with
    each key the store drops to keep its quota (on the writer's thread)."""

    name = "store"
    location = ""

    def __init__(self, identity: StoreIdentity) -> None:
        self.identity = identity
        self.on_evict: Optional[Callable[[bytes], None]] = None
        self.written = 0
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self.evicted = 0

    @property
    @abstractmethod
    def local(self) -> bool:
        """Whether `contains` is cheap enough to call on the scheduler's thread."""

    @abstractmethod
    def known(self, key: bytes) -> bool:
        """Whether this process knows the block is stored (no I/O)."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether the block is stored (may do I/O)."""

    @abstractmethod
    def get(self, key: bytes) -> Optional[memoryview]:
        """The block's verified payload, or None (missing, or corrupt: then it is
        deleted and counted in ``corrupt``)."""

    def get_into(self, key: bytes, dest: Sequence[memoryview]) -> bool:
        """Read the block's verified payload into the writable byte views ``dest``
        (in order; their sizes add up to a block), as `get` counts it; False for a
        miss or a corrupt block (``dest`` then holds anything). Stores that can
        read straight into ``dest`` (a file's scatter read) override this."""
        payload = self.get(key)
        if payload is None:
            return False
        offset = 0
        for view in dest:
            view[:] = payload[offset : offset + view.nbytes]
            offset += view.nbytes
        return True

    @abstractmethod
    def put(self, key: bytes, payload: bytes | memoryview, meta: BlockMeta) -> None:
        """Store a block (idempotent: an existing block is kept)."""

    def recent_keys(self) -> Iterator[bytes]:
        """The stored blocks' keys, most recently used first, as far as this
        process knows without I/O (a store that keeps no index: none)."""
        return iter(())

    def read_meta(self, key: bytes) -> Optional[BlockMeta]:
        """What stored block ``key`` holds (`frame_meta`: its tokens and parent,
        verified against the key); None when it is missing or not verified. Reads
        the frame's head only."""
        return None

    def namespaces(self) -> dict[bytes, Optional[str]]:
        """The namespaces this store knows, by the seed their sequences chain from
        (`namespace_seed`): the shared one and those it wrote down."""
        return {namespace_seed(self.identity, None): None}

    @abstractmethod
    def discard(self, keys: Sequence[bytes]) -> None:
        """Delete these blocks (those held; no error for the others)."""

    @abstractmethod
    def size_bytes(self) -> int:
        """Bytes the store holds (as far as this process knows)."""

    def close(self) -> None:  # noqa: B027 (optional: most stores hold nothing to release)
        """Release connections and files."""

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "written_blocks": self.written,
            "hit_blocks": self.hits,
            "missed_blocks": self.misses,
            "corrupt_blocks": self.corrupt,
            "evicted_blocks": self.evicted,
            "stored_bytes": self.size_bytes(),
            "block_tokens": self.identity.block_tokens,
        }
