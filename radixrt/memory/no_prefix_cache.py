"""`NoPrefixCache`: the ``--disable-radix-cache`` baseline, a prefix cache
that keeps nothing (every prompt is computed in full)."""

from __future__ import annotations

from typing import ClassVar, Hashable, Sequence

from radixrt.memory.prefix_cache import PrefixCache
from radixrt.memory.radix_node import MatchResult, TreeNode
from radixrt.memory.radix_observer import TreeObserver


class NoPrefixCache(PrefixCache):
    """Owns no slot, ever: `match_prefix` matches nothing (its node is the
    root), `insert` stores nothing and returns 0 (the caller keeps, and must
    free, every slot), `evict` and `offload` free nothing. Look-ups are still
    counted (``queried_tokens``), so the hit rate reads 0."""

    stores_prefixes: ClassVar[bool] = False

    def __init__(self, page_size: int = 1) -> None:
        super().__init__(page_size)
        self.root = TreeNode([], [], None)

    def match_prefix(
        self, key: Sequence[int], namespace: Hashable = None, record_stats: bool = True, load_back: bool = False
    ) -> MatchResult:
        if record_stats:
            self.record_match(len(key), 0)
        return MatchResult([], self.root)

    def insert(
        self, key: Sequence[int], slots: Sequence[int], namespace: Hashable = None, computed: bool = True
    ) -> int:
        if len(slots) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(slots)} slots")
        return 0

    def lock(self, node: TreeNode) -> None:
        self._check_root(node)

    def unlock(self, node: TreeNode) -> None:
        self._check_root(node)

    def _check_root(self, node: TreeNode) -> None:
        if node is not self.root:
            raise RuntimeError(f"{node!r} is not a node of this cache (it holds only its root)")

    def evict(self, num_tokens: int) -> int:
        return 0

    def reset(self) -> None:
        pass

    def add_observer(self, observer: TreeObserver) -> None:
        pass  # nothing ever enters

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def all_slots(self) -> list[int]:
        return []

    def namespaces(self) -> list[Hashable]:
        return []

    def check_integrity(self) -> None:
        root = self.root
        assert not root.children and not root.key and not root.value and root.lock_ref == 0
        assert self.hit_tokens == self.inserted_tokens == self.evicted_tokens == 0
