"""Radix tree over token ids mapping cached prefixes to device KV slot ids
(RadixAttention), the `PrefixCache` of the device alone (slot ownership: see
prefix_cache.py). The host tier is a subclass (host_radix_cache.py).

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

Splitting a node keeps the original object as the *lower* (deeper) half and
inserts a new node above it, so a `TreeNode` handed out by `match_prefix`
always ends at the same token position, even after later splits; locks taken
on it stay valid. LRU eviction: the least recently used unlocked nodes with
no child on the device go first.

`match_prefix` and `insert` share one walk (`_walk`). A subclass with a lower
tier changes only hooks: what a walked path yields (`_matched`,
`_fill_path`), what a new node (`_added`) and an evicted one (`_vacate`,
`_forget`) become, and the leaf bookkeeping (`_refresh_leaf`, `_touch`,
`_split`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Iterator, Optional, Sequence

from sortedcontainers import SortedList

from radixrt.memory.prefix_cache import PrefixCache
from radixrt.memory.radix_integrity import check_tree_integrity
from radixrt.memory.radix_node import (
    MatchResult,
    TreeNode,
    _first_mismatch,
    as_list,
    check_pages,
    concat_slots,
    lru_member,
)
from radixrt.memory.radix_observer import TreeObserver, node_place, subtree_runs, tree_runs

if TYPE_CHECKING:  # keep this module free of torch at import time
    from radixrt.memory.kv_pool import PageAllocator


class RadixCache(PrefixCache):
    """Prefix cache of device KV slots keyed by token ids.

    allocator: where evicted slots go (``allocator.free_slots``). With None,
        evicted/reset slots are simply dropped (handy for tests of the tree alone).
    page_size: keys and values are matched/stored in whole pages only.
    """

    def __init__(self, allocator: Optional["PageAllocator"], page_size: int = 1) -> None:
        super().__init__(page_size)
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(f"allocator page_size {allocator.page_size} != cache page_size {page_size}")
        self.allocator = allocator
        self._clock = 0
        self._observers: list[TreeObserver] = []
        self._node_observers: list[Any] = []  # kv_events.KVEventRecorder: told of nodes, not token runs
        self._init_tree()

    def add_observer(self, observer: TreeObserver) -> None:
        """Tell `observer` of every node that enters or leaves the tree from now
        on (radix_observer.py); what the tree holds already is replayed to it
        as insertions first."""
        for namespace, context, key in tree_runs(self.root, observer.context_len):
            observer.on_insert(namespace, context, key)
        self._observers.append(observer)

    def add_node_observer(self, observer: Any) -> None:
        """Tell `observer` (a `kv_events.KVEventRecorder`) of every node that enters
        the tree (``on_node_insert``), is split (``on_node_split`` with the new upper
        part), leaves it (``on_node_remove``, children before their parent) and of
        a reset (``on_reset``), from now on; what the tree holds already is
        replayed as insertions first, parents before children."""
        for namespace, sub in self.root.children.items():
            stack = list(sub.children.values())
            while stack:
                x = stack.pop()
                observer.on_node_insert(namespace, x)
                stack.extend(x.children.values())
        self._node_observers.append(observer)

    def _namespace_of(self, node: TreeNode) -> Hashable:
        x = node
        while x.parent is not None and x.parent.parent is not None:
            x = x.parent
        return self._sub_ns[x.id]

    # ------------------------------------------------------------------ setup
    def _init_tree(self) -> None:
        self.root = TreeNode([], [], None)
        # Sub-roots are children of `root`, keyed by namespace; _sub_ns maps back.
        self._sub_ns: dict[int, Hashable] = {}
        self._leaves: SortedList = SortedList()  # device-evictable nodes
        self._evictable = 0
        self._protected = 0

    def reset(self) -> None:
        self._check_unlocked()
        slots: list[int] = []
        for node in list(self._nodes()):
            slots.extend(node.value)
            node.parent = None  # stale references now read as evicted
            node.lru_entry = None
        if self.allocator is not None and slots:
            self.allocator.free_slots(slots)
        self._init_tree()
        for observer in [*self._observers, *self._node_observers]:
            observer.on_reset()

    def _check_unlocked(self) -> None:
        if self._protected:
            raise RuntimeError(f"reset() with {self._protected} locked tokens in the tree")

    # ---------------------------------------------------------------- helpers
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: list[int], pos: int = 0) -> Any:
        if self.page_size == 1:
            return key[pos]
        return tuple(key[pos : pos + self.page_size])

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
        node.last_access = t

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Put `node` in / take it out of the evictable-leaf set as its state
        requires: on the device, unlocked, and no child on the device."""
        want = bool(node.value) and node.lock_ref == 0 and not node.children
        node.lru_entry = lru_member(self._leaves, node.lru_entry, node, want)

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
        upper.hits = node.hits
        node.key = node.key[m:]
        node.value = node.value[m:]
        node.parent = upper
        upper.children[self._child_key(node.key)] = node
        parent.children[self._child_key(upper.key)] = upper
        if self._node_observers:
            namespace = self._namespace_of(upper)
            for observer in self._node_observers:
                observer.on_node_split(namespace, upper)
        return upper

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # ------------------------------------------------------------------- walk
    def _walk(
        self, node: TreeNode, key: list[int], n: int, t: int, split_end: bool = True
    ) -> tuple[list[TreeNode], int]:
        """Descend from sub-root `node` along ``key[:n]`` (n page-aligned),
        touching every node walked into at time `t`.

        Returns ``(path, pos)``: the nodes walked into, in order, and the
        tokens of ``key`` they match. A node the match ends inside is split
        there, so the path ends exactly at ``pos``; except that with
        ``split_end=False`` a node on the device that ``key[:n]`` ends inside
        stays whole (it is last on the path, ``pos == n``, and reaches past).
        """
        P = self.page_size
        path: list[TreeNode] = []
        pos = 0
        while pos < n:
            child = node.children.get(key[pos] if P == 1 else tuple(key[pos : pos + P]))
            if child is None:
                break
            clen = len(child.key)
            m = _first_mismatch(child.key, key, pos, min(clen, n - pos))
            if P > 1:
                m -= m % P  # >= P: the first page matched via the dict key
            self._touch(child, t)
            if m < clen:
                if not split_end and pos + m == n and child.value:
                    path.append(child)
                    return path, n
                path.append(self._split(child, m))
                return path, pos + m
            path.append(child)
            pos += m
            node = child
        return path, pos

    # ------------------------------------------------------------------ match
    def match_prefix(
        self, key: Sequence[int], namespace: Hashable = None, record_stats: bool = True, load_back: bool = False
    ) -> MatchResult:
        """Longest cached prefix of `key` (whole pages; `PrefixCache.match_prefix`).

        Splits a node on a partial match so that the returned node ends exactly
        at the match. Does not lock. Refreshes the access time of every node on
        the matched path. ``record_stats=False``: for look-ups that are not a
        request being served (e.g. policy scoring). ``load_back``: see
        `HostRadixCache` (nothing here is off the device)."""
        key = as_list(key)
        sub = self.root.children.get(namespace)
        if sub is None:
            result = MatchResult([], self.root)
        else:
            path, _ = self._walk(sub, key, self._aligned(len(key)), self._tick())
            result = self._matched(sub, path, load_back)
        if record_stats:
            self.record_match(len(key), result.length, result.loaded)
        return result

    def _matched(self, sub: TreeNode, path: list[TreeNode], load_back: bool) -> MatchResult:
        """The match a walked path gives (every node of it is on the device)."""
        if not path:
            return MatchResult([], sub)
        return MatchResult(concat_slots([x.value for x in path]), path[-1])

    # ----------------------------------------------------------------- insert
    def insert(
        self, key: Sequence[int], slots: Sequence[int], namespace: Hashable = None, computed: bool = True
    ) -> int:
        """Cache ``key[:n]`` -> ``slots[:n]`` where n = len(key) rounded down to a page.

        Requires ``len(slots) == len(key)``; with page_size > 1 ``slots[:n]``
        must be made of whole pages, in order. Returns ``p``, the leading
        tokens already on the device in the tree (a multiple of page_size,
        ``p <= n``): ``slots[p:n]`` now belong to the tree, ``slots[:p]`` and
        ``slots[n:]`` stay the caller's (of ``slots[:p]``, those it did not get
        from a locked match are duplicates it must free). ``computed``: see
        `HostRadixCache` (its write-through copy waits for the forward)."""
        key = as_list(key)
        slot_list = as_list(slots)
        if len(slot_list) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(slot_list)} slots")
        n = self._aligned(len(key))
        if n == 0:
            return 0
        sub = self._sub_root_created(namespace)
        t = self._tick()
        path, pos = self._walk(sub, key, n, t, split_end=False)
        present = pos - self._fill_path(sub, path, slot_list)
        if pos < n:
            parent = path[-1] if path else sub
            value = slot_list[pos:n]
            if self.page_size > 1:
                check_pages(value, self.page_size)
            leaf = TreeNode(key[pos:n], value, parent, t)
            parent.children[self._child_key(leaf.key)] = leaf
            self._refresh_leaf(parent)
            self._refresh_leaf(leaf)
            self._evictable += n - pos
            self.inserted_tokens += n - pos
            self._added(leaf, computed)
            self._announce(namespace, key[:pos], leaf)
        return present

    def _announce(self, namespace: Hashable, before: list[int], leaf: TreeNode) -> None:
        """Tell the observers of new node ``leaf``, which follows the tokens ``before``."""
        for observer in self._observers:
            observer.on_insert(namespace, before[max(0, len(before) - observer.context_len) :], leaf.key)
        for node_observer in self._node_observers:
            node_observer.on_node_insert(namespace, leaf)

    def _fill_path(self, sub: TreeNode, path: list[TreeNode], slots: list[int]) -> int:
        """Give the path's nodes that are off the device the caller's slots for
        their tokens; returns how many tokens took them (none here)."""
        return 0

    def _added(self, leaf: TreeNode, computed: bool) -> None:
        """A new node entered the tree (nothing more to do on the device alone)."""

    # ------------------------------------------------------------ lock/unlock
    def lock(self, node: TreeNode) -> None:
        """`PrefixCache.lock`: pins `node` and its ancestors."""
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
        """`PrefixCache.unlock`."""
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
        more than asked). Freed slots go back through ``allocator.free_slots``;
        an evicted node is dropped (`_vacate`). A parent left without children
        on the device becomes a candidate in the same call. O(k log n) for k
        evicted leaves."""
        if num_tokens <= 0:
            return 0
        freed = 0
        leaves = self._leaves
        while freed < num_tokens and leaves:
            _, _, node = leaves[0]
            freed += self._evict_device(node)
        self.evicted_tokens += freed
        return freed

    def _evict_device(self, node: TreeNode) -> int:
        """Take device-evictable `node` off the device; returns the tokens freed."""
        assert node.lru_entry is not None
        self._leaves.remove(node.lru_entry)
        node.lru_entry = None
        n = len(node.key)
        if self.allocator is not None:
            self.allocator.free_slots(node.value)
        self._evictable -= n
        self._vacate(node)
        return n

    def _vacate(self, node: TreeNode) -> None:
        """What becomes of a node whose device slots were just freed: it leaves the tree."""
        node.value = []
        self._drop(node)

    def _drop(self, node: TreeNode) -> None:
        """Remove `node` (now off the device) and its subtree from the tree."""
        for observer in self._observers:
            namespace, context = node_place(node, self._sub_ns, observer.context_len)
            for ctx, key in subtree_runs(node, context, observer.context_len):
                observer.on_remove(namespace, ctx, key)
        if self._node_observers:
            namespace = self._namespace_of(node)
            order, stack = [], [node]
            while stack:
                x = stack.pop()
                order.append(x)
                stack.extend(x.children.values())
            for x in reversed(order):  # children before their parent
                for node_observer in self._node_observers:
                    node_observer.on_node_remove(namespace, x)
        self._forget(node)
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]
        node.parent = None
        if parent.key:
            self._refresh_leaf(parent)
        elif not parent.children:
            self._drop_empty_sub_root(parent)

    def _forget(self, node: TreeNode) -> None:
        """Release what `node`'s subtree holds off the device (a device leaf has no subtree)."""

    def _drop_empty_sub_root(self, sub: TreeNode) -> None:
        # Non-default namespaces vanish when empty, so per-request salts do not
        # accumulate sub-roots. The default namespace's sub-root stays.
        ns = self._sub_ns[sub.id]
        if ns is not None:
            del self.root.children[ns]
            del self._sub_ns[sub.id]

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # -------------------------------------------------------------- traversal
    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node (iterative DFS)."""
        stack = [c for sub in self.root.children.values() for c in sub.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> list[int]:
        out: list[int] = []
        for node in self._nodes():
            out.extend(node.value)
        return out

    def namespaces(self) -> list[Hashable]:
        return list(self.root.children.keys())

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        check_tree_integrity(self)
