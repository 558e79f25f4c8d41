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

  With the workers' KV cache events (`KVEventIndex`, radixrt/router/kv_routing.py)
  and a request whose token ids the router knows (``tokens``), the prefix
  rule runs first on what the workers' caches really hold: the worker whose
  cache holds the most leading tokens of the request (whole blocks) gets it
  when that is at least ``cache_threshold`` of the prompt. Only while every
  worker chosen among is live in the index. Otherwise (no such prefix in any
  cache, events not flowing for one of the workers, a request the router
  cannot tokenize exactly) the approximate tree decides as without events:
  it also knows the prompts routed a moment ago, whose KV is not stored (nor
  published) yet. The tree is kept up to date either way.
  ``stats()["sources"]`` counts what decided: ``events``, ``approx_tree``
  (events live, no prefix in them) and ``no_events``.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

from radixrt.router.approx_tree import ApproxTree
from radixrt.router.key_marker import marker_len
from radixrt.router.kv_event_index import KVEventIndex, TokenKey

RouteKey = Union[str, tuple[Any, ...]]  # a namespace marker (key_marker.py), then the prompt
POLICIES = ("round_robin", "shortest_queue", "cache_aware")


class Policy(Protocol):
    name: str

    def select(
        self, workers: Sequence[str], loads: dict[str, int], key: Optional[RouteKey], tokens: Optional[TokenKey] = None
    ) -> str:
        """One of ``workers`` (never empty) for a request with routing ``key``
        (and, where the router knows them, its token ids and namespace ``tokens``)."""
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

    def select(
        self, workers: Sequence[str], loads: dict[str, int], key: Optional[RouteKey], tokens: Optional[TokenKey] = None
    ) -> str:
        return workers[next(self._counter) % len(workers)]


class ShortestQueue(StatelessPolicy):
    name = "shortest_queue"

    def __init__(self) -> None:
        self._tick = itertools.count()
        self._last_used: dict[str, int] = {}

    def select(
        self, workers: Sequence[str], loads: dict[str, int], key: Optional[RouteKey], tokens: Optional[TokenKey] = None
    ) -> str:
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

    def __init__(self, config: Optional[CacheAwareConfig] = None, events: Optional[KVEventIndex] = None) -> None:
        self.config = config or CacheAwareConfig()
        self.events = events
        self._trees: dict[type, ApproxTree] = {str: ApproxTree(), tuple: ApproxTree()}
        self._fallback = ShortestQueue()
        self.counts = {"prefix": 0, "smallest_tree": 0, "balance": 0, "no_key": 0}
        # what decided (when loads were balanced): a prefix the events showed; the tree, the events live
        # but showing no prefix; the tree, the events not live for every worker or the prompt not tokenized
        self.sources = {"events": 0, "approx_tree": 0, "no_events": 0}

    def _tree(self, key: Sequence[Hashable]) -> ApproxTree:
        return self._trees[str if isinstance(key, str) else tuple]

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        c = self.config
        return hi - lo > c.balance_abs_threshold and hi > lo * c.balance_rel_threshold

    def select(
        self, workers: Sequence[str], loads: dict[str, int], key: Optional[RouteKey], tokens: Optional[TokenKey] = None
    ) -> str:
        if not key and tokens is None:
            self.counts["no_key"] += 1
            return self._fallback.select(workers, loads, None)
        if self.imbalanced([loads.get(w, 0) for w in workers]):
            self.counts["balance"] += 1
            url = self._fallback.select(workers, loads, None)
        else:
            on_events = self._on_events(workers, loads, tokens)
            if on_events is not None:
                url = on_events
            else:
                url = self._by_prefix(workers, loads, *self._match(key))
        if key:
            self._insert(key, url)
        return url

    def _insert(self, key: RouteKey, url: str) -> None:
        """Record ``key`` as sent to ``url``; past ``max_tree_size`` the worker's tree is cut to
        three quarters of it at once (amortized over the quarter inserted since), so that no burst
        of long keys (requests the worker refuses included) outgrows the bound between `evict` runs."""
        tree = self._tree(key)
        tree.insert(key, url)
        if tree.size(url) > self.config.max_tree_size:
            tree.evict_tenant(url, self.config.max_tree_size * 3 // 4)

    def _on_events(self, workers: Sequence[str], loads: dict[str, int], tokens: Optional[TokenKey]) -> Optional[str]:
        """The worker whose cache holds the longest prefix of ``tokens`` per the
        KV events, when that covers ``cache_threshold`` of them; None when it
        does not, or when the events cannot tell (the tree decides then)."""
        held = self.events.match_tokens(workers, tokens) if self.events is not None and tokens else None
        if held is None or tokens is None:
            self.sources["no_events"] += 1
            return None
        best = max(workers, key=lambda w: (held[w], -loads.get(w, 0)))
        if held[best] > 0 and held[best] >= self.config.cache_threshold * len(tokens.ids):
            self.sources["events"] += 1
            self.counts["prefix"] += 1
            return best
        self.sources["approx_tree"] += 1
        return None

    def _match(self, key: Optional[RouteKey]) -> tuple[dict[str, int], int]:
        """Per worker, how much of ``key``'s prompt its tree holds, and the prompt's length: a
        key's namespace marker (`keys.marker_len`) is not part of the match. Two namespaces'
        markers may share their first characters, never a prompt."""
        if not key:
            return {}, 0
        skip = marker_len(key)
        held = self._tree(key).match(key)
        return {w: n - skip for w, n in held.items() if n > skip}, len(key) - skip

    def _by_prefix(self, workers: Sequence[str], loads: dict[str, int], matched: dict[str, int], length: int) -> str:
        """The worker with the longest ``matched`` prefix when it covers
        ``cache_threshold`` of ``length``; else the one with the smallest tree."""
        best = max(workers, key=lambda w: (matched.get(w, 0), -loads.get(w, 0)))
        if matched.get(best, 0) >= self.config.cache_threshold * length and matched.get(best, 0) > 0:
            self.counts["prefix"] += 1
            return best
        self.counts["smallest_tree"] += 1
        return min(workers, key=lambda w: (self._size(w), loads.get(w, 0)))

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
        out: dict[str, Any] = {"decisions": dict(self.counts), "sources": dict(self.sources), "tree_sizes": sizes}
        if self.events is not None:
            out["kv_events"] = self.events.stats()
        return out


def make_policy(
    name: str, cache_aware: Optional[CacheAwareConfig] = None, events: Optional[KVEventIndex] = None
) -> Policy:
    """The policy ``name``; ``events``: the KV-event index cache_aware reads (None: its trees only)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    if name == "cache_aware":
        return CacheAware(cache_aware, events)
    raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICIES)})")
