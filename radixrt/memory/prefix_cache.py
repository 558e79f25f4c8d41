"""`PrefixCache`: what the KV manager asks of a prefix cache.

Three implementations, chosen once when the scheduler is built:

- `RadixCache` (radix_cache.py): the radix tree of KV slots on the device;
- `HostRadixCache` (host_radix_cache.py): the same tree over two tiers, the
  device and a host pool below it (load back, back up, host eviction,
  offload);
- `NoPrefixCache` (no_prefix_cache.py): ``--disable-radix-cache``, keeps
  nothing.

A further tier (disk, below the host) is another subclass of the tree that
holds nodes off the device; token-level KV eviction changes what `evict` and
`insert` keep. Both plug in behind this interface: the KV manager, the
planner and the scheduler only call what is declared here.

Slot ownership
==============
Every device KV slot is at all times exactly one of free (on the allocator's
free list), owned by the cache, or private to one running request. The cache
owns exactly the slots of `all_slots`; it takes slots only in `insert` (the
caller's, for tokens it did not hold on the device yet) and in a
``load_back`` match (fresh ones from the allocator), and gives slots back to
the allocator only in `evict`, `offload` and `reset` (and in a ``load_back``
match, which may evict to make room). Slots of a lower tier (host, disk) are
either free on that tier's allocator or owned by the cache, never by a
request. The cache never touches a request's private slots.

Counters
========
The cache owns its counters (tokens): queried, hit (of which loaded back from
a lower tier), inserted, evicted. `match_prefix` counts unless told not to;
a caller that matched without counting reports the outcome with
`record_match`. `stats` renders them; `reset_stats` zeroes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Hashable, Sequence

from radixrt.memory.kv_transfer import KVTransfers
from radixrt.memory.radix_node import MatchResult, TreeNode
from radixrt.memory.radix_observer import TreeObserver


class PrefixCache(ABC):
    """Cached prefixes of token sequences, with the KV slots that hold them.

    page_size: keys and slots are matched and stored in whole pages only.
    root: the top of the tree (read-only for callers: `radix_explain` walks
        it; a cache that keeps nothing has a root with no children).
    stores_prefixes: False for a cache that keeps nothing (`NoPrefixCache`):
        every match is empty and every insert returns 0. Callers skip work
        whose only use is prefix reuse when it is False.
    """

    stores_prefixes: ClassVar[bool] = True
    page_size: int
    root: TreeNode

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.reset_stats()

    # ------------------------------------------------------------- lookups
    @abstractmethod
    def match_prefix(
        self, key: Sequence[int], namespace: Hashable = None, record_stats: bool = True, load_back: bool = False
    ) -> MatchResult:
        """The longest cached prefix of `key` in `namespace` (whole pages).

        The returned slots stay cache-owned; they are valid past the next
        cache call only while the caller holds `lock` on the returned node.
        May split a node (node identities handed out before stay valid) and
        refreshes access times. ``load_back``: what a lower tier holds of the
        prefix gets device slots and its copies are queued (`take_transfers`);
        a cache without a lower tier ignores it. ``record_stats=False`` leaves
        the counters alone."""

    @abstractmethod
    def insert(
        self, key: Sequence[int], slots: Sequence[int], namespace: Hashable = None, computed: bool = True
    ) -> int:
        """Cache ``key[:n] -> slots[:n]``, n = ``len(key)`` rounded down to a page.

        Returns p, the leading tokens the cache already held on the device.
        Afterwards ``slots[p:n]`` are cache-owned; ``slots[:p]`` and
        ``slots[n:]`` stay the caller's (those of ``slots[:p]`` it did not get
        from a locked match are duplicates it must free). ``computed=False``:
        the KV is computed by the step about to be launched (a copy to a lower
        tier then runs after that step's forward)."""

    @abstractmethod
    def lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors: their device slots are not evicted or
        moved until the matching `unlock`. A root is a no-op; a node no longer
        on the device raises RuntimeError."""

    @abstractmethod
    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`; RuntimeError when `node` is not locked."""

    # ----------------------------------------------------- giving memory back
    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots of unlocked nodes (least
        recently used first; whole nodes) or as many as there are; returns
        the device tokens freed. A node leaves the device: to a lower tier,
        or out of the cache."""

    def offload(self, node: TreeNode) -> int:
        """Move the unlocked device chain that ends at `node` to a lower tier
        now, freeing its device slots (a retracted request's swap-out);
        returns the device tokens freed (0 without a lower tier)."""
        return 0

    def take_transfers(self) -> KVTransfers:
        """The copies between tiers queued since the last call, for the step
        being launched (empty without a lower tier)."""
        return KVTransfers()

    @abstractmethod
    def reset(self) -> None:
        """Drop everything, giving every cache-owned slot of every tier back;
        RuntimeError while anything is locked. Counters are kept."""

    @abstractmethod
    def add_observer(self, observer: TreeObserver) -> None:
        """Tell `observer` of every token run that enters or leaves the cache
        (radix_observer.py). A cache that keeps nothing has nothing to tell."""

    # --------------------------------------------------------------- sizes
    @abstractmethod
    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes (all of them can be evicted)."""

    @abstractmethod
    def protected_size(self) -> int:
        """Device tokens in locked nodes."""

    def total_size(self) -> int:
        """Device tokens the cache owns."""
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def all_slots(self) -> list[int]:
        """Every device slot the cache owns (any order)."""

    def lower_tiers(self) -> dict[str, dict[str, int]]:
        """``{tier: {"total_slots", "free_slots", "tree_slots"}}`` for each tier
        below the device (``free + tree == total`` on each); empty without."""
        return {}

    # `offload`, `take_transfers` and `lower_tiers` above are those of a cache
    # with no tier below the device; a cache with one overrides all three.

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert every structural invariant (O(cache size); for tests)."""

    # ------------------------------------------------------------ counters
    def reset_stats(self) -> None:
        self.queried_tokens = 0
        self.hit_tokens = 0  # hits on any tier
        self.host_hit_tokens = 0  # of which loaded back from a lower tier
        self.storage_hit_tokens = 0  # of those, read from the storage tier first
        self.inserted_tokens = 0
        self.evicted_tokens = 0  # left the device (to a lower tier or gone)

    def record_match(self, queried: int, hit: int, loaded: int = 0) -> None:
        """Count a look-up of `queried` tokens that found `hit` of them, `loaded`
        of which came back from a lower tier."""
        self.queried_tokens += queried
        self.hit_tokens += hit
        self.host_hit_tokens += loaded

    def stats(self) -> dict[str, Any]:
        """Counters in tokens. ``hit_tokens`` = ``device_hit_tokens`` (already on
        the device) + ``host_hit_tokens`` (loaded back from the host tier) +
        ``storage_hit_tokens`` (read from the storage tier for the request, then
        loaded back through the host tier)."""
        q, hit, lower, stored = self.queried_tokens, self.hit_tokens, self.host_hit_tokens, self.storage_hit_tokens
        return {
            "queried_tokens": q,
            "hit_tokens": hit,
            "device_hit_tokens": hit - lower,
            "host_hit_tokens": lower - stored,
            "storage_hit_tokens": stored,
            "inserted_tokens": self.inserted_tokens,
            "evicted_tokens": self.evicted_tokens,
            "hit_rate": hit / q if q else 0.0,
            "device_hit_rate": (hit - lower) / q if q else 0.0,
            "host_hit_rate": (lower - stored) / q if q else 0.0,
            "storage_hit_rate": stored / q if q else 0.0,
            "cached_tokens": self.total_size(),
        }
