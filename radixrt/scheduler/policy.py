"""Orders the waiting queue. The cache-aware policies read the radix tree's
matches; none of them changes what is computed, only when.

Priority scheduling (``enable_priority_scheduling``) is a stable sort on
top of the policy's order: requests of a more urgent priority come first,
and within one priority the policy's order stands. As in SGLang, a higher
``priority`` value is more urgent unless ``schedule_low_priority_values_first``."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Optional

from radixrt.memory.radix_node import MatchResult, TreeNode
from radixrt.scheduler.request import Req

MatchFn = Callable[[Req], MatchResult]

# Past this many waiting requests, matching each one every step costs more than
# it saves: fall back to arrival order (as SGLang does).
LPM_MAX_QUEUE = 256


def order_waiting(policy: str, waiting: list[Req], match: MatchFn) -> list[Req]:
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: r.arrival)
    matches = {id(r): match(r) for r in waiting}
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-matches[id(r)].length, r.arrival))
    if policy == "dfs-weight":
        return _dfs_weight(waiting, matches)
    raise ValueError(f"unknown schedule policy {policy!r}")


def by_priority(ordered: list[Req], low_values_first: bool = False) -> list[Req]:
    """``ordered`` with the most urgent priority first; a stable sort, so the
    policy's order holds among requests of equal priority."""
    if low_values_first:
        return sorted(ordered, key=lambda r: r.priority)
    return sorted(ordered, key=lambda r: -r.priority)


def _dfs_weight(waiting: list[Req], matches: dict[int, MatchResult]) -> list[Req]:
    """Visit the tree depth-first, heavier subtrees (more waiting requests) first,
    so requests sharing a prefix run together while it is cached."""
    at_node: dict[Any, list[Req]] = defaultdict(list)
    weight: dict[Any, int] = defaultdict(int)
    children: dict[Any, set] = defaultdict(set)
    roots: list[Any] = []
    for r in waiting:
        node: Optional[TreeNode] = matches[id(r)].node
        at_node[node].append(r)
        while node is not None:
            weight[node] += 1
            parent = node.parent
            if parent is None:
                if node not in roots:
                    roots.append(node)
            else:
                children[parent].add(node)
            node = parent
    ordered: list[Req] = []
    stack = sorted(roots, key=lambda n: (weight[n], -n.id))
    while stack:
        node = stack.pop()
        ordered.extend(sorted(at_node.get(node, []), key=lambda r: r.arrival))
        stack.extend(sorted(children.get(node, ()), key=lambda n: (weight[n], -n.id)))
    return ordered
