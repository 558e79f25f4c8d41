"""Planning a restore from the file store (kv_store_restore.py): which stored
sequences come back after a restart, in what order, and what is left out
(tampered frame heads, missing ancestors, namespaces the store cannot name)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from radixrt.memory.kv_store import BlockMeta, StoreIdentity, block_keys, namespace_seed
from radixrt.memory.kv_store_file import FileKVStore
from radixrt.memory.kv_store_restore import RestoreRun, plan_restore

IDENTITY = StoreIdentity(model="ab" * 16, kv_dtype="auto/torch.float32", page_size=1, block_tokens=4, page_bytes=8)


def store_sequence(store: FileKVStore, tokens: list[int], namespace: Optional[str] = None) -> list[bytes]:
    """Write the whole blocks of ``tokens`` (oldest first) as the storage tier does; their keys."""
    B = IDENTITY.block_tokens
    keys = block_keys(IDENTITY, namespace, tokens, len(tokens) // B)
    parent = namespace_seed(IDENTITY, namespace)
    for j, key in enumerate(keys):
        block = tuple(tokens[j * B : (j + 1) * B])
        store.put(key, bytes([j]) * IDENTITY.block_bytes, BlockMeta(parent, block, namespace))
        os.utime(store._path(key), (time.time(), time.time() + len(store._index) * 1e-3))  # distinct mtimes
        parent = key
    return keys


def sequences(runs: list[RestoreRun]) -> dict[tuple[Optional[str], tuple[int, ...]], int]:
    """What the runs cache: each run's whole sequence, with where its blocks start; and
    every run's parent sequence is cached by an earlier run."""
    cached: dict[tuple[Optional[str], tuple[int, ...]], int] = {}
    for run in runs:
        assert run.start == 0 or (run.namespace, tuple(run.tokens[: run.start])) in cached
        assert len(run.tokens) - run.start == 4 * len(run.keys)
        assert block_keys(IDENTITY, run.namespace, run.tokens, len(run.tokens) // 4)[run.start // 4 :] == run.keys
        cached[(run.namespace, tuple(run.tokens))] = run.start
    return cached


def test_a_reopened_store_restores_its_sequences_parents_first_in_runs(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    system = list(range(100, 116))  # 4 blocks shared by two agents
    store_sequence(store, system + list(range(200, 212)))
    store_sequence(store, system + list(range(300, 308)))
    store_sequence(store, list(range(400, 408)), namespace='["tenant-a", null]')
    reopened = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    runs = plan_restore(reopened, max_blocks=100, max_run_blocks=3)
    cached = sequences(runs)
    assert ('["tenant-a", null]', tuple(range(400, 408))) in cached  # the namespace came back by name
    assert (None, tuple(system + list(range(200, 212)))) in cached and (
        None,
        tuple(system + [300, 301, 302, 303, 304, 305, 306, 307]),
    ) in cached
    assert max(len(r.keys) for r in runs) == 3 and sum(len(r.keys) for r in runs) == 4 + 3 + 2 + 2
    assert runs[0].namespace == '["tenant-a", null]'  # the most recently used first


def test_the_budget_takes_the_most_recent_sequences_with_their_ancestors(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    old = store_sequence(store, list(range(40)))  # 10 blocks
    store_sequence(store, list(range(8)) + [900, 901, 902, 903])  # shares old's first 2 blocks
    for key in old[:2]:  # an agent's prefix read long ago: its blocks are older than the new tail
        os.utime(store._path(key), (1.0, 1.0))
    reopened = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    runs = plan_restore(reopened, max_blocks=5, max_run_blocks=8)
    assert sequences(runs) == {(None, tuple(list(range(8)) + [900, 901, 902, 903])): 0}
    assert plan_restore(reopened, max_blocks=2, max_run_blocks=8) == []  # a sequence that does not fit stops it


def test_tampered_heads_missing_ancestors_and_unknown_namespaces_are_left_out(tmp_path: Path) -> None:
    store = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    a = store_sequence(store, list(range(0, 16)))
    b = store_sequence(store, list(range(50, 66)))
    store_sequence(store, list(range(80, 88)), namespace="salted")
    head = store._path(a[2]).read_bytes()
    token_at = len(head) - IDENTITY.block_bytes - 16  # a token of block 2, in the frame's head
    tampered = bytearray(head)
    tampered[token_at] ^= 0x01
    store._path(a[2]).write_bytes(bytes(tampered))
    store._path(b[1]).unlink()
    for f in (tmp_path / "namespaces").iterdir():
        f.unlink()
    reopened = FileKVStore(tmp_path, IDENTITY, quota_bytes=1 << 20)
    assert reopened.read_meta(a[2]) is None and reopened.read_meta(a[1]) is not None
    cached = sequences(plan_restore(reopened, max_blocks=100, max_run_blocks=8))
    assert cached == {(None, tuple(range(0, 8))): 0, (None, tuple(range(50, 54))): 0}
