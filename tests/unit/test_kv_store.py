"""The storage tier's stores: keys, frames and checksums, the file backend
(restart scan, identity check, quota, torn and corrupt blocks, a writer
killed with SIGKILL) and the Redis backend (a real redis-server on
127.0.0.1; skipped with the reason where it is not installed)."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest

from radixrt.memory.kv_store import (
    BlockMeta,
    KVStore,
    StoreIdentity,
    StoreMismatchError,
    block_keys,
    frame,
    namespace_seed,
    unframe,
)
from radixrt.memory.kv_store_file import FileKVStore

IDENTITY = StoreIdentity(model="ab" * 16, kv_dtype="auto/torch.float32", page_size=1, block_tokens=4, page_bytes=8)
BLOCK = IDENTITY.block_bytes  # 32 bytes


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(BLOCK))


def chain(tokens: list[int], namespace: Optional[str] = None, identity: StoreIdentity = IDENTITY) -> list[bytes]:
    """The keys of the whole blocks of ``tokens`` (their metas in `META`)."""
    B = identity.block_tokens
    keys = block_keys(identity, namespace, tokens, len(tokens) // B)
    parents = [namespace_seed(identity, namespace), *keys[:-1]]
    for j, (key, parent) in enumerate(zip(keys, parents)):
        META[key] = BlockMeta(parent, tuple(tokens[j * B : (j + 1) * B]), namespace)
    return keys


META: dict[bytes, BlockMeta] = {}


def test_block_keys_chain_prefixes_and_separate_namespaces_and_identities() -> None:
    tokens = list(range(12))
    keys = block_keys(IDENTITY, None, tokens, 3)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(IDENTITY, None, tokens[:8] + [99, 98, 97, 96], 3)[:2] == keys[:2]  # same prefix, same keys
    assert block_keys(IDENTITY, None, [0, 1, 2, 5] + tokens[4:], 3)[1] != keys[1]  # a block's key covers its prefix
    assert not set(block_keys(IDENTITY, "tenant-a", tokens, 3)) & set(keys)
    assert not set(block_keys(replace(IDENTITY, model="cd" * 16), None, tokens, 3)) & set(keys)
    assert not set(block_keys(replace(IDENTITY, kv_dtype="int8"), None, tokens, 3)) & set(keys)


def test_frames_refuse_flipped_bytes_other_keys_and_wrong_sizes() -> None:
    key = chain([1, 2, 3, 4])[0]
    data = frame(IDENTITY, key, payload(0), META[key])
    assert bytes(unframe(IDENTITY, key, data) or b"") == payload(0)
    for at in (0, 10, len(data) - 1, len(data) - BLOCK // 2):
        flipped = bytearray(data)
        flipped[at] ^= 0x40
        assert unframe(IDENTITY, key, bytes(flipped)) is None
    assert unframe(IDENTITY, b"\0" * 16, data) is None
    assert unframe(replace(IDENTITY, page_size=2, block_tokens=4, page_bytes=16), key, data) is None
    assert unframe(IDENTITY, key, data[:-1]) is None


def test_file_store_is_warm_after_reopening(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    keys = chain(list(range(40)))
    for i, k in enumerate(keys):
        store.put(k, payload(i), META[k])
    assert store.written == 10 and store.known(keys[3]) and store.contains(keys[3])
    reopened = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    assert all(reopened.known(k) for k in keys)
    assert [bytes(reopened.get(k) or b"") for k in keys] == [payload(i) for i in range(10)]
    assert reopened.hits == 10 and reopened.size_bytes() == store.size_bytes()
    assert reopened.get(b"\1" * 16) is None and reopened.misses == 1


def test_namespace_files_are_bounded(tmp_path: Path, monkeypatch) -> None:
    """Every cache_salt whose blocks are stored once wrote a file that nothing removed: a client
    naming a new one per request grew the directory without bound. Past MAX_NAMESPACES no more
    are written (their blocks are still served); a key is at most 1,024 characters (intake)."""
    import radixrt.memory.kv_store_file as kv_store_file
    from radixrt.requests.cache_fields import MAX_NAMESPACE_KEY_CHARS
    from radixrt.requests.errors import RequestError
    from radixrt.requests.intake import PromptBatch, build_specs

    monkeypatch.setattr(kv_store_file, "MAX_NAMESPACES", 3)
    store = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    for n in range(6):
        keys = chain(list(range(8)), namespace=f"tenant-{n}")
        store.put(keys[0], payload(n), META[keys[0]])
    assert len(list((tmp_path / "namespaces").iterdir())) == 3 and store.stats()["namespaces"] == 3
    assert all(store.contains(chain(list(range(8)), namespace=f"tenant-{n}")[0]) for n in range(6))
    with pytest.raises(RequestError, match="at most 1024"):
        build_specs(PromptBatch([[1, 2]], ["hi"], False, "text"), cache_salt="x" * (MAX_NAMESPACE_KEY_CHARS + 1))


def test_reads_land_straight_in_scattered_views_and_refuse_corrupt_blocks(tmp_path: Path) -> None:
    """`get_into` (the storage tier's read into host pages): the file store's scatter
    read, and the default over `get` that other stores use."""

    class InMemory(KVStore):  # a store with only `get`, as the Redis one
        local = True

        def __init__(self) -> None:
            super().__init__(IDENTITY)
            self.frames: dict[bytes, bytes] = {}

        def known(self, key: bytes) -> bool:
            return key in self.frames

        contains = known

        def get(self, key: bytes) -> Optional[memoryview]:
            return unframe(IDENTITY, key, self.frames[key]) if key in self.frames else None

        def put(self, key: bytes, data: bytes | memoryview, meta: BlockMeta) -> None:
            self.frames[key] = frame(IDENTITY, key, data, meta)

        def size_bytes(self) -> int:
            return sum(map(len, self.frames.values()))

        def discard(self, keys) -> None:
            for key in keys:
                self.frames.pop(key, None)

    store, other = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20), InMemory()
    keys = chain(list(range(8)))
    for s in (store, other):
        s.put(keys[0], payload(0), META[keys[0]])
        s.put(keys[1], payload(1), META[keys[1]])
    for reader in (store, other):
        memory = bytearray(2 * BLOCK)
        views = [memoryview(memory)[BLOCK : BLOCK + 8], memoryview(memory)[:24]]  # out of order, split
        assert reader.get_into(keys[0], views)
        assert bytes(memory[BLOCK : BLOCK + 8]) + bytes(memory[:24]) == payload(0)
    path = next(tmp_path.glob(f"blocks/*/{keys[1].hex()}.kv"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert not store.get_into(keys[1], [memoryview(bytearray(BLOCK))])
    assert store.corrupt == 1 and not path.exists() and not store.known(keys[1])
    path.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0x01, 0]))  # one byte too long
    store._index[keys[1]] = len(data) + 1
    assert not store.get_into(keys[1], [memoryview(bytearray(BLOCK))]) and store.corrupt == 2
    assert not store.get_into(b"\2" * 16, [memoryview(bytearray(BLOCK))]) and store.misses == 1


def test_file_store_refuses_another_model_dtype_or_layout(tmp_path: Path) -> None:
    FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    for other, word in (
        (replace(IDENTITY, model="cd" * 16), "model"),
        (replace(IDENTITY, kv_dtype="int8/torch.int8"), "kv_dtype"),
        (replace(IDENTITY, page_size=2, page_bytes=16), "page_size"),
        # deterministic mode's KV differs in the last bits, and it promises cached and computed KV agree
        (replace(IDENTITY, arithmetic="deterministic"), "arithmetic: store has 'default', server has 'deterministic'"),
    ):
        with pytest.raises(StoreMismatchError, match=word):
            FileKVStore(tmp_path, other, quota_bytes=1 << 20)
    assert json.loads((tmp_path / "store.json").read_text()).get("arithmetic") is None  # as older stores: usable
    deterministic = tmp_path / "deterministic"
    FileKVStore(deterministic, replace(IDENTITY, arithmetic="deterministic"), quota_bytes=1 << 20)
    with pytest.raises(StoreMismatchError, match="arithmetic: store has 'deterministic', server has 'default'"):
        FileKVStore(deterministic, IDENTITY, quota_bytes=1 << 20)


def test_file_store_refuses_a_store_of_older_frames(tmp_path: Path) -> None:
    """Directories written before the frames carried XXH3-64 (store.json has no frame_format)
    and before they carried their tokens (frame_format 2)."""
    for old_format, said in ((None, "None"), (2, "2")):
        FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
        old = json.loads((tmp_path / "store.json").read_text())
        old["frame_format"] = old_format
        (tmp_path / "store.json").write_text(json.dumps(old))
        with pytest.raises(StoreMismatchError, match=f"frame_format: store has {said}, server has 3"):
            FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
        (tmp_path / "store.json").unlink()


def test_file_store_quota_evicts_least_recently_used(tmp_path: Path) -> None:
    frame_bytes = len(frame(IDENTITY, b"\0" * 16, payload(0), BlockMeta(b"\0" * 16, (0, 1, 2, 3))))
    store = FileKVStore(tmp_path, IDENTITY, quota_bytes=3 * frame_bytes)
    evicted: list[bytes] = []
    store.on_evict = evicted.append  # the storage tier announces these as removed (KV events)
    keys = chain(list(range(16)))
    for i, k in enumerate(keys[:3]):
        store.put(k, payload(i), META[k])
    assert store.get(keys[0]) is not None  # keys[1] is now the least recently used
    store.put(keys[3], payload(3), META[keys[3]])
    assert store.evicted == 1 and evicted == [keys[1]] and store.size_bytes() <= 3 * frame_bytes
    assert not store.contains(keys[1]) and all(store.contains(k) for k in (keys[0], keys[2], keys[3]))


def test_corrupt_and_torn_blocks_are_refused_and_removed(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    keys = chain(list(range(12)))
    for i, k in enumerate(keys):
        store.put(k, payload(i), META[k])
    files = {k: store._path(k) for k in keys}
    data = bytearray(files[keys[0]].read_bytes())
    data[-3] ^= 0xFF
    files[keys[0]].write_bytes(bytes(data))
    files[keys[1]].write_bytes(files[keys[1]].read_bytes()[:20])  # torn
    torn_tmp = files[keys[2]].with_name(files[keys[2]].name + ".dead.tmp")
    torn_tmp.write_bytes(b"partial")
    reopened = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    assert not torn_tmp.exists()
    assert reopened.get(keys[0]) is None and reopened.get(keys[1]) is None
    assert reopened.corrupt == 2 and not files[keys[0]].exists() and not files[keys[1]].exists()
    assert bytes(reopened.get(keys[2]) or b"") == payload(2)


def test_a_fifo_or_a_link_in_a_blocks_place_is_refused_without_blocking(tmp_path: Path) -> None:
    """Whoever can write the store's folder (or a network file system gone odd) could leave a
    FIFO where a block was: opening it for reading blocked the reader thread, and every storage
    read behind it, for good. It is refused at once as corrupt and removed; so is a symlink.
    And a store whose blocks folder was removed while serving writes again."""
    import os
    import threading

    store = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    keys = chain(list(range(100, 112)))
    for i, k in enumerate(keys):
        store.put(k, payload(i), META[k])
    fifo, link = store._path(keys[0]), store._path(keys[1])
    fifo.unlink()
    os.mkfifo(fifo)
    link.unlink()
    link.symlink_to(store._path(keys[2]))
    results: list = []
    reader = threading.Thread(target=lambda: results.extend([store.read_meta(keys[0]), store.get(keys[0])]))
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive() and results == [None, None]
    assert store.get(keys[1]) is None and store.corrupt == 2
    assert not os.path.lexists(fifo) and not os.path.lexists(link)
    assert bytes(store.get(keys[2]) or b"") == payload(2)
    shutil.rmtree(store.blocks)
    store.put(keys[0], payload(0), META[keys[0]])
    assert bytes(store.get(keys[0]) or b"") == payload(0)


_WRITER = """
import sys
from radixrt.memory.kv_store import BlockMeta, StoreIdentity, block_keys, namespace_seed
from radixrt.memory.kv_store_file import FileKVStore
ident = StoreIdentity(model="ab" * 16, kv_dtype="auto/torch.float32", page_size=1, block_tokens=4, page_bytes=4096)
store = FileKVStore(sys.argv[1], ident, quota_bytes=1 << 40)
print("ready", flush=True)
i = 0
while True:
    block = [i, i + 1, i + 2, i + 3]
    meta = BlockMeta(namespace_seed(ident, None), tuple(block))
    store.put(block_keys(ident, None, block, 1)[0], bytes([i % 256]) * ident.block_bytes, meta)
    i += 1
"""


def test_a_writer_killed_mid_write_leaves_only_intact_blocks(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    ident = replace(IDENTITY, page_bytes=4096)
    store = FileKVStore(tmp_path, ident, quota_bytes=1 << 40)
    assert len(store._index) > 50, "the writer wrote for a second"
    assert not list(tmp_path.rglob("*.tmp"))
    for i in range(len(store._index) + 50):
        key = block_keys(ident, None, [i, i + 1, i + 2, i + 3], 1)[0]
        got = store.get(key)
        assert got is None or bytes(got) == bytes([i % 256]) * ident.block_bytes
    assert store.corrupt == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_url(tmp_path: Path):
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis client is not installed (pip install redis)")
    port = _free_port()
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def test_redis_store_is_shared_between_servers_of_one_identity(redis_url: str) -> None:
    from radixrt.memory.kv_store_redis import RedisKVStore

    a, b = RedisKVStore(redis_url, IDENTITY), RedisKVStore(redis_url, IDENTITY)
    other = RedisKVStore(redis_url, replace(IDENTITY, model="cd" * 16))
    keys = chain(list(range(8)))
    a.put(keys[0], payload(0), META[keys[0]])
    assert b.contains(keys[0]) and bytes(b.get(keys[0]) or b"") == payload(0)
    assert not b.contains(keys[1]) and not other.contains(keys[0])
    b.put(keys[0], payload(9), META[keys[0]])  # SET NX: the first copy stays
    assert bytes(a.get(keys[0]) or b"") == payload(0)
    a._client.set(a._key(keys[1]), frame(IDENTITY, keys[1], payload(1), META[keys[1]])[:-1] + b"\0")
    assert b.get(keys[1]) is None and b.corrupt == 1 and not a.contains(keys[1])


def test_a_redis_url_is_shown_without_its_password() -> None:
    """/get_server_info (any client's) and the store's logs and stats show the URL: never its password."""
    from radixrt.memory.kv_store_redis import without_password

    assert without_password("redis://:s3cret@cache:6379/1") == "redis://:***@cache:6379/1"
    assert without_password("rediss://app:s3cret@cache") == "rediss://app:***@cache"
    assert without_password("redis://localhost:6379/0") == "redis://localhost:6379/0"
