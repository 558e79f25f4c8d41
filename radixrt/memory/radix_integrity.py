"""`RadixCache.check_integrity`: every structural invariant of the tree,
asserted in O(tree size). The tests run it after every operation.

With a host tier it also checks where each node lives: the device part of the
tree is closed under parents, only device nodes are locked, host slots are
unique, in range, not free, and ``host free + host tree == host total``."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixrt.memory.radix_cache import RadixCache


def check_tree_integrity(self: RadixCache) -> None:
    """Assert every structural invariant (O(tree size); for tests)."""
    P = self.page_size
    root = self.root
    assert root.parent is None and not root.key and not root.value and root.lock_ref == 0
    assert root.lru_entry is None
    evictable = protected = 0
    n_leaves = n_host_leaves = 0
    seen: set[int] = set()
    n_slots = 0
    host_seen: set[int] = set()
    n_host = 0
    host = self.host
    for ns, sub in root.children.items():
        assert sub.parent is root and not sub.key and not sub.value, f"bad sub-root for {ns!r}"
        assert sub.lock_ref == 0 and sub.lru_entry is None
        if ns is not None:
            assert sub.children, f"empty sub-root for namespace {ns!r} kept"
        if self.disable:
            assert not sub.children
    for node in self._nodes():
        parent = node.parent
        assert parent is not None
        k = len(node.key)
        on_device = bool(node.value)
        assert k > 0 and (k == len(node.value) or not on_device), f"key/value length mismatch at {node!r}"
        if node.host_value is not None:
            assert host is not None, f"host slots without a host tier at {node!r}"
            assert len(node.host_value) == k, f"key/host_value length mismatch at {node!r}"
        assert on_device or node.host_value is not None, f"{node!r} is on neither tier"
        if on_device and parent.key:
            assert parent.value, f"{node!r} on the device under a parent that is not"
        if not on_device:
            assert node.lock_ref == 0, f"locked node off the device: {node!r}"
        assert k % P == 0, f"unaligned key at {node!r}"
        assert parent.children.get(self._child_key(node.key)) is node, f"bad child link at {node!r}"
        assert node.lock_ref >= 0
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), f"lock_ref at {node!r}"
        if parent.key:
            assert parent.lock_ref >= node.lock_ref
        for ck, child in node.children.items():
            assert child.parent is node and ck == self._child_key(child.key)
        if node.lock_ref:
            protected += k
        elif on_device:
            evictable += k
        should = on_device and node.lock_ref == 0 and not any(c.value for c in node.children.values())
        if should:
            n_leaves += 1
            assert node.lru_entry == (node.last_access, node.id, node), f"stale LRU entry at {node!r}"
            assert node.lru_entry in self._leaves
        else:
            assert node.lru_entry is None, f"{node!r} wrongly in the evictable-leaf set"
        if not on_device and not node.children:
            n_host_leaves += 1
            assert node.host_lru_entry == (node.last_access, node.id, node), f"stale host LRU entry at {node!r}"
            assert node.host_lru_entry in self._host_leaves
        else:
            assert node.host_lru_entry is None, f"{node!r} wrongly in the host-evictable-leaf set"
        if node.host_value is not None:
            assert host is not None
            HP = host.allocator.page_size
            for s in node.host_value[::HP]:
                assert 0 <= s < host.allocator.total_slots, f"host slot {s} out of range"
                assert not host.allocator.is_page_free(s // HP), f"tree host slot {s} is on the host free list"
            if HP > 1:
                for i in range(0, k, HP):
                    s = node.host_value[i]
                    assert s % HP == 0 and node.host_value[i:i + HP] == list(range(s, s + HP)), f"host page {node!r}"
            host_seen.update(node.host_value)
            n_host += k
        if parent.key:
            # a parent is touched whenever a child is, so it is never older
            assert parent.last_access >= node.last_access, f"parent older than child at {node!r}"
        if P > 1 and on_device:
            for i in range(0, k, P):
                s = node.value[i]
                assert s % P == 0 and node.value[i:i + P] == list(range(s, s + P)), f"bad page at {node!r}"
        seen.update(node.value)
        n_slots += len(node.value)
        if self.allocator is not None:
            for s in node.value[::P]:
                assert 0 <= s < self.allocator.total_slots, f"slot {s} out of range"
                assert not self.allocator.is_page_free(s // P), f"tree slot {s} is on the free list"
    assert n_slots == len(seen), "a slot appears twice in the tree"
    assert n_host == len(host_seen), "a host slot appears twice in the tree"
    assert n_host == self._host_tokens, f"host token counter {self._host_tokens} != {n_host}"
    if host is not None:
        assert host.allocator.num_free_slots + n_host == host.allocator.total_slots, (
            f"host slots leaked: free {host.allocator.num_free_slots} + tree {n_host} "
            f"!= total {host.allocator.total_slots}")
    assert len(self._leaves) == n_leaves, "evictable-leaf set holds extra entries"
    assert len(self._host_leaves) == n_host_leaves, "host-evictable-leaf set holds extra entries"
    assert evictable == self._evictable, f"evictable counter {self._evictable} != {evictable}"
    assert protected == self._protected, f"protected counter {self._protected} != {protected}"
