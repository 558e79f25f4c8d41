"""A bounded snapshot of the radix tree, for the debug view (``GET /debug/radix``, ``/dashboard``).

`radix_snapshot` walks the tree breadth first and returns plain data: at
most ``max_nodes`` nodes down to ``max_depth`` edges below their namespace,
each with its token count, where its KV lives, its lock references, hits and
last access. A node whose children are not listed (the depth or node limit
cut them off) carries the size of what it hides (``hidden_nodes``,
``hidden_tokens``), so that a screen shows a big subtree as one box with its
size; so does each namespace. Counting hidden nodes stops after
``count_budget`` nodes in all (half for the namespaces, half for the listed
nodes): past it the sizes are lower bounds (``"exact": false``, and never
below the children a node is known to have). At most ``max_nodes``
namespaces are listed (``namespaces_total`` says how many there are), so a
snapshot costs O(max_nodes + count_budget) whatever the tree's size.

Namespaces (a request's ``cache_salt``) are never named: the default one is
``"default"``, another is ``"ns-"`` and 8 hex digits of a hash of its salt
keyed by a secret of the process (stable while the server runs). Token ids are included only when asked
(``tokens_per_node`` > 0: the first ones of each node), for the caller to
decode or not: this module knows no text.

Torch-free; it only reads the tree (the scheduler thread calls it between
steps, so the tree does not change under it).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter, deque
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Optional

if TYPE_CHECKING:
    from radixrt.memory.radix_node import TreeNode

DEFAULT_COUNT_BUDGET = 2_000  # hidden nodes counted per snapshot, at most (about 1 ms of the scheduler's time)


_LABEL_KEY = os.urandom(16)  # this process's: a label cannot be tested against guessed salts elsewhere


def namespace_label(namespace: Hashable) -> str:
    """How a namespace is shown: never its salt, nor a plain hash of it (a viewer could hash guessed
    salts, user or tenant names, and match them): a hash keyed by a secret of this process."""
    if namespace is None:
        return "default"
    return "ns-" + hashlib.blake2b(str(namespace).encode(), key=_LABEL_KEY, digest_size=4).hexdigest()


def _where(node: "TreeNode", stored: Optional[Callable[["TreeNode"], bool]] = None) -> str:
    """``device``, ``host``, ``device+host`` (``none`` for a node being moved), and
    ``+storage`` when ``stored`` says the node's blocks are in the storage tier."""
    on_host = node.host_value is not None
    if node.value:
        where = "device+host" if on_host else "device"
    else:
        where = "host" if on_host else "none"
    if stored is not None and stored(node):
        where = "storage" if where == "none" else where + "+storage"
    return where


class _Counter:
    """Sizes of subtrees, counted within a budget of nodes shared by all calls."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.exact = True

    def below(self, nodes: Iterable["TreeNode"], at_least: int = 0) -> tuple[int, int]:
        """Nodes and tokens in ``nodes`` and everything under them (lower bounds
        once the budget is spent, the count never below ``at_least``). ``nodes``
        is consumed lazily: nothing of it is looked at once the budget is spent."""
        count = tokens = 0
        for top in nodes:
            stack = [top]
            while stack:
                if self.budget <= 0:  # something is left uncounted
                    self.exact = False
                    return max(count, at_least), tokens
                x = stack.pop()
                self.budget -= 1
                count += 1
                tokens += len(x.key)
                if x.children:
                    stack.extend(x.children.values())
        return max(count, at_least), tokens


def radix_snapshot(
    root: "TreeNode",
    max_depth: int = 8,
    max_nodes: int = 500,
    tokens_per_node: int = 0,
    namespaces: Optional[set[Hashable]] = None,
    count_budget: int = DEFAULT_COUNT_BUDGET,
    stored: Optional[Callable[["TreeNode"], bool]] = None,
) -> dict[str, Any]:
    """The tree under ``root`` (whose children are the namespaces' sub-roots) as
    ``{"namespaces": [...], "nodes": [...], "truncated", "exact", "took_ms"}``.
    ``namespaces``: only these (None: all). ``stored``: whether a node's KV is
    also in the storage tier (radixrt/scheduler/storage_tier.py), asked of
    listed nodes only."""
    started = time.perf_counter()
    space_counter = _Counter(count_budget // 2)  # the namespaces' sizes, then the listed nodes' hidden ones
    counter = _Counter(count_budget - count_budget // 2)
    nodes: list[dict[str, Any]] = []
    listed: list["TreeNode"] = []  # the node of each entry
    spaces, subs = [], []
    queue: deque[tuple["TreeNode", int, int, str]] = deque()
    chosen = ((ns, sub) for ns, sub in root.children.items() if namespaces is None or ns in namespaces)
    for namespace, sub in islice(chosen, max_nodes):  # as many namespaces as nodes, at most
        label = namespace_label(namespace)
        spaces.append({"namespace": label, "root": sub.id, "children": len(sub.children)})
        subs.append(sub)
        # never more queued than can be listed: a namespace of 100,000 first-level nodes costs max_nodes
        queue.extend((child, 1, sub.id, label) for child in islice(sub.children.values(), max_nodes - len(queue)))
    while queue and len(nodes) < max_nodes:
        node, depth, parent, label = queue.popleft()
        entry: dict[str, Any] = {
            "id": node.id,
            "parent": parent,
            "namespace": label,
            "depth": depth,
            "tokens": len(node.key),
            "where": _where(node, stored),
            "lock_ref": node.lock_ref,
            "hits": node.hits,
            "last_access": node.last_access,
            "children": len(node.children),
        }
        if tokens_per_node:
            entry["token_ids"] = list(node.key[:tokens_per_node])
        nodes.append(entry)
        listed.append(node)
        if depth < max_depth and len(nodes) + len(queue) < max_nodes:  # never more queued than can be listed
            queue.extend((c, depth + 1, node.id, label) for c in node.children.values())
    shown = {x.id for x in listed}
    listed_children = Counter(entry["parent"] for entry in nodes)
    truncated = False
    for entry, node in zip(nodes, listed):  # what the limits cut off below each listed node
        cut = len(node.children) - listed_children[node.id]
        if cut:  # a node with thousands of children is not walked once the budget is spent
            hidden = (c for c in node.children.values() if c.id not in shown)
            entry["hidden_nodes"], entry["hidden_tokens"] = counter.below(hidden, at_least=cut)
            truncated = True
    for space, sub in zip(spaces, subs):
        space["nodes"], space["tokens"] = space_counter.below(sub.children.values(), at_least=len(sub.children))
    total_spaces = len(root.children) if namespaces is None else len(namespaces & root.children.keys())
    return {
        "namespaces": spaces,
        "namespaces_total": total_spaces,
        "nodes": nodes,
        "truncated": truncated or len(spaces) < total_spaces,
        "exact": counter.exact and space_counter.exact,
        "took_ms": 1000 * (time.perf_counter() - started),
    }
