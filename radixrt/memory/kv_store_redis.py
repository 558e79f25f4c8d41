"""`RedisKVStore`: one storage tier shared by many servers
(``--hicache-storage-backend redis``, the `redis` client from PyPI).

Every server that computes a block writes it (``SET NX``: the first copy
stays), and every server looks blocks up there, so a prefix one server
computed is a hit for the others. Keys are ``radixrt:kv:<identity>:<block
key>``: servers of other models, KV dtypes or layouts share a Redis without
ever reading each other's blocks (their identities differ). Values are
framed and checksummed (kv_store.py): a corrupt value is deleted and is a
miss. Redis bounds its own memory: run it with ``maxmemory`` and
``maxmemory-policy allkeys-lru`` for a quota with LRU eviction.

Timeouts are short (``socket_timeout``): a slow or gone Redis turns into
misses and skipped writes, logged, never a failed request.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

from radixrt.memory.kv_store import BlockMeta, KVStore, StoreIdentity, frame, unframe

logger = logging.getLogger(__name__)

MAX_KNOWN = 1 << 20  # block keys remembered as stored (16 bytes each)


def without_password(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part shown as ``***`` (Redis URLs carry one)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


class RedisKVStore(KVStore):
    name = "redis"

    def __init__(self, url: str, identity: StoreIdentity, timeout_s: float = 2.0) -> None:
        super().__init__(identity)
        try:
            import redis
        except ImportError:
            raise RuntimeError("--hicache-storage-backend redis needs the redis client: pip install redis") from None
        self.url = self.location = without_password(url)  # what logs and stats show
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._errors = (redis.RedisError, OSError)
        self._prefix = b"radixrt:kv:" + identity.digest.hex().encode() + b":"
        self._known: set[bytes] = set()
        self._lock = threading.Lock()
        self._bytes = 0
        self.failures = 0
        try:
            self._client.ping()
        except self._errors as e:
            raise RuntimeError(f"KV store: cannot reach Redis at {self.url}: {e}") from None

    def _key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        if self.failures <= 3 or self.failures % 100 == 0:
            logger.warning("KV store %s: %s failed (%s); treated as a miss", self.url, what, e)

    @property
    def local(self) -> bool:
        return False

    def known(self, key: bytes) -> bool:
        return key in self._known

    def contains(self, key: bytes) -> bool:
        try:
            return bool(self._client.exists(self._key(key)))
        except self._errors as e:
            self._failed("EXISTS", e)
            return False

    def get(self, key: bytes) -> Optional[memoryview]:
        try:
            data: Optional[bytes] = self._client.get(self._key(key))  # a sync client: bytes or None
        except self._errors as e:
            self._failed("GET", e)
            return None
        if data is None:
            with self._lock:  # several reader threads may share a long read
                self.misses += 1
            return None
        payload = unframe(self.identity, key, data)
        if payload is None:
            logger.warning("KV store %s: block %s is corrupt; deleted (it will be recomputed)", self.url, key.hex())
            with self._lock:
                self.corrupt += 1
            try:
                self._client.delete(self._key(key))
            except self._errors as e:
                self._failed("DEL", e)
            return None
        with self._lock:
            self.hits += 1
        self._remember(key)
        return payload

    def put(self, key: bytes, payload: bytes | memoryview, meta: BlockMeta) -> None:
        if key in self._known:
            return
        data = frame(self.identity, key, payload, meta)
        try:
            if self._client.set(self._key(key), data, nx=True):
                self.written += 1
                self._bytes += len(data)
        except self._errors as e:
            self._failed("SET", e)
            return
        self._remember(key)

    def discard(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        with self._lock:
            self._known.difference_update(keys)
        try:
            self._client.delete(*(self._key(k) for k in keys))
        except self._errors as e:
            self._failed("DEL", e)

    def _remember(self, key: bytes) -> None:
        with self._lock:
            if len(self._known) >= MAX_KNOWN:  # a hint only: forgetting costs a redundant SET NX
                self._known.clear()
            self._known.add(key)

    def size_bytes(self) -> int:
        return self._bytes  # what this process wrote; Redis's INFO has the rest

    def close(self) -> None:
        self._client.close()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "url": self.url, "failures": self.failures}
