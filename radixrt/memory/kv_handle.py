"""`RequestKV`: the KV cache state one request holds, owned by `memory/`.

The scheduler's request (`scheduler.request.Req`) extends this class, so its
KV fields read as ``req.slots``, ``req.tree_len``... everywhere, while
`memory/` names only this class and imports nothing above it.

Ownership contract
==================
Only `KVCacheManager` (kv_manager.py) writes ``slots``, ``tree_len``,
``last_node`` and ``row``; everyone else reads them.

- ``slots[i]`` holds the KV of token ``seq[i]``. The first ``tree_len`` of
  them (whole pages) belong to the prefix cache and stay valid because the
  request holds a lock on ``last_node`` (the node they end at; None while the
  request holds nothing); ``slots[tree_len:]`` are private to the request.
- ``row`` is the request's row of the device request-to-slot table
  (req_to_token.py) while it holds slots, which mirrors ``slots`` column for
  column; None otherwise.
- ``namespace`` is the cache partition its KV is matched and cached in (a
  request's ``cache_salt``; None is the shared default).
- Under a KV budget (kv_budget.py) the slot list is short: once compacted,
  ``kv_dropped`` computed tokens have no column of their own, and column
  ``j`` holds, for each layer and KV head, the K/V of the position that head
  keeps there (all private slots, ``tree_len`` 0; the columns computed since
  hold ``seq``'s next tokens, as usual). Such a request never inserts into
  the tree (``insert_into_tree`` False).

A request that holds no KV has ``slots == []``, ``tree_len == 0``,
``kv_dropped == 0``, ``last_node is None`` and ``row is None``; `KVCacheManager.admit` starts
from that state and `KVCacheManager.release` returns to it.

What the KV is keyed by is the extending class's to define: ``seq`` (the
tokens ``slots`` hold KV for, in order), ``max_prefix_len`` (the longest
prefix a cache match may supply) and ``prompt_len`` (the prompt's tokens, for
the hit-rate counters). The fields are keyword-only, so the extending
dataclass keeps its own positional fields first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from radixrt.memory.radix_node import TreeNode


@dataclass(eq=False, kw_only=True)
class RequestKV:
    """The KV a request holds (see the module docstring for who may write what)."""

    namespace: Optional[str] = None
    slots: list[int] = field(default_factory=list)
    row: Optional[int] = None  # its row of the request-to-slot table while it holds slots
    tree_len: int = 0
    last_node: Optional[TreeNode] = None
    # Under a KV budget (radixrt/memory/kv_budget.py): how many more tokens it has computed than it has
    # columns (its first ``len(slots) + kv_dropped`` tokens are computed). 0: ``slots[i]`` holds ``seq[i]``'s.
    kv_dropped: int = 0
    # False: what the request computes never enters the prefix cache (a request under a KV budget, whose
    # KV is not its full prefix once compressed); it only reads what it matched at admission
    insert_into_tree: bool = True
    # None, or the most of ``seq`` the request may take from or give to the tree (an activated-LoRA
    # request: its KV from that point on is the adapter's, not what the namespace's keys promise)
    tree_limit: Optional[int] = None

    @property
    def seq(self) -> list[int]:
        """The tokens to hold KV for, in order (``slots[i]`` holds ``seq[i]``'s)."""
        raise NotImplementedError

    @property
    def max_prefix_len(self) -> int:
        """The longest prefix of ``seq`` a cache match may supply."""
        raise NotImplementedError

    @property
    def prompt_len(self) -> int:
        """The prompt's tokens (counted as queried in the cache's hit rate)."""
        raise NotImplementedError
