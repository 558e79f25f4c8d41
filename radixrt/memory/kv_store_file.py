"""`FileKVStore`: the storage tier in a directory (``--hicache-storage-backend file``).

Layout::

    <dir>/store.json                 the store's identity (model, KV dtype, page/block sizes)
    <dir>/blocks/<ab>/<key hex>.kv   one framed block (kv_store.py) per file
    <dir>/namespaces/<seed hex>      a cache namespace (its text), named by its sequences' seed

Restart-warm: opening the store reads ``store.json`` (a store written by
another model, KV dtype or layout is refused with `StoreMismatchError`) and
scans ``blocks/`` into an index (key -> size, in least-recently-used order by
file modification time), so the first request after a restart hits.

Torn writes: a block is written to a temporary file and renamed into place,
so a process killed mid-write leaves at most a ``.tmp`` file (removed at the
next open) and never a partial block under a block's name; every read
verifies the frame's checksum anyway (a corrupt block is deleted and is a
miss). Quota: when the blocks' bytes pass ``quota_bytes``, the least recently
used are deleted. A read refreshes a block's modification time, so the LRU
order survives restarts. Several servers may share one directory: `contains`
checks the file system, not only this process's index.

Reading back (`recent_keys`, `read_meta`): frames carry their tokens and
parent key, and each namespace other than the shared one is written once
under ``namespaces/``, so the most recently used sequences can be rebuilt
from the store alone (kv_store_restore.py). The namespaces (``cache_salt``
values) and token ids are as private as the KV beside them: the directory is
the server's own.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import threading
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Optional, Sequence

from radixrt.memory.kv_store import (
    HEADER,
    BlockMeta,
    KVStore,
    StoreIdentity,
    StoreMismatchError,
    frame,
    frame_meta,
    intact,
    namespace_seed,
    token_bytes,
)

logger = logging.getLogger(__name__)

IDENTITY_FILE = "store.json"


# namespace files one directory holds at most (each a cache_salt / prompt_cache_key pair, at most
# cache_fields.MAX_NAMESPACE_KEY_CHARS characters each): about 8 MB, beside the blocks' quota
MAX_NAMESPACES = 4096


class NotABlockFile(OSError):
    """Something other than a regular file where a block should be."""


def _open_block(path: Path) -> int:
    """A read-only descriptor of the block file at ``path``; OSError unless it is a regular
    file. A FIFO or a device put in its place would block a reader thread, and every storage
    read queued behind it, for good: it is opened without blocking and refused (a symbolic
    link too: the store never makes one, and it could point anywhere)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symbolic link (O_NOFOLLOW)
            raise NotABlockFile(f"{path} is a symbolic link") from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotABlockFile(f"{path} is not a regular file")
    return fd


class FileKVStore(KVStore):
    name = "file"

    def __init__(self, root: str | os.PathLike, identity: StoreIdentity, quota_bytes: int) -> None:
        super().__init__(identity)
        self.root = Path(root).expanduser()
        self.location = f"file://{socket.gethostname()}{self.root.resolve()}"
        self.blocks = self.root / "blocks"
        self.namespaces_dir = self.root / "namespaces"
        self.quota_bytes = int(quota_bytes)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._bytes = 0
        self.blocks.mkdir(parents=True, exist_ok=True)
        self.namespaces_dir.mkdir(exist_ok=True)
        self._check_identity()
        self._scan()
        self._namespaces: dict[bytes, Optional[str]] = {namespace_seed(identity, None): None}
        self._namespaces_full = False
        self._read_namespaces()

    def _check_identity(self) -> None:
        path = self.root / IDENTITY_FILE
        if path.exists():
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise StoreMismatchError(f"KV store {self.root}: unreadable {IDENTITY_FILE} ({e})") from None
            diff = self.identity.mismatch(stored)
            if diff:
                raise StoreMismatchError(
                    f"KV store {self.root} was written for other KV ({diff}); "
                    "give another --hicache-storage-dir or empty this one"
                )
            return
        tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        tmp.write_text(json.dumps(self.identity.as_dict(), indent=1))
        os.replace(tmp, path)

    def _scan(self) -> None:
        """Index the stored blocks (oldest first); remove torn temporary files."""
        found: list[tuple[float, bytes, int]] = []
        for sub in self.blocks.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)
                    continue
                try:
                    st = f.stat()
                    found.append((st.st_mtime, bytes.fromhex(f.stem), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        if found:
            logger.info("KV store %s: %d blocks (%.1f MiB)", self.root, len(found), self._bytes / 2**20)

    def _read_namespaces(self) -> None:
        for f in self.namespaces_dir.iterdir():
            if f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)
                continue
            try:
                seed, namespace = bytes.fromhex(f.name), f.read_text(encoding="utf-8")
            except (OSError, ValueError):
                continue
            if namespace_seed(self.identity, namespace) == seed:  # a torn or foreign file names nothing
                self._namespaces[seed] = namespace

    def _remember_namespace(self, namespace: str) -> None:
        seed = namespace_seed(self.identity, namespace)
        if seed in self._namespaces:
            return
        if len(self._namespaces) > MAX_NAMESPACES:  # a bound on the directory's namespace files
            if not self._namespaces_full:
                logger.warning(
                    "KV store %s: %d namespaces written; blocks of newer ones are served but not "
                    "rebuilt after a restart",
                    self.root,
                    MAX_NAMESPACES,
                )
                self._namespaces_full = True
            return
        path = self.namespaces_dir / seed.hex()
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(namespace, encoding="utf-8")
        os.replace(tmp, path)
        self._namespaces[seed] = namespace

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.blocks / h[:2] / f"{h}.kv"

    @property
    def local(self) -> bool:
        return True

    def known(self, key: bytes) -> bool:
        return key in self._index

    def contains(self, key: bytes) -> bool:
        return key in self._index or self._path(key).exists()

    def get(self, key: bytes) -> Optional[memoryview]:
        """As `KVStore.get`; the payload is a view of this thread's read buffer,
        valid until its next `get`."""
        scratch = getattr(self._local, "buf", None)
        if scratch is None:
            scratch = self._local.buf = bytearray(self.identity.block_bytes)
        payload = memoryview(scratch)
        return payload if self.get_into(key, [payload]) else None

    def get_into(self, key: bytes, dest: Sequence[memoryview]) -> bool:
        """One scatter read (``readv``) of the frame: its header into a small buffer,
        the payload straight into ``dest``, and one byte more to notice a longer file;
        then the frame is checked where it landed (`intact`)."""
        path = self._path(key)
        header, tokens, extra = bytearray(HEADER.size), bytearray(token_bytes(self.identity)), bytearray(1)
        try:
            fd = _open_block(path)
            try:
                size = os.readv(fd, [header, tokens, *dest, extra])
            finally:
                os.close(fd)
        except NotABlockFile:
            size = -1  # corrupt: deleted below
        except OSError:
            with self._lock:
                self.misses += 1
            self._forget(key)
            return False
        expected = HEADER.size + len(tokens) + self.identity.block_bytes
        if size != expected or not intact(self.identity, key, header, tokens, dest):
            logger.warning("KV store %s: block %s is corrupt; deleted (it will be recomputed)", self.root, key.hex())
            with self._lock:
                self.corrupt += 1
            self._delete(key)
            return False
        os.utime(path)  # the LRU order outlives the process
        with self._lock:  # several reader threads may share a long read
            self.hits += 1
            if key not in self._index:
                self._bytes += size
            self._index[key] = size
            self._index.move_to_end(key)
        return True

    def recent_keys(self) -> Iterator[bytes]:
        with self._lock:
            keys = list(self._index)
        return reversed(keys)

    def read_meta(self, key: bytes) -> Optional[BlockMeta]:
        try:
            with os.fdopen(_open_block(self._path(key)), "rb") as f:
                return frame_meta(self.identity, key, f.read(HEADER.size + token_bytes(self.identity)))
        except OSError:
            return None

    def namespaces(self) -> dict[bytes, Optional[str]]:
        return dict(self._namespaces)

    def put(self, key: bytes, payload: bytes | memoryview, meta: BlockMeta) -> None:
        if self.known(key):
            return
        if meta.namespace is not None:
            self._remember_namespace(meta.namespace)
        path = self._path(key)
        data = frame(self.identity, key, payload, meta)
        path.parent.mkdir(parents=True, exist_ok=True)  # (the folder may have been removed)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        self.written += 1
        with self._lock:
            self._index[key] = len(data)
            self._bytes += len(data)
        self._enforce_quota()

    def _enforce_quota(self) -> None:
        while True:
            with self._lock:
                if self._bytes <= self.quota_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
            self._path(key).unlink(missing_ok=True)
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(key)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def discard(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._delete(key)

    def _delete(self, key: bytes) -> None:
        self._forget(key)
        self._path(key).unlink(missing_ok=True)

    def size_bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict:
        return {
            **super().stats(),
            "directory": str(self.root),
            "quota_bytes": self.quota_bytes,
            "blocks": len(self._index),
            "namespaces": len(self._namespaces) - 1,
        }
