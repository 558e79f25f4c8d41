"""Routing policies: which worker gets a request.

A policy sees the healthy workers' urls, their loads (requests the router has
in flight on each) and the request's routing key (its prompt text or token
ids, or None when the route has no prompt), and names one worker. It is told
when a worker leaves (``remove_worker``), when caches were flushed
(``reset``) and is asked to shrink its state on an interval (``evict``).

* ``round_robin``: the next worker in turn.
* ``shortest_queue``: the worker with the fewest requests in flight (ties:
  the one used longest ago).
* ``cache_aware`` (SGLang router's policy): an approximate radix tree per
  worker of the prompts routed to it. While the loads are balanced, a
  request goes to the worker holding the longest prefix of its key when that
  prefix is at least ``cache_threshold`` of the key; otherwise to the worker
  whose tree is smallest (the most room for a new prefix). When the loads
  are imbalanced (max - min > ``balance_abs_threshold`` and max >
  ``balance_rel_threshold`` x min) the least loaded worker gets it. Either
  way the key is inserted into the chosen worker's tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from radixrt.router.approx_tree import ApproxTree

RouteKey = Union[str, tuple[int, ...]]
POLICIES = ("round_robin", "shortest_queue", "cache_aware")


class Policy(Protocol):
    name: str

    def select(self, workers: Sequence[str], loads: dict[str, int], key: Optional[RouteKey]) -> str:
        """One of ``workers`` (never empty) for a request with routing ``key``."""
        ...

    def remove_worker(self, url: str) -> None: ...

    def reset(self) -> None: ...

    def evict(self) -> None: ...

    def stats(self) -> dict: ...


class StatelessPolicy:
    """The no-op upkeep of a policy that keeps no per-worker prefix state."""

    def remove_worker(self, url: str) -> None:
        pass

    def reset(self) -> None:
        pass

    def evict(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


class RoundRobin(StatelessPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, workers: Sequence[str], loads: dict[str, int], key: Optional[RouteKey]) -> str:
        return workers[next(self._counter) % len(workers)]


class ShortestQueue(StatelessPolicy):
    name = "shortest_queue"

    def __init__(self) -> None:
        self._tick = itertools.count()
        self._last_used: dict[str, int] = {}

    def select(self, workers: Sequence[str], loads: dict[str, int], key: Optional[RouteKey]) -> str:
        url = min(workers, key=lambda w: (loads.get(w, 0), self._last_used.get(w, -1)))
        self._last_used[url] = next(self._tick)
        return url

    def remove_worker(self, url: str) -> None:
        self._last_used.pop(url, None)


@dataclass
class CacheAwareConfig:
    """SGLang router's knobs, under its flag names."""

    cache_threshold: float = 0.3  # least matched fraction of the key for prefix routing
    balance_abs_threshold: int = 64  # imbalanced when max - min load exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max load exceeds this times the min
    eviction_interval_s: float = 120.0  # how often the trees are cut down to max_tree_size
    max_tree_size: int = 2**24  # elements (characters or token ids) per worker's tree

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.eviction_interval_s <= 0 or self.max_tree_size < 0:
            raise ValueError("eviction_interval_s must be > 0 and max_tree_size >= 0")


class CacheAware:
    name = "cache_aware"

    def __init__(self, config: Optional[CacheAwareConfig] = None) -> None:
        self.config = config or CacheAwareConfig()
        self._trees: dict[type, ApproxTree] = {str: ApproxTree(), tuple: ApproxTree()}
        self._fallback = ShortestQueue()
        self.counts = {"prefix": 0, "smallest_tree": 0, "balance": 0, "no_key": 0}

    def _tree(self, key: Sequence[Hashable]) -> ApproxTree:
        return self._trees[str if isinstance(key, str) else tuple]

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        c = self.config
        return hi - lo > c.balance_abs_threshold and hi > lo * c.balance_rel_threshold

    def select(self, workers: Sequence[str], loads: dict[str, int], key: Optional[RouteKey]) -> str:
        if not key:
            self.counts["no_key"] += 1
            return self._fallback.select(workers, loads, None)
        tree = self._tree(key)
        if self.imbalanced([loads.get(w, 0) for w in workers]):
            self.counts["balance"] += 1
            url = self._fallback.select(workers, loads, None)
        else:
            matched = tree.match(key)
            best = max(workers, key=lambda w: (matched.get(w, 0), -loads.get(w, 0)))
            if matched.get(best, 0) >= self.config.cache_threshold * len(key) and matched.get(best, 0) > 0:
                self.counts["prefix"] += 1
                url = best
            else:
                self.counts["smallest_tree"] += 1
                url = min(workers, key=lambda w: (self._size(w), loads.get(w, 0)))
        tree.insert(key, url)
        return url

    def _size(self, url: str) -> int:
        return sum(t.size(url) for t in self._trees.values())

    def remove_worker(self, url: str) -> None:
        for t in self._trees.values():
            t.remove_tenant(url)
        self._fallback.remove_worker(url)

    def reset(self) -> None:
        for t in self._trees.values():
            t.clear()

    def evict(self) -> None:
        for t in self._trees.values():
            for tenant in list(t.sizes()):
                t.evict_tenant(tenant, self.config.max_tree_size)

    def stats(self) -> dict:
        sizes: dict[str, int] = {}
        for t in self._trees.values():
            for w, s in t.sizes().items():
                sizes[w] = sizes.get(w, 0) + s
        return {"decisions": dict(self.counts), "tree_sizes": sizes}


def make_policy(name: str, cache_aware: Optional[CacheAwareConfig] = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    if name == "cache_aware":
        return CacheAware(cache_aware)
    raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICIES)})")
