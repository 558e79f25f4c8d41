"""What a restart reads back from the storage tier before any request asks
(``--hicache-storage-restore-tokens``; torch-free).

Stored frames carry their tokens and their parent's key (kv_store.py), and a
store names the namespaces its sequences start in (`KVStore.namespaces`), so
the most recently used stored sequences can be rebuilt without a request
naming their text. `plan_restore` walks the store's keys from the most
recently used, follows each block's parents up to a sequence's first block
(reading only frame heads; a block whose key does not chain from the tokens
and parent it states, or whose ancestry is missing, is left out), and
returns the blocks found as `RestoreRun`s: unbranched runs of blocks in
parent-first order, each at most ``max_run_blocks`` long, ready to be read
into host slots and cached as one node each (storage_restore.py).

A block is restored only with its whole ancestry, so every run extends a
sequence the tree will hold when the run before it is cached; the budget
counts ancestors too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Optional

from radixrt.memory.kv_store import BlockMeta, KVStore


@dataclass
class RestoreRun:
    """Stored blocks ``keys`` holding ``tokens[start:]`` of the sequence
    ``tokens`` (from its namespace's start) in ``namespace``."""

    namespace: Optional[str]
    tokens: list[int]
    start: int
    keys: list[bytes]


def plan_restore(store: KVStore, max_blocks: int, max_run_blocks: int) -> list[RestoreRun]:
    """The most recently used stored sequences, at most ``max_blocks`` blocks in
    all, as runs of at most ``max_run_blocks`` blocks, parents before children
    (see the module docstring). Reads frame heads (the caller's thread)."""
    seeds = store.namespaces()
    metas: dict[bytes, BlockMeta] = {}
    missing: set[bytes] = set()
    for key in store.recent_keys():
        room = max_blocks - len(metas)
        if room <= 0:
            break
        if key in metas or key in missing:
            continue
        found = _ancestry(store, key, seeds, metas, missing, room)
        if found is None:
            continue
        if len(found) > room:  # the next sequence does not fit: the budget is spent
            break
        metas.update(found)
    return list(_runs(metas, seeds, max_run_blocks))


def _ancestry(
    store: KVStore,
    key: bytes,
    seeds: dict[bytes, Optional[str]],
    metas: dict[bytes, BlockMeta],
    missing: set[bytes],
    room: int,
) -> Optional[dict[bytes, BlockMeta]]:
    """Block ``key`` and its ancestors not in ``metas`` (up to a block there or a
    sequence's first block); None when one is missing or unverified (then all of
    them are added to ``missing``); ``room`` + 1 of them when they do not fit."""
    found: dict[bytes, BlockMeta] = {}
    at = key
    while len(found) <= room:
        meta = None if at in missing else store.read_meta(at)
        if meta is None:
            missing.update(found, [at])
            return None
        found[at] = meta
        if meta.parent in seeds or meta.parent in metas:
            return found
        at = meta.parent
    return found


def _runs(metas: dict[bytes, BlockMeta], seeds: dict[bytes, Optional[str]], max_run: int) -> Iterator[RestoreRun]:
    """The blocks of ``metas`` as runs, depth first from each sequence's first
    block (in the order ``metas`` found them: most recently used first)."""
    children: dict[bytes, list[bytes]] = defaultdict(list)
    for key, meta in metas.items():
        children[meta.parent].append(key)
    firsts = [key for key, meta in metas.items() if meta.parent in seeds]
    stack: list[tuple[bytes, Optional[str], list[int]]] = [
        (key, seeds[metas[key].parent], []) for key in reversed(firsts)
    ]
    while stack:
        key, namespace, before = stack.pop()
        keys: list[bytes] = []
        tokens = list(before)
        while True:
            keys.append(key)
            tokens.extend(metas[key].tokens)
            below = children.get(key, [])
            if len(below) != 1 or len(keys) == max_run:
                break
            key = below[0]
        yield RestoreRun(namespace, tokens, len(before), keys)
        stack.extend((child, namespace, tokens) for child in reversed(below))
