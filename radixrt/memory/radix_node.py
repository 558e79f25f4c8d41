"""The radix tree's nodes, match results and the small helpers the tree
classes share (see radix_cache.py for the tree)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from sortedcontainers import SortedList

_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree: ``key`` tokens whose KV lives at ``value`` slots.

    Where the KV lives (with a host tier, see host_pool.py): ``value`` holds the
    device slots, or is empty when the node is on the host only;
    ``host_value`` holds the host slots, or is None when the node has no host
    copy. A node is on the device, on the host, or both (`on_device`,
    `on_host`); the device part of the tree is closed under parents (a node on
    the device has every ancestor on the device).

    lock_ref: number of active locks on this node or any descendant.
    last_access: value of the cache's logical clock at the last match/insert
    that went through this node (a counter, not wall time).
    hits: admissions whose matched prefix ran through this node (each request
    counted once, at its first admission; the debug view shows them).
    """

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "last_access",
        "id",
        "lru_entry",
        "host_value",
        "host_lru_entry",
        "hits",
    )

    def __init__(self, key: list[int], value: list[int], parent: Optional["TreeNode"], last_access: int = 0):
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = last_access
        self.id = next(_ids)
        # (last_access, id, self) while this node sits in the evictable-leaf set.
        self.lru_entry: Optional[tuple] = None
        self.host_value: Optional[list[int]] = None
        # (last_access, id, self) while this node sits in the host-evictable-leaf set.
        self.host_lru_entry: Optional[tuple] = None
        self.hits = 0

    @property
    def on_device(self) -> bool:
        return bool(self.value) or not self.key

    @property
    def on_host(self) -> bool:
        return self.host_value is not None

    def __repr__(self) -> str:
        k = self.key if len(self.key) <= 8 else self.key[:8] + ["..."]
        where = ("device+host" if self.on_host else "device") if self.value else ("host" if self.on_host else "-")
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, key={k}, lock_ref={self.lock_ref}, "
            f"t={self.last_access}, on={where})"
        )


@dataclass
class MatchResult:
    """Result of `RadixCache.match_prefix`.

    slots: tree-owned device slot ids of the matched prefix (the caller must
        lock `node` before relying on them past the next cache operation).
    node: the node whose path ends exactly at the match (a root when nothing
        matched; locking a root is a no-op).
    host_length: tokens past ``slots`` that the host tier holds (not loaded:
        a match without ``load_back``).
    loaded: tokens at the end of ``slots`` that this match loaded back from the
        host tier (a host hit; their copies are queued, see host_pool.py).
    """

    slots: list[int]
    node: TreeNode
    host_length: int = 0
    loaded: int = 0

    @property
    def length(self) -> int:
        return len(self.slots)


def _first_mismatch(a: list[int], b: list[int], b_off: int, n: int) -> int:
    """Length of the common prefix of ``a[:n]`` and ``b[b_off:b_off+n]``.

    Slice compares run in C: one compare in the common full-match case,
    otherwise galloping then bisection, O(n) element compares overall and
    O(log n) Python-level steps.
    """
    if a[:n] == b[b_off : b_off + n]:
        return n
    lo, step = 0, 16
    while True:
        hi = min(n, lo + step)
        if a[lo:hi] != b[b_off + lo : b_off + hi]:
            break
        lo, step = hi, step * 2
    while hi - lo > 8:  # mismatch lies in [lo, hi)
        mid = (lo + hi) // 2
        if a[lo:mid] == b[b_off + lo : b_off + mid]:
            lo = mid
        else:
            hi = mid
    for i in range(lo, hi):
        if a[i] != b[b_off + i]:
            return i
    return hi  # unreachable


def as_list(seq: Sequence[int]) -> list[int]:
    """A list of ints from a list, a tensor/array (``tolist``) or any sequence."""
    if isinstance(seq, list):
        return seq
    tolist = getattr(seq, "tolist", None)
    return tolist() if tolist is not None else list(seq)


def concat_slots(parts: list[list[int]]) -> list[int]:
    return parts[0][:] if len(parts) == 1 else [s for part in parts for s in part]


def lru_member(leaves: SortedList, entry: Optional[tuple], node: TreeNode, want: bool) -> Optional[tuple]:
    """Put ``node`` in or take it out of the sorted LRU set ``leaves``; its new entry (None: out)."""
    if want and entry is None:
        entry = (node.last_access, node.id, node)
        leaves.add(entry)
    elif not want and entry is not None:
        leaves.remove(entry)
        entry = None
    return entry


def check_pages(value: list[int], P: int) -> None:
    """Raise ValueError unless `value` is whole pages of size `P`, each in order."""
    starts = value[::P]
    ends = value[P - 1 :: P]
    if any(s % P for s in starts) or any(e - s != P - 1 for s, e in zip(starts, ends)):
        raise ValueError("insert: slots must be whole pages (page-aligned, in order)")
