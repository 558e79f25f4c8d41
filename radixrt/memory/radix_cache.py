"""Radix tree over token ids mapping cached prefixes to KV slot ids (RadixAttention).

Ownership contract
==================
Every KV slot is at all times exactly one of free (on the allocator's free
list), owned by this tree, or private to a running request. The tree's slots
are exactly `all_slots()`; the tree gives slots back to the allocator only in
`evict` and `reset` (via ``allocator.free_slots``).

Typical request life cycle::

    m = cache.match_prefix(tokens, ns)   # m.slots stay TREE-owned
    cache.lock(m.node)                   # pin them while the request uses them
    ... allocate private slots for tokens[m.length:], compute KV ...
    p = cache.insert(tokens, slots, ns)  # slots = m.slots + private slots
    # now: slots[p:n] are TREE-owned (n = len(tokens) rounded down to a page);
    #      slots[m.length:p] are the request's duplicates -> it frees them;
    #      slots[n:] (a partial last page) are still private -> it frees them.
    cache.unlock(m.node)

``p >= m.length`` always holds while ``m.node`` is locked, and the tree's
slots for ``tokens[:m.length]`` are still ``m.slots`` (locked nodes can be
split but their slot ids never change).

Structure
=========
The top `root` has one sub-root per namespace (cache salt / adapter id);
``None`` is the default namespace. Roots and sub-roots have empty keys, are
never locked and never evicted. A child is keyed in its parent's
``children`` by its first token (page_size 1) or by the tuple of its first
page's tokens (page_size > 1). Every non-root key is a non-empty multiple of
page_size.

Host tier (optional, ``host=HostTier(...)``)
============================================
With a host tier an evicted node is not dropped: its KV moves to the host
pool (a copy is queued, see host_pool.py) and the node stays in the tree,
``value == []`` and ``host_value`` set. A later match that walks into it
with ``load_back=True`` gets device slots for it and queues the copy back
(a host hit). The tree knows where each node lives (`TreeNode.on_device`,
`TreeNode.on_host`); the device part of the tree is closed under parents.
LRU at both levels: the device evicts its least recently used unlocked
nodes with no child on the device (to the host), the host drops its least
recently used host-only leaves when it needs room. Host slots are either
free or tree-owned: ``host free + host tree == host total``. Without a host
tier everything behaves as before: an evicted node is gone.

Splitting a node keeps the original object as the *lower* (deeper) half and
inserts a new node above it, so a `TreeNode` handed out by `match_prefix`
always ends at the same token position, even after later splits; locks taken
on it stay valid.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Iterator, Optional, Sequence

from sortedcontainers import SortedList

from radixrt.memory.kv_transfer import HostTier
from radixrt.memory.radix_integrity import check_tree_integrity
from radixrt.memory.radix_node import MatchResult, TreeNode, _first_mismatch

if TYPE_CHECKING:  # keep this module free of torch at import time
    from radixrt.memory.kv_pool import PageAllocator



class RadixCache:
    """Prefix cache of KV slots keyed by token ids.

    allocator: where evicted slots go (``allocator.free_slots``). With None,
        evicted/reset slots are simply dropped (handy for tests of the tree alone).
    page_size: keys and values are matched/stored in whole pages only.
    disable: the ``--disable-radix-cache`` ablation: `match_prefix` matches
        nothing, `insert` stores nothing and returns 0 (so the caller still owns
        and must free ALL its slots), `evict` frees nothing.
    host: the host tier evicted nodes move to (None: they are dropped).
    """

    def __init__(self, allocator: Optional["PageAllocator"], page_size: int = 1, disable: bool = False,
                 host: Optional[HostTier] = None) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(f"allocator page_size {allocator.page_size} != cache page_size {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        if host is not None and host.allocator.page_size != page_size:
            raise ValueError(f"host allocator page_size {host.allocator.page_size} != cache page_size {page_size}")
        if host is not None and allocator is None:
            raise ValueError("a host tier needs a device allocator")
        self.host = None if disable else host
        self._clock = 0
        self.reset_stats()
        self._init_tree()

    # ------------------------------------------------------------------ setup
    def _init_tree(self) -> None:
        self.root = TreeNode([], [], None)
        # Sub-roots are children of `root`, keyed by namespace; _sub_ns maps back.
        self._sub_ns: dict[int, Hashable] = {}
        self._leaves: SortedList = SortedList()  # device-evictable nodes
        self._host_leaves: SortedList = SortedList()  # host-only leaves (what the host drops first)
        self._evictable = 0
        self._protected = 0
        self._host_tokens = 0

    def reset_stats(self) -> None:
        self.queried_tokens = 0
        self.hit_tokens = 0  # device and host hits
        self.host_hit_tokens = 0  # of which loaded back from the host tier
        self.inserted_tokens = 0
        self.evicted_tokens = 0  # left the device (to the host tier or gone)
        self.host_evicted_tokens = 0  # dropped by the host tier

    def reset(self) -> None:
        """Drop the whole tree, giving every tree-owned slot back to the
        allocator. Requires that nothing is locked. Stats are kept (see
        `reset_stats`)."""
        if self._protected:
            raise RuntimeError(f"reset() with {self._protected} locked tokens in the tree")
        slots: list[int] = []
        host_slots: list[int] = []
        for node in list(self._nodes()):
            slots.extend(node.value)
            host_slots.extend(node.host_value or [])
            node.parent = None  # stale references now read as evicted
            node.lru_entry = node.host_lru_entry = None
        if self.allocator is not None and slots:
            self.allocator.free_slots(slots)
        if self.host is not None and host_slots:
            self.host.allocator.free_slots(host_slots)
        self._init_tree()

    # ---------------------------------------------------------------- helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: list[int], pos: int = 0) -> Any:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos:pos + self.page_size])

    def _sub_root(self, namespace: Hashable) -> Optional[TreeNode]:
        return self.root.children.get(namespace)

    def _sub_root_created(self, namespace: Hashable) -> TreeNode:
        """The namespace's sub-root, created if missing."""
        sub = self.root.children.get(namespace)
        if sub is None:
            sub = TreeNode([], [], self.root)
            self.root.children[namespace] = sub
            self._sub_ns[sub.id] = namespace
        return sub

    def _touch(self, node: TreeNode, t: int) -> None:
        entry = node.lru_entry
        if entry is not None:
            self._leaves.remove(entry)
            node.lru_entry = (t, node.id, node)
            self._leaves.add(node.lru_entry)
        entry = node.host_lru_entry
        if entry is not None:
            self._host_leaves.remove(entry)
            node.host_lru_entry = (t, node.id, node)
            self._host_leaves.add(node.host_lru_entry)
        node.last_access = t

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Put `node` in / take it out of the evictable-leaf sets as its state requires:
        device-evictable when on the device, unlocked and no child is on the
        device; host-evictable when on the host only and childless."""
        # without a host tier every child is on the device: skip the scan of a wide node's children
        want = (bool(node.value) and node.lock_ref == 0
                and (not node.children if self.host is None else not any(c.value for c in node.children.values())))
        node.lru_entry = _member(self._leaves, node.lru_entry, node, want)
        want_host = bool(node.key) and not node.value and node.host_value is not None and not node.children
        node.host_lru_entry = _member(self._host_leaves, node.host_lru_entry, node, want_host)

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Split `node` after its first ``m`` tokens (0 < m < len, page-aligned).

        A new node takes the first m tokens and sits between node.parent and
        node; `node` keeps the rest (and its identity, locks, leaf-set entry).
        Returns the new upper node.
        """
        parent = node.parent
        assert parent is not None, "only a node in the tree is split"
        upper = TreeNode(node.key[:m], node.value[:m], parent, node.last_access)
        upper.lock_ref = node.lock_ref
        if node.host_value is not None:
            upper.host_value = node.host_value[:m]
            node.host_value = node.host_value[m:]
        node.key = node.key[m:]
        node.value = node.value[m:]
        node.parent = upper
        upper.children[self._child_key(node.key)] = node
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: Sequence[int], namespace: Hashable = None, record_stats: bool = True,
                     load_back: bool = False) -> MatchResult:
        """Longest cached prefix of `key` (whole pages only when page_size > 1).

        Splits a node on a partial match so that the returned node ends exactly
        at the match. Does not lock: the returned slots remain tree-owned and
        may be evicted by a later `evict` unless the caller locks `node`.
        Refreshes the access time of every node on the matched path.
        ``record_stats=False`` leaves the queried/hit counters alone (for
        look-ups that are not a request being served, e.g. policy scoring).

        With a host tier, the matched path may go on into nodes that are on the
        host only. Without ``load_back`` the match stops before them and
        reports their length as ``host_length``. With ``load_back`` they get
        device slots (evicting other nodes if needed) and their copies back
        are queued; as many whole nodes as the device can take are loaded,
        and ``loaded`` says how many tokens.
        """
        if not isinstance(key, list):
            key = key.tolist() if hasattr(key, "tolist") else list(key)
        if record_stats:
            self.queried_tokens += len(key)
        if self.disable:
            return MatchResult([], self.root)
        node = self._sub_root(namespace)
        if node is None:
            return MatchResult([], self.root)
        n = self._aligned(len(key))
        t = self._tick()
        pos = 0
        parts: list[list[int]] = []
        on_host: list[TreeNode] = []  # host-only nodes past the device part of the path
        last_device = node
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            clen = len(child.key)
            m = _first_mismatch(child.key, key, pos, min(clen, n - pos))
            if self.page_size > 1:
                m = self._aligned(m)  # >= page_size: the first page matched via the dict key
            self._touch(child, t)
            if m < clen:
                child = self._split(child, m)
            if child.value:
                parts.append(child.value)
                last_device = child
            else:
                on_host.append(child)
            pos += m
            node = child
            if m < clen:
                break
        host_length = sum(len(h.key) for h in on_host)
        loaded = self._load_back(last_device, on_host) if load_back and on_host else []
        if loaded:
            parts.extend(h.value for h in loaded)
            last_device = loaded[-1]
        slots = parts[0][:] if len(parts) == 1 else [s for part in parts for s in part]
        n_loaded = sum(len(h.key) for h in loaded)
        if record_stats:
            self.hit_tokens += len(slots)
            self.host_hit_tokens += n_loaded
        return MatchResult(slots, last_device, host_length - n_loaded, n_loaded)

    def _load_back(self, anchor: TreeNode, nodes: list[TreeNode]) -> list[TreeNode]:
        """Give host-only `nodes` (a path continuing below device node `anchor`)
        device slots and queue their copies back; returns the loaded prefix of
        `nodes` (whole nodes, as many as the device can take)."""
        host, alloc = self.host, self.allocator
        assert host is not None
        for h in nodes:  # keep the host from dropping them while the device makes room
            if h.host_lru_entry is not None:
                self._host_leaves.remove(h.host_lru_entry)
                h.host_lru_entry = None
        self.lock(anchor)
        need = sum(len(h.key) for h in nodes)
        if alloc is not None and alloc.num_free_slots < need:
            self.evict(need - alloc.num_free_slots)
        self.unlock(anchor)
        free = alloc.num_free_slots if alloc is not None else need
        loaded: list[TreeNode] = []
        for h in nodes:
            k = len(h.key)
            if k > free:
                break
            assert h.host_value is not None
            slots = alloc.alloc_slots_for(k) if alloc is not None else list(h.host_value)
            assert slots is not None and len(slots) == k
            free -= k
            host.transfers.load(h.host_value, slots)
            h.value = slots
            self._evictable += k
            loaded.append(h)
        for h in [anchor, *nodes]:
            self._refresh_leaf(h)
        return loaded

    # ----------------------------------------------------------------- insert
    def insert(self, key: Sequence[int], slots: Sequence[int], namespace: Hashable = None,
               computed: bool = True) -> int:
        """Cache ``key[:n]`` -> ``slots[:n]`` where n = len(key) rounded down to a page.

        Requires ``len(slots) == len(key)``; with page_size > 1 ``slots[:n]``
        must be made of whole pages, in order. Returns ``p``, the number of
        leading tokens that were already in the tree (a multiple of
        page_size, ``p <= n``). Ownership afterwards:

        - ``slots[p:n]`` belong to the tree;
        - ``slots[:p]`` stay with the caller: those it got from the tree (via
          a locked match) are the tree's own slots and must not be freed; the
          rest are duplicates the caller must free;
        - ``slots[n:]`` stay with the caller.

        With ``disable=True`` nothing is stored and 0 is returned: the caller
        keeps (and must free) every slot.

        With a host tier, ``p`` counts the tokens already on the *device*: a
        node on the host only that the key runs through takes the caller's
        slots for its tokens (they become tree-owned, like a new node's).
        Under write-through a new node's copy to the host is queued;
        ``computed=False`` says its KV is computed by the step about to be
        launched, so the copy runs after that step's forward.
        """
        if not isinstance(key, list):
            key = key.tolist() if hasattr(key, "tolist") else list(key)
        slot_list: list[int]
        if isinstance(slots, list):
            slot_list = slots
        elif hasattr(slots, "tolist"):
            slot_list = slots.tolist()
        else:
            slot_list = list(slots)
        if len(slot_list) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(slot_list)} slots")
        if self.disable:
            return 0
        n = self._aligned(len(key))
        if n == 0:
            return 0
        node = self._sub_root_created(namespace)
        t = self._tick()
        pos = 0
        on_device = pos  # tokens of the path already on the device
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            clen = len(child.key)
            m = _first_mismatch(child.key, key, pos, min(clen, n - pos))
            if self.page_size > 1:
                m = self._aligned(m)
            self._touch(child, t)
            if m < clen:
                if pos + m == n and child.value:  # key ends inside this node: nothing to add, no split needed
                    return n
                child = self._split(child, m)
            if not child.value:  # on the host only: adopt the caller's slots
                value = slot_list[pos:pos + m]
                if self.page_size > 1:
                    self._check_pages(value)
                child.value = value
                self._evictable += m
                self._refresh_leaf(node)
                self._refresh_leaf(child)
            else:
                on_device = pos + m
            pos += m
            node = child
        if pos < n:
            value = slot_list[pos:n]
            if self.page_size > 1:
                self._check_pages(value)
            leaf = TreeNode(key[pos:n], value, node, t)
            node.children[self._child_key(leaf.key)] = leaf
            self._refresh_leaf(node)
            self._refresh_leaf(leaf)
            self._evictable += n - pos
            self.inserted_tokens += n - pos
            if self.host is not None and self.host.write_through:
                self._back_up(leaf, after_forward=not computed)
        return on_device

    def _back_up(self, node: TreeNode, after_forward: bool = False) -> bool:
        """Give device node `node` a host copy (queued) unless it has one; False
        when the host has no room even after dropping its own LRU leaves."""
        host = self.host
        assert host is not None and node.value
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

    def _check_pages(self, value: list[int]) -> None:
        P = self.page_size
        starts = value[::P]
        ends = value[P - 1::P]
        if any(s % P for s in starts) or any(e - s != P - 1 for s, e in zip(starts, ends)):
            raise ValueError("insert: slots must be whole pages (page-aligned, in order)")

    # ------------------------------------------------------------ lock/unlock
    def lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors: their slots are never evicted until
        the matching `unlock`. Locking a root is a no-op; locking a node that
        was evicted (or is on the host only) raises RuntimeError."""
        if node.key and (node.parent is None or not node.value):
            raise RuntimeError(f"lock of an evicted node {node!r}")
        while node.key:
            if node.lock_ref == 0:
                n = len(node.key)
                self._evictable -= n
                self._protected += n
                if node.lru_entry is not None:
                    self._leaves.remove(node.lru_entry)
                    node.lru_entry = None
            node.lock_ref += 1
            parent = node.parent
            assert parent is not None, "a locked node's ancestors are in the tree"
            node = parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises RuntimeError if `node` is not locked."""
        if node.key and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        while node.key:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.key)
                self._evictable += n
                self._protected -= n
                self._refresh_leaf(node)
            parent = node.parent
            assert parent is not None, "a locked node's ancestors are in the tree"
            node = parent

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked device leaves (nodes with no child
        on the device) until at least `num_tokens` device tokens were freed or
        nothing is evictable; returns tokens freed (whole nodes, so possibly
        more than asked). Freed slots go back through ``allocator.free_slots``.
        Without a host tier an evicted node is dropped; with one it moves to
        the host (dropped only when the host cannot make room). A parent left
        without children on the device becomes a candidate in the same call.
        O(k log n) for k evicted leaves."""
        if self.disable or num_tokens <= 0:
            return 0
        freed = 0
        leaves = self._leaves
        while freed < num_tokens and leaves:
            _, _, node = leaves[0]
            freed += self._evict_device(node)
        self.evicted_tokens += freed
        return freed

    def _evict_device(self, node: TreeNode) -> int:
        """Take device-evictable `node` off the device: to the host when there is
        a host tier with room, else out of the tree with its (host-only)
        subtree. Returns the device tokens freed."""
        assert node.lru_entry is not None
        self._leaves.remove(node.lru_entry)
        node.lru_entry = None
        n = len(node.key)
        if self.allocator is not None:
            self.allocator.free_slots(node.value)
        self._evictable -= n
        if self.host is not None and self._back_up(node):
            node.value = []
            parent = node.parent
            assert parent is not None
            self._refresh_leaf(node)
            self._refresh_leaf(parent)
            return n
        node.value = []
        self._drop(node)
        return n

    def _drop(self, node: TreeNode) -> None:
        """Remove `node` (now off the device) and its subtree (all on the host
        only) from the tree, freeing their host slots."""
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
            assert self.host is not None
            self.host.allocator.free_slots(host_slots)
            self.host_evicted_tokens += len(host_slots)
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]
        node.parent = None
        if parent.key:
            self._refresh_leaf(parent)
        elif not parent.children:
            self._drop_empty_sub_root(parent)

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
        host has no room. Returns the device tokens freed (0 without a host
        tier)."""
        if self.host is None:
            return 0
        freed = 0
        while node.key and node.parent is not None and node.lru_entry is not None:
            parent = node.parent
            if not self._back_up(node):
                break
            freed += self._evict_device(node)
            node = parent
        self.evicted_tokens += freed
        return freed

    def _drop_empty_sub_root(self, sub: TreeNode) -> None:
        # Non-default namespaces vanish when empty, so per-request salts do not
        # accumulate sub-roots. The default namespace's sub-root stays.
        ns = self._sub_ns[sub.id]
        if ns is not None:
            del self.root.children[ns]
            del self._sub_ns[sub.id]

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (all of them can be evicted)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    def total_size(self) -> int:
        """Device tokens the tree owns."""
        return self._evictable + self._protected

    def host_size(self) -> int:
        """Host tokens the tree owns (0 without a host tier)."""
        return self._host_tokens

    def stats(self) -> dict:
        """Counters in tokens. ``hit_tokens`` = ``device_hit_tokens`` (already on
        the device) + ``host_hit_tokens`` (loaded back from the host tier)."""
        q = self.queried_tokens
        out: dict[str, Any] = {
            "queried_tokens": q,
            "hit_tokens": self.hit_tokens,
            "device_hit_tokens": self.hit_tokens - self.host_hit_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            "inserted_tokens": self.inserted_tokens,
            "evicted_tokens": self.evicted_tokens,
            "hit_rate": self.hit_tokens / q if q else 0.0,
            "device_hit_rate": (self.hit_tokens - self.host_hit_tokens) / q if q else 0.0,
            "host_hit_rate": self.host_hit_tokens / q if q else 0.0,
            "cached_tokens": self.total_size(),
        }
        host = self.host
        if host is not None:
            out.update({
                "host_cached_tokens": self._host_tokens,
                "host_total_tokens": host.allocator.total_slots,
                "host_evicted_tokens": self.host_evicted_tokens,
                "host_loaded_tokens": host.transfers.loaded_tokens,
                "host_offloaded_tokens": host.transfers.offloaded_tokens,
                "hicache_write_policy": host.write_policy,
            })
        return out

    # -------------------------------------------------------------- traversal
    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node (iterative DFS)."""
        stack = [c for sub in self.root.children.values() for c in sub.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> list[int]:
        """Every slot the tree owns (any order)."""
        out: list[int] = []
        for node in self._nodes():
            out.extend(node.value)
        return out

    def namespaces(self) -> list[Hashable]:
        return list(self.root.children.keys())

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert every structural invariant (O(tree size); for tests)."""
        check_tree_integrity(self)


def _member(leaves: SortedList, entry: Optional[tuple], node: TreeNode, want: bool) -> Optional[tuple]:
    """Put ``node`` in or take it out of the sorted LRU set ``leaves``; its new entry (None: out)."""
    if want and entry is None:
        entry = (node.last_access, node.id, node)
        leaves.add(entry)
    elif not want and entry is not None:
        leaves.remove(entry)
        entry = None
    return entry
