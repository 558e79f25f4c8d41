"""Observers of the radix tree's tokens: what another structure (the draft
index, draft_index.py) needs to mirror exactly the token runs the tree holds.

A `RadixCache` tells each observer (`RadixCache.add_observer`):

- ``on_insert(namespace, context, tokens)`` when a node with ``tokens`` enters
  the tree (a new leaf of `insert`);
- ``on_remove(namespace, context, tokens)`` once for every node that leaves
  the tree (a dropped node and each node of its subtree, host-only ones
  included);
- ``on_reset()`` when the whole tree is emptied (`reset`).

``context`` is the last ``observer.context_len`` tokens (fewer near the
namespace's sub-root) on the tree path just before ``tokens``: the same list
at removal as at insertion, since a token's path never changes (a split only
cuts a run in two). Moving a node's KV between the device and the host tier
changes nothing an observer sees: the node keeps its tokens in the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Iterator, Protocol, Sequence

if TYPE_CHECKING:
    from radixrt.memory.radix_node import TreeNode


class TreeObserver(Protocol):
    context_len: int

    def on_insert(self, namespace: Hashable, context: Sequence[int], tokens: Sequence[int]) -> None: ...

    def on_remove(self, namespace: Hashable, context: Sequence[int], tokens: Sequence[int]) -> None: ...

    def on_reset(self) -> None: ...


def node_place(node: "TreeNode", sub_ns: dict[int, Hashable], n: int) -> tuple[Hashable, list[int]]:
    """The namespace of in-tree `node` and the last (up to) `n` tokens of the
    path above it. Walks up to the namespace's sub-root: O(depth)."""
    parts: list[list[int]] = []
    got = 0
    x = node.parent
    assert x is not None, "the node is in the tree"
    while x.key:
        if got < n:
            parts.append(x.key)
            got += len(x.key)
        x = x.parent
        assert x is not None, "a node's ancestors are in the tree"
    context = [t for part in reversed(parts) for t in part]
    return sub_ns[x.id], context[max(0, len(context) - n) :]


def subtree_runs(node: "TreeNode", context: list[int], n: int) -> Iterator[tuple[list[int], list[int]]]:
    """``(context, key)`` of `node` and of every node below it, each context
    the last (up to) `n` tokens of the path before that node."""
    stack = [(node, context)]
    while stack:
        x, ctx = stack.pop()
        yield ctx, x.key
        if x.children:
            below = (ctx + x.key)[-n:] if n else []
            stack.extend((c, below) for c in x.children.values())


def tree_runs(root: "TreeNode", n: int) -> Iterator[tuple[Hashable, list[int], list[int]]]:
    """``(namespace, context, key)`` of every node of the tree under `root`
    (its children are the namespaces' sub-roots, keyed by namespace)."""
    for namespace, sub in root.children.items():
        for child in sub.children.values():
            for context, key in subtree_runs(child, [], n):
                yield namespace, context, key
