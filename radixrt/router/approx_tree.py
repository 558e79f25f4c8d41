"""The router's approximate radix tree: which worker has most likely cached
which prefix.

One tree is shared by all workers ("tenants"). Every node records, per
tenant, when a request routed to that tenant last went through it. The
tree only sees what the router sent, never what a worker really holds, so it
is an estimate: a worker may have evicted a prefix the tree still lists.
Sizes are bounded by `evict_tenant` (the router calls it on an interval),
which drops a tenant's least recently used leaves until the tenant's total
key length is under a limit.

Keys are sequences of hashable elements: a ``str`` (prompt text, one element
per character) or a ``tuple`` of token ids. Keep the two kinds in separate
trees: a tree compares elements, and a character never equals a token id
anyway, but a tree of one kind keeps edge labels of one type.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

Key = Sequence[Hashable]  # str or tuple[int, ...]


@dataclass(eq=False)
class _Node:
    label: Any  # the edge into this node (same type as the keys)
    parent: Optional["_Node"]
    children: dict[Hashable, "_Node"] = field(default_factory=dict)
    tenants: dict[str, float] = field(default_factory=dict)  # tenant -> last access (monotonic clock)


def _common_len(a: Key, b: Key) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ApproxTree:
    """A multi-tenant radix tree over str or token-id keys.

    Contract: after ``insert(key, t)``, ``match(key)[t] == len(key)`` until
    ``t`` is evicted from that path or removed. ``size(t)`` is the total
    length of the edges ``t`` holds (what ``evict_tenant`` bounds)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self.root = _Node(label=(), parent=None)
        self._sizes: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    def size(self, tenant: str) -> int:
        return self._sizes.get(tenant, 0)

    def sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    def match(self, key: Key) -> dict[str, int]:
        """For each tenant, how many leading elements of ``key`` it holds
        (tenants with no match are absent). Marks the matched path as used."""
        out: dict[str, int] = {}
        now = self._clock()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.label, key[pos : pos + len(child.label)])
            for t in child.tenants:
                out[t] = pos + n  # deeper nodes overwrite: the longest match wins
                child.tenants[t] = now
            pos += n
            if n < len(child.label):
                break
            node = child
        return out

    # ------------------------------------------------------------------ updates
    def insert(self, key: Key, tenant: str) -> None:
        """Record that ``key`` was sent to ``tenant``."""
        now = self._clock()
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(label=key[pos:], parent=node, tenants={tenant: now})
                node.children[key[pos]] = leaf
                self._sizes[tenant] = self._sizes.get(tenant, 0) + len(leaf.label)
                return
            n = _common_len(child.label, key[pos : pos + len(child.label)])
            if n < len(child.label):
                child = self._split(child, n)
            if tenant not in child.tenants:
                self._sizes[tenant] = self._sizes.get(tenant, 0) + len(child.label)
            child.tenants[tenant] = now
            pos += n
            node = child

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child``'s edge after ``n`` elements; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(label=child.label[:n], parent=parent, tenants=dict(child.tenants))
        parent.children[child.label[0]] = upper
        child.label = child.label[n:]
        child.parent = upper
        upper.children[child.label[0]] = child
        return upper

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything ``tenant`` holds (a worker left)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.tenants.pop(tenant, None) is not None:
                stack.extend(node.children.values())
        self._prune(self.root)
        self._sizes.pop(tenant, None)

    def clear(self) -> None:
        self.root = _Node(label=(), parent=None)
        self._sizes.clear()

    def _prune(self, node: _Node) -> None:
        """Drop the nodes no tenant holds (a node's tenants are a superset of its children's)."""
        for k, child in list(node.children.items()):
            if not child.tenants:
                del node.children[k]
            else:
                self._prune(child)

    def evict_tenant(self, tenant: str, max_size: int) -> int:
        """Drop ``tenant``'s least recently used leaves (nodes it holds where
        none of its children does) until its size is at most ``max_size``.
        Returns the number of elements dropped."""
        if self.size(tenant) <= max_size:
            return 0
        tie = itertools.count()
        heap: list[tuple[float, int, _Node]] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if tenant not in node.tenants:
                continue
            held = [c for c in node.children.values() if tenant in c.tenants]
            if held:
                stack.extend(held)
            else:
                heap.append((node.tenants[tenant], next(tie), node))
        heapq.heapify(heap)
        dropped = 0
        while heap and self._sizes.get(tenant, 0) > max_size:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self._sizes[tenant] -= len(node.label)
            dropped += len(node.label)
            parent = node.parent
            if not node.tenants and parent is not None:
                del parent.children[node.label[0]]
            if (
                parent is not None
                and parent is not self.root
                and tenant in parent.tenants
                and not any(tenant in c.tenants for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.tenants[tenant], next(tie), parent))
        return dropped

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Assert the invariants (tests): children keyed by their first element,
        parents hold every tenant their children hold, sizes add up."""
        sizes: dict[str, int] = {}
        stack = [self.root]
        while stack:
            node = stack.pop()
            for k, c in node.children.items():
                assert len(c.label) > 0 and c.label[0] == k and c.parent is node
                assert c.tenants, "a node no tenant holds was left in the tree"
                if node is not self.root:
                    assert set(c.tenants) <= set(node.tenants)
                for t in c.tenants:
                    sizes[t] = sizes.get(t, 0) + len(c.label)
                stack.append(c)
        assert {t: s for t, s in sizes.items() if s} == {t: s for t, s in self._sizes.items() if s}, (
            sizes,
            self._sizes,
        )
