"""`RadixCache.check_integrity`: every structural invariant of the tree,
asserted in O(tree size). The tests run it after every operation.

With a host tier (`HostRadixCache`) it also checks where each node lives: the
device part of the tree is closed under parents, only device nodes are
locked, host slots are unique, in range, not free, and
``host free + host tree + host reading == host total`` (reading: reserved
for a read from the storage tier).

The trees are only read here, through their private fields: what is read is
declared by the two protocols below (`CheckedTree`, `CheckedHostTree`), so
this module imports neither tree class (the trees import it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol, Sized

from radixrt.memory.kv_transfer import HostTier, PageAllocatorLike
from radixrt.memory.radix_node import TreeNode


class _Members(Sized, Protocol):
    """An LRU set of the tree (a ``SortedList`` of entries)."""

    def __contains__(self, entry: object) -> bool: ...


class CheckedTree(Protocol):
    """What the check reads of a device tree (`RadixCache`)."""

    @property
    def root(self) -> TreeNode: ...
    @property
    def page_size(self) -> int: ...
    @property
    def allocator(self) -> Optional[PageAllocatorLike]: ...
    @property
    def _leaves(self) -> _Members: ...
    @property
    def _evictable(self) -> int: ...
    @property
    def _protected(self) -> int: ...
    def _nodes(self) -> Iterator[TreeNode]: ...
    def _child_key(self, key: list[int], pos: int = 0) -> Any: ...


class CheckedHostTree(Protocol):
    """What the check reads of the host tier of a tree (`HostRadixCache`)."""

    @property
    def host(self) -> HostTier: ...
    @property
    def _host_leaves(self) -> _Members: ...
    @property
    def _host_tokens(self) -> int: ...


@dataclass
class _Census:
    """What the walk counted, compared with the tree's own counters at the end."""

    evictable: int = 0
    protected: int = 0
    leaves: int = 0
    host_leaves: int = 0
    slots: int = 0
    host_slots: int = 0
    seen: set[int] = field(default_factory=set)
    host_seen: set[int] = field(default_factory=set)


def check_tree_integrity(tree: CheckedTree, host_tree: Optional[CheckedHostTree] = None) -> None:
    """Assert every structural invariant of `tree` (O(tree size); for tests).
    ``host_tree``: the same tree when it has a host tier (`HostRadixCache`
    passes itself): nodes may then live on the host only, and the host tier's
    invariants are checked too."""
    _check_roots(tree)
    c = _Census()
    for node in tree._nodes():
        _check_node(tree, node, c)
        if host_tree is not None:
            _check_host_node(host_tree, node, c)
        else:
            assert node.host_value is None, f"host slots without a host tier at {node!r}"
    assert c.slots == len(c.seen), "a slot appears twice in the tree"
    assert len(tree._leaves) == c.leaves, "evictable-leaf set holds extra entries"
    assert c.evictable == tree._evictable, f"evictable counter {tree._evictable} != {c.evictable}"
    assert c.protected == tree._protected, f"protected counter {tree._protected} != {c.protected}"
    if host_tree is not None:
        alloc = host_tree.host.allocator
        assert c.host_slots == len(c.host_seen), "a host slot appears twice in the tree"
        assert c.host_slots == host_tree._host_tokens, f"host token counter {host_tree._host_tokens} != {c.host_slots}"
        reading = getattr(host_tree, "host_reading", 0)
        assert alloc.num_free_slots + c.host_slots + reading == alloc.total_slots, (
            f"host slots leaked: free {alloc.num_free_slots} + tree {c.host_slots} + reading {reading} "
            f"!= total {alloc.total_slots}"
        )
        assert len(host_tree._host_leaves) == c.host_leaves, "host-evictable-leaf set holds extra entries"


def _check_roots(tree: CheckedTree) -> None:
    root = tree.root
    assert root.parent is None and not root.key and not root.value and root.lock_ref == 0
    assert root.lru_entry is None
    for ns, sub in root.children.items():
        assert sub.parent is root and not sub.key and not sub.value, f"bad sub-root for {ns!r}"
        assert sub.lock_ref == 0 and sub.lru_entry is None
        if ns is not None:
            assert sub.children, f"empty sub-root for namespace {ns!r} kept"


def _check_node(tree: CheckedTree, node: TreeNode, c: _Census) -> None:
    """Links, locks, LRU membership and device slots of one non-root node."""
    P = tree.page_size
    parent = node.parent
    assert parent is not None
    k = len(node.key)
    on_device = bool(node.value)
    assert k > 0 and (k == len(node.value) or not on_device), f"key/value length mismatch at {node!r}"
    assert on_device or node.host_value is not None, f"{node!r} is on neither tier"
    if on_device and parent.key:
        assert parent.value, f"{node!r} on the device under a parent that is not"
    if not on_device:
        assert node.lock_ref == 0, f"locked node off the device: {node!r}"
    assert k % P == 0, f"unaligned key at {node!r}"
    assert parent.children.get(tree._child_key(node.key)) is node, f"bad child link at {node!r}"
    assert node.lock_ref >= 0
    assert node.lock_ref >= sum(ch.lock_ref for ch in node.children.values()), f"lock_ref at {node!r}"
    if parent.key:
        assert parent.lock_ref >= node.lock_ref
        # a parent is touched whenever a child is, so it is never older
        assert parent.last_access >= node.last_access, f"parent older than child at {node!r}"
    for ck, child in node.children.items():
        assert child.parent is node and ck == tree._child_key(child.key)
    if node.lock_ref:
        c.protected += k
    elif on_device:
        c.evictable += k
    if on_device and node.lock_ref == 0 and not any(ch.value for ch in node.children.values()):
        c.leaves += 1
        assert node.lru_entry == (node.last_access, node.id, node), f"stale LRU entry at {node!r}"
        assert node.lru_entry in tree._leaves
    else:
        assert node.lru_entry is None, f"{node!r} wrongly in the evictable-leaf set"
    if P > 1 and on_device:
        for i in range(0, k, P):
            s = node.value[i]
            assert s % P == 0 and node.value[i : i + P] == list(range(s, s + P)), f"bad page at {node!r}"
    c.seen.update(node.value)
    c.slots += len(node.value)
    alloc = tree.allocator
    if alloc is not None and on_device:  # run after every step in debug mode: passes in C, no call per slot
        firsts = node.value[::P]
        assert 0 <= min(firsts) and max(firsts) < alloc.total_slots, f"a tree slot out of range at {node!r}"
        bad = alloc.first_free(firsts if P == 1 else [s // P for s in firsts])
        assert bad is None, f"tree page {bad} of {node!r} is on the free list"


def _check_host_node(tree: CheckedHostTree, node: TreeNode, c: _Census) -> None:
    """Host slots and host-LRU membership of one non-root node."""
    k = len(node.key)
    if not node.value and not node.children:
        c.host_leaves += 1
        assert node.host_lru_entry == (node.last_access, node.id, node), f"stale host LRU entry at {node!r}"
        assert node.host_lru_entry in tree._host_leaves
    else:
        assert node.host_lru_entry is None, f"{node!r} wrongly in the host-evictable-leaf set"
    if node.host_value is None:
        return
    assert len(node.host_value) == k, f"key/host_value length mismatch at {node!r}"
    alloc = tree.host.allocator
    HP = alloc.page_size
    firsts = node.host_value[::HP]
    assert 0 <= min(firsts) and max(firsts) < alloc.total_slots, f"a tree host slot out of range at {node!r}"
    bad = alloc.first_free(firsts if HP == 1 else [s // HP for s in firsts])
    assert bad is None, f"host page {bad} of {node!r} is on the host free list"
    if HP > 1:
        for i in range(0, k, HP):
            s = node.host_value[i]
            assert s % HP == 0 and node.host_value[i : i + HP] == list(range(s, s + HP)), f"host page {node!r}"
    c.host_seen.update(node.host_value)
    c.host_slots += k
