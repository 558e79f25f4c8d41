"""Tree attention for verifying a speculative draft tree in one forward.

A request's new tokens may form a *tree* instead of a chain: ``parents[j]``
is the index (among the request's ``q_len`` new tokens) of new token ``j``'s
parent, or -1 when its parent is the last token before the new ones (the end
of the cached prefix); every parent comes before its children
(``parents[j] < j``). New token ``j`` then

- attends to the whole prefix (the first ``kv_len - q_len`` slots of its
  sequence), its ancestors among the new tokens and itself: nothing else;
- sits at position ``kv_len - q_len + depth(j)`` for RoPE (``depth`` 0 for a
  child of the prefix's end);
- still writes its K/V at sequence index ``kv_len - q_len + j`` (its slot in
  the request's slot list), like any new token.

A chain ``[-1, 0, 1, ...]`` is exactly the causal extend. `AttentionMetadata.tree`
holds one parent list (or None: causal) per request.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

Tree = Optional[Sequence[Optional[Sequence[int]]]]


def check_parents(parents: Sequence[int]) -> None:
    """ValueError unless every parent is -1 or an earlier index."""
    for j, p in enumerate(parents):
        if not -1 <= p < j:
            raise ValueError(f"tree token {j} has parent {p}: a parent must be -1 or an earlier token")


def depths(parents: Sequence[int]) -> list[int]:
    """Each new token's depth: 0 for a child of the prefix's end."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path(parents: Sequence[int], j: int) -> list[int]:
    """New-token indices from the tree's top down to ``j`` (inclusive): what ``j`` attends among the new tokens."""
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    out.reverse()
    return out


def ancestor_mask(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[q, q]`` bool: ``mask[j, i]`` when new token ``i`` is ``j`` or one of its ancestors."""
    q = len(parents)
    mask = torch.zeros(q, q, dtype=torch.bool)
    for j in range(q):
        mask[j, path(parents, j)] = True
    return mask.to(device)


def is_chain(parents: Optional[Sequence[int]]) -> bool:
    return parents is None or all(p == j - 1 for j, p in enumerate(parents))


def has_tree(tree: Tree) -> bool:
    """Whether some request of a batch's ``tree`` is not a plain causal chain."""
    return tree is not None and any(not is_chain(t) for t in tree)


def positions(q_lens: Sequence[int], kv_lens: Sequence[int], tree: Tree) -> list[int]:
    """The RoPE positions of a batch's new tokens (module docstring)."""
    out: list[int] = []
    for i, (q, k) in enumerate(zip(q_lens, kv_lens)):
        parents = tree[i] if tree is not None else None
        if parents is None:
            out.extend(range(k - q, k))
        else:
            assert len(parents) == q, f"request {i}: {len(parents)} tree parents for {q} new tokens"
            out.extend(k - q + d for d in depths(parents))
    return out


def flat_mask(q_lens: Sequence[int], kv_lens: Sequence[int], tree: Tree) -> torch.Tensor:
    """Every request's ``[q_len, kv_len]`` attention mask (True: attend), row-major
    and concatenated in batch order: the ``custom_mask`` FlashInfer's batch
    prefill takes. A request without a tree gets the bottom-right causal mask."""
    parts = []
    for i, (q, k) in enumerate(zip(q_lens, kv_lens)):
        mask = torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None]
        parents = tree[i] if tree is not None else None
        if parents is not None:
            mask[:, k - q :] = ancestor_mask(parents)
        parts.append(mask.flatten())
    return torch.cat(parts)
