"""`HostRadixCache`: the radix tree over two tiers, the device and a host
pool below it (``--enable-hierarchical-cache``; SGLang's HiRadixCache).

An evicted node is not dropped: its KV moves to the host pool (a copy is
queued, see host_pool.py) and the node stays in the tree, ``value == []`` and
``host_value`` set. A later match that walks into it with ``load_back=True``
gets device slots for it and queues the copy back (a host hit). The tree knows
where each node lives (`TreeNode.on_device`, `TreeNode.on_host`); the device
part of the tree is closed under parents. LRU at both levels: the device
evicts its least recently used unlocked nodes with no child on the device (to
the host), the host drops its least recently used host-only leaves when it
needs room. Host slots are free, tree-owned, or reserved for a read from the
storage tier (`reserve_host`, until `insert_on_host` or `release_host`):
``host free + host tree + host reading == host total``.

Everything else (the walk, locks, device eviction, the device slot contract)
is `RadixCache`'s; this class fills in its hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Optional, Sequence

from sortedcontainers import SortedList

from radixrt.memory.kv_transfer import HostTier, KVTransfers
from radixrt.memory.radix_cache import RadixCache
from radixrt.memory.radix_integrity import check_tree_integrity
from radixrt.memory.radix_node import MatchResult, TreeNode, as_list, check_pages, concat_slots, lru_member

if TYPE_CHECKING:
    from radixrt.memory.kv_pool import PageAllocator


class HostRadixCache(RadixCache):
    """A `RadixCache` whose evicted nodes move to the host tier `host`.

    ``match_prefix(..., load_back=False)`` stops before the path's host-only
    nodes and reports their length as ``host_length``; with ``load_back`` they
    get device slots (evicting other nodes if needed) and their copies back
    are queued; as many whole nodes as the device can take are loaded, and
    ``loaded`` says how many tokens. `insert` returns the tokens already on
    the *device*: a host-only node the key runs through takes the caller's
    slots for its tokens (they become tree-owned, like a new node's). Under
    write-through a new node's copy to the host is queued at insert
    (``computed=False``: after the forward of the step being launched).
    """

    def __init__(self, allocator: "PageAllocator", page_size: int, host: HostTier) -> None:
        if host.allocator.page_size != page_size:
            raise ValueError(f"host allocator page_size {host.allocator.page_size} != cache page_size {page_size}")
        if allocator is None:
            raise ValueError("a host tier needs a device allocator")
        self.host = host
        # the storage tier's hook: told of each new node (namespace, node, computed), see storage_tier.py
        self.on_cached: Optional[Callable[[Hashable, TreeNode, bool], None]] = None
        super().__init__(allocator, page_size)

    def _init_tree(self) -> None:
        super()._init_tree()
        self._host_leaves: SortedList = SortedList()  # host-only leaves (what the host drops first)
        self._host_tokens = 0
        self.host_reading = 0  # host slots reserved for storage reads (`reserve_host`), not yet the tree's

    def reset_stats(self) -> None:
        super().reset_stats()
        self.host_evicted_tokens = 0  # dropped by the host tier

    def reset(self) -> None:
        self._check_unlocked()
        host_slots: list[int] = []
        for node in self._nodes():
            host_slots.extend(node.host_value or [])
            node.host_lru_entry = None
        super().reset()
        if host_slots:
            self.host.allocator.free_slots(host_slots)

    # --------------------------------------------------- bookkeeping hooks
    def _touch(self, node: TreeNode, t: int) -> None:
        super()._touch(node, t)
        entry = node.host_lru_entry
        if entry is not None:
            self._host_leaves.remove(entry)
            node.host_lru_entry = (t, node.id, node)
            self._host_leaves.add(node.host_lru_entry)

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Device-evictable: on the device, unlocked and no child on the device;
        host-evictable: on the host only and childless."""
        want = bool(node.value) and node.lock_ref == 0 and not any(c.value for c in node.children.values())
        node.lru_entry = lru_member(self._leaves, node.lru_entry, node, want)
        want_host = bool(node.key) and not node.value and node.host_value is not None and not node.children
        node.host_lru_entry = lru_member(self._host_leaves, node.host_lru_entry, node, want_host)

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        host_value = node.host_value
        upper = super()._split(node, m)
        if host_value is not None:
            upper.host_value = host_value[:m]
            node.host_value = host_value[m:]
        return upper

    # ---------------------------------------------------------- load back
    def _matched(self, sub: TreeNode, path: list[TreeNode], load_back: bool) -> MatchResult:
        """The device part of the path, then (``load_back``) what of its host-only
        rest the device can take."""
        k = 0
        while k < len(path) and path[k].value:
            k += 1
        on_host = path[k:]
        last_device = path[k - 1] if k else sub
        parts = [x.value for x in path[:k]]
        host_length = sum(len(h.key) for h in on_host)
        loaded = self._load_back(last_device, on_host) if load_back and on_host else []
        if loaded:
            parts.extend(h.value for h in loaded)
            last_device = loaded[-1]
        n_loaded = sum(len(h.key) for h in loaded)
        return MatchResult(concat_slots(parts), last_device, host_length - n_loaded, n_loaded)

    def _load_back(self, anchor: TreeNode, nodes: list[TreeNode]) -> list[TreeNode]:
        """Give host-only `nodes` (a path continuing below device node `anchor`)
        device slots and queue their copies back; returns the loaded prefix of
        `nodes` (whole nodes, as many as the device can take)."""
        alloc = self.allocator
        assert alloc is not None
        for h in nodes:  # keep the host from dropping them while the device makes room
            if h.host_lru_entry is not None:
                self._host_leaves.remove(h.host_lru_entry)
                h.host_lru_entry = None
        self.lock(anchor)
        need = sum(len(h.key) for h in nodes)
        if alloc.num_free_slots < need:
            self.evict(need - alloc.num_free_slots)
        self.unlock(anchor)
        free = alloc.num_free_slots
        loaded: list[TreeNode] = []
        for h in nodes:
            k = len(h.key)
            if k > free:
                break
            assert h.host_value is not None
            slots = alloc.alloc_slots_for(k)
            assert slots is not None and len(slots) == k
            free -= k
            self.host.transfers.load(h.host_value, slots)
            h.value = slots
            self._evictable += k
            loaded.append(h)
        for h in [anchor, *nodes]:
            self._refresh_leaf(h)
        return loaded

    # ------------------------------------------------------------- insert
    def _fill_path(self, sub: TreeNode, path: list[TreeNode], slots: list[int]) -> int:
        """Host-only nodes on the path adopt the caller's slots for their tokens."""
        pos = filled = 0
        parent = sub
        for node in path:
            k = len(node.key)
            if not node.value:  # always a whole node: only a device node is left unsplit
                value = slots[pos : pos + k]
                if self.page_size > 1:
                    check_pages(value, self.page_size)
                node.value = value
                self._evictable += k
                self._refresh_leaf(parent)
                self._refresh_leaf(node)
                filled += k
            pos += k
            parent = node
        return filled

    def _added(self, leaf: TreeNode, computed: bool) -> None:
        if self.host.write_through:
            self._back_up(leaf, after_forward=not computed)
        if self.on_cached is not None:
            self.on_cached(self._namespace_of(leaf), leaf, computed)

    # ------------------------------------------------------ storage loads
    def reserve_host(self, num_tokens: int) -> Optional[list[int]]:
        """Host slots for ``num_tokens`` (whole pages), dropping the host's least
        recently used leaves if needed; None when it cannot make room. The caller
        owns them until it hands them to `insert_on_host` (which frees what it
        does not use)."""
        alloc = self.host.allocator
        if alloc.num_free_slots < num_tokens:
            self._evict_host(num_tokens - alloc.num_free_slots)
        slots = alloc.alloc_slots_for(num_tokens)
        self.host_reading += len(slots or ())
        return slots

    def release_host(self, host_slots: list[int]) -> None:
        """Give back host slots from `reserve_host` that no node took."""
        self.host_reading -= len(host_slots)
        if host_slots:
            self.host.allocator.free_slots(host_slots)

    def insert_on_host(self, key: Sequence[int], host_slots: list[int], start: int, namespace: Hashable = None) -> int:
        """Cache ``key`` whose tokens ``key[start:]`` have their KV in the caller's
        host slots ``host_slots`` (blocks read from the storage tier; ``start`` and
        ``len(key)`` are whole pages). The part the tree does not hold yet becomes a
        host-only node; the host slots of the rest are freed. Nothing is added when
        the tree no longer holds ``key[:start]``. Returns the tokens added."""
        key = as_list(key)
        n = len(key)
        assert len(host_slots) == n - start and start % self.page_size == 0 and n % self.page_size == 0
        self.host_reading -= len(host_slots)
        sub = self._sub_root_created(namespace)
        t = self._tick()
        path, pos = self._walk(sub, key, n, t, split_end=False)
        used = max(0, n - max(pos, start)) if pos >= start else 0
        unused = host_slots[: len(host_slots) - used]
        if unused:
            self.host.allocator.free_slots(unused)
        if not used:
            if not sub.children:
                self._drop_empty_sub_root(sub)
            return 0
        parent = path[-1] if path else sub
        leaf = TreeNode(key[pos:n], [], parent, t)
        leaf.host_value = host_slots[pos - start :]
        parent.children[self._child_key(leaf.key)] = leaf
        self._host_tokens += used
        self._refresh_leaf(parent)
        self._refresh_leaf(leaf)
        self._announce(namespace, key[:pos], leaf)
        return used

    def _back_up(self, node: TreeNode, after_forward: bool = False) -> bool:
        """Give device node `node` a host copy (queued) unless it has one; False
        when the host has no room even after dropping its own LRU leaves."""
        host = self.host
        assert node.value
        if node.host_value is not None:
            return True
        k = len(node.key)
        if host.allocator.num_free_slots < k:
            self._evict_host(k - host.allocator.num_free_slots)
        slots = host.allocator.alloc_slots_for(k)
        if slots is None:
            return False
        host.transfers.offload(node.value, slots, after_forward=after_forward)
        node.host_value = slots
        self._host_tokens += k
        return True

    # ----------------------------------------------------------- eviction
    def _vacate(self, node: TreeNode) -> None:
        """To the host when it has room (the node stays, host-only), else dropped
        with its (host-only) subtree."""
        if self._back_up(node):
            node.value = []
            parent = node.parent
            assert parent is not None
            self._refresh_leaf(node)
            self._refresh_leaf(parent)
            return
        # Making room on the host may have dropped the node's host-only children,
        # which put it back in the device leaf set: it leaves the tree now.
        node.lru_entry = lru_member(self._leaves, node.lru_entry, node, False)
        super()._vacate(node)

    def _forget(self, node: TreeNode) -> None:
        """Free the host slots of `node` and of its subtree (all on the host only)."""
        host_slots: list[int] = []
        stack = [node]
        while stack:
            x = stack.pop()
            assert not x.value and x.lock_ref == 0
            if x.host_value is not None:
                host_slots.extend(x.host_value)
                self._host_tokens -= len(x.host_value)
                x.host_value = None
            if x.host_lru_entry is not None:
                self._host_leaves.remove(x.host_lru_entry)
                x.host_lru_entry = None
            stack.extend(x.children.values())
            if x is not node:
                x.parent = None
        if host_slots:
            self.host.allocator.free_slots(host_slots)
            self.host_evicted_tokens += len(host_slots)

    def _evict_host(self, num_tokens: int) -> int:
        """Drop least-recently-used host-only leaves until at least `num_tokens`
        host tokens were freed or none is left; returns host tokens freed."""
        freed = 0
        while freed < num_tokens and self._host_leaves:
            _, _, node = self._host_leaves[0]
            freed += len(node.key)
            self._drop(node)
        return freed

    def offload(self, node: TreeNode) -> int:
        """Move the unlocked device chain that ends at `node` (node, then each
        ancestor that is left with no child on the device) to the host tier,
        freeing its device slots now (swap-out of a retracted request). Stops
        at a locked node, one with other children on the device, or when the
        host has no room. Returns the device tokens freed."""
        freed = 0
        while node.key and node.parent is not None and node.lru_entry is not None:
            parent = node.parent
            if not self._back_up(node):
                break
            freed += self._evict_device(node)
            node = parent
        self.evicted_tokens += freed
        return freed

    def take_transfers(self) -> KVTransfers:
        return self.host.transfers.take()

    # --------------------------------------------------------------- sizes
    def host_size(self) -> int:
        """Host tokens the tree owns."""
        return self._host_tokens

    def lower_tiers(self) -> dict[str, dict[str, int]]:
        alloc = self.host.allocator
        return {
            "host": {
                "total_slots": alloc.total_slots,
                "free_slots": alloc.num_free_slots,
                "tree_slots": self._host_tokens,
                "reading_slots": self.host_reading,
            }
        }

    def stats(self) -> dict[str, Any]:
        host = self.host
        return {
            **super().stats(),
            "host_cached_tokens": self._host_tokens,
            "host_total_tokens": host.allocator.total_slots,
            "host_evicted_tokens": self.host_evicted_tokens,
            "host_loaded_tokens": host.transfers.loaded_tokens,
            "host_offloaded_tokens": host.transfers.offloaded_tokens,
            "hicache_write_policy": host.write_policy,
        }

    def check_integrity(self) -> None:
        check_tree_integrity(self, self)
