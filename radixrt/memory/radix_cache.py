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

Splitting a node keeps the original object as the *lower* (deeper) half and
inserts a new node above it, so a `TreeNode` handed out by `match_prefix`
always ends at the same token position, even after later splits; locks taken
on it stay valid.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Iterator, Optional, Sequence

from sortedcontainers import SortedList

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
    """

    def __init__(self, allocator: Optional["PageAllocator"], page_size: int = 1, disable: bool = False) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if allocator is not None and allocator.page_size != page_size:
            raise ValueError(f"allocator page_size {allocator.page_size} != cache page_size {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self._clock = 0
        self.reset_stats()
        self._init_tree()

    # ------------------------------------------------------------------ setup
    def _init_tree(self) -> None:
        self.root = TreeNode([], [], None)
        # Sub-roots are children of `root`, keyed by namespace; _sub_ns maps back.
        self._sub_ns: dict[int, Hashable] = {}
        self._leaves: SortedList = SortedList()
        self._evictable = 0
        self._protected = 0

    def reset_stats(self) -> None:
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.inserted_tokens = 0
        self.evicted_tokens = 0

    def reset(self) -> None:
        """Drop the whole tree, giving every tree-owned slot back to the
        allocator. Requires that nothing is locked. Stats are kept (see
        `reset_stats`)."""
        if self._protected:
            raise RuntimeError(f"reset() with {self._protected} locked tokens in the tree")
        slots: list[int] = []
        for node in list(self._nodes()):
            slots.extend(node.value)
            node.parent = None  # stale references now read as evicted
            node.lru_entry = None
        if self.allocator is not None and slots:
            self.allocator.free_slots(slots)
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
            node.last_access = t
            node.lru_entry = (t, node.id, node)
            self._leaves.add(node.lru_entry)
        else:
            node.last_access = t

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Put `node` in / take it out of the evictable-leaf set as its state requires."""
        want = bool(node.key) and not node.children and node.lock_ref == 0
        if want:
            if node.lru_entry is None:
                node.lru_entry = (node.last_access, node.id, node)
                self._leaves.add(node.lru_entry)
        elif node.lru_entry is not None:
            self._leaves.remove(node.lru_entry)
            node.lru_entry = None

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
        node.key = node.key[m:]
        node.value = node.value[m:]
        node.parent = upper
        upper.children[self._child_key(node.key)] = node
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: Sequence[int], namespace: Hashable = None, record_stats: bool = True) -> MatchResult:
        """Longest cached prefix of `key` (whole pages only when page_size > 1).

        Splits a node on a partial match so that the returned node ends exactly
        at the match. Does not lock: the returned slots remain tree-owned and
        may be evicted by a later `evict` unless the caller locks `node`.
        Refreshes the access time of every node on the matched path.
        ``record_stats=False`` leaves the queried/hit counters alone (for
        look-ups that are not a request being served, e.g. policy scoring).
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
            parts.append(child.value)
            pos += m
            node = child
            if m < clen:
                break
        slots = parts[0][:] if len(parts) == 1 else [s for part in parts for s in part]
        if record_stats:
            self.hit_tokens += pos
        return MatchResult(slots, node)

    # ----------------------------------------------------------------- insert
    def insert(self, key: Sequence[int], slots: Sequence[int], namespace: Hashable = None) -> int:
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
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            clen = len(child.key)
            m = _first_mismatch(child.key, key, pos, min(clen, n - pos))
            if self.page_size > 1:
                m = self._aligned(m)
            self._touch(child, t)
            pos += m
            if m < clen:
                if pos == n:  # key ends inside this node: nothing to add, no split needed
                    return pos
                child = self._split(child, m)
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
        return pos

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
        was evicted raises RuntimeError."""
        if node.key and node.parent is None:
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
                if not node.children:
                    node.lru_entry = (node.last_access, node.id, node)
                    self._leaves.add(node.lru_entry)
            parent = node.parent
            assert parent is not None, "a locked node's ancestors are in the tree"
            node = parent

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves until at least `num_tokens`
        tokens were freed or nothing is evictable; returns tokens freed (whole
        leaves, so possibly more than asked). Freed slots go back through
        ``allocator.free_slots``. A parent left without children becomes a
        candidate in the same call. O(k log n) for k evicted leaves."""
        if self.disable or num_tokens <= 0:
            return 0
        freed = 0
        leaves = self._leaves
        alloc = self.allocator
        while freed < num_tokens and leaves:
            _, _, node = leaves.pop(0)
            node.lru_entry = None
            if alloc is not None:
                alloc.free_slots(node.value)
            n = len(node.key)
            freed += n
            self._evictable -= n
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            node.parent = None
            if parent.key:
                self._refresh_leaf(parent)
            elif not parent.children:
                self._drop_empty_sub_root(parent)
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
        return self._evictable + self._protected

    def stats(self) -> dict:
        q = self.queried_tokens
        return {
            "queried_tokens": q,
            "hit_tokens": self.hit_tokens,
            "inserted_tokens": self.inserted_tokens,
            "evicted_tokens": self.evicted_tokens,
            "hit_rate": self.hit_tokens / q if q else 0.0,
            "cached_tokens": self.total_size(),
        }

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
