"""Why a prompt did (not) hit the radix cache.

`explain_match` is called by the scheduler when a request that asked for it
(``return_cache_info``) is admitted for the first time, right after its
prefix was matched, so it explains the match that actually happened. It
never splits, touches, locks or counts anything, and costs nothing for
requests that did not ask. The result holds token ids only: the scheduler
never detokenizes; the front (`render_cache_info`, called where results are
built) adds the decoded text.

Two views. The cache is shared by the clients of one namespace, so what it
holds beyond a request's own match is other clients' text:

* ``own`` (``return_cache_info: true``, anyone): built from the request's own
  prompt and its match only, so it tells nothing a cache hit on the same
  text would not (``cached_tokens`` already says how much matched);
* ``full`` (``return_cache_info: "full"``, the operator: the server's admin
  key, or the in-process Engine): a read-only walk of the tree token by token
  (not page by page) from the request's namespace to the *closest cached
  neighbour*, the cached sequence sharing the longest prefix with the prompt,
  even where that prefix ends inside a node or inside a page.

Fields of the wire dict and of ``meta_info.cache_info``, both views:

* ``view``: ``"own"`` or ``"full"``;
* ``prompt_tokens``; ``matched_tokens``: prompt tokens served from the cache;
  ``stop_position``: where reuse stopped (= ``matched_tokens``);
* ``reason``: ``cache_disabled``; ``last_token_recomputed`` /
  ``prompt_logprobs`` (reuse reached the request's cap: at least one prompt
  token is always computed, for its logits, and positions whose logprobs are
  asked for are recomputed); otherwise, in the ``own`` view, ``not_cached``
  (no whole KV page of the prompt from ``stop_position`` on is cached in the
  request's namespace), and in the ``full`` view the finer ``diverged`` (the
  prompt differs from everything cached from there), ``no_cached_prefix``
  (nothing cached shares even the first token) or ``page_alignment`` (the
  neighbour goes on inside a KV page, which is reused only whole);
* ``prompt_before`` / ``prompt_after``: up to `CONTEXT_TOKENS` prompt token
  ids on each side of the stop position (``full``: of the divergence).

``tiers`` (added at admission): the matched tokens by where their KV was,
``{"device": n, "host": n, "storage": n}`` (`tier_hits`).

Only in the ``full`` view: ``neighbour_tokens`` (length of the common prefix
with the closest cached neighbour), ``divergence_position`` (None when the
neighbour holds the whole prompt), ``cached_after`` (the neighbour's tokens
after the divergence), and, for a request with a cache salt,
``namespace_differs`` / ``default_namespace_neighbour_tokens`` (whether the
shared namespace holds a longer prefix of the prompt, and how long).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Optional, Sequence

from radixrt.memory.radix_node import TreeNode, _first_mismatch

if TYPE_CHECKING:
    from radixrt.memory.prefix_cache import PrefixCache

CONTEXT_TOKENS = 8  # token ids shown on each side of the divergence

DIVERGED = "diverged"
NO_CACHED_PREFIX = "no_cached_prefix"
LAST_TOKEN = "last_token_recomputed"
PROMPT_LOGPROBS = "prompt_logprobs"
PAGE_ALIGNMENT = "page_alignment"
CACHE_DISABLED = "cache_disabled"
NOT_CACHED = "not_cached"


@dataclass
class Neighbour:
    """Where a key's walk down the tree stopped: ``depth`` tokens in common,
    ending ``offset`` tokens into ``node``'s key (``offset == len(node.key)``
    when it ends at the node's end, e.g. at a sub-root)."""

    depth: int
    node: TreeNode
    offset: int


@dataclass
class CacheExplanation:
    prompt_tokens: int
    matched_tokens: int
    neighbour_tokens: int
    divergence_position: Optional[int]
    reason: str
    prompt_before: list[int] = field(default_factory=list)
    prompt_after: list[int] = field(default_factory=list)
    cached_after: list[int] = field(default_factory=list)
    default_namespace_neighbour_tokens: Optional[int] = None  # only for a salted request

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "matched_tokens": self.matched_tokens,
            "neighbour_tokens": self.neighbour_tokens,
            "stop_position": self.matched_tokens,
            "divergence_position": self.divergence_position,
            "reason": self.reason,
            "prompt_before": self.prompt_before,
            "prompt_after": self.prompt_after,
            "cached_after": self.cached_after,
        }
        if self.default_namespace_neighbour_tokens is not None:
            d["namespace_differs"] = self.default_namespace_neighbour_tokens > self.neighbour_tokens
            d["default_namespace_neighbour_tokens"] = self.default_namespace_neighbour_tokens
        return d


def closest_neighbour(tree: "PrefixCache", key: Sequence[int], namespace: Hashable = None) -> Optional[Neighbour]:
    """The deepest point of ``namespace``'s tree that shares a prefix with
    ``key``, token by token (a partial page or a partial node counts); None
    when the namespace holds nothing. Read-only."""
    node = tree.root.children.get(namespace)
    if node is None:
        return None
    key = list(key)
    pos, n, P = 0, len(key), tree.page_size
    while pos < n:
        if P == 1:
            child = node.children.get(key[pos])
            candidates = [child] if child is not None else []
        else:
            child = node.children.get(tuple(key[pos : pos + P]))
            # no whole first page in common: some child may still share part of it
            candidates = [child] if child is not None else list(node.children.values())
        best, best_m = None, 0
        for c in candidates:
            m = _first_mismatch(c.key, key, pos, min(len(c.key), n - pos))
            if m > best_m:
                best, best_m = c, m
        if best is None:
            break
        pos += best_m
        if best_m < len(best.key):
            return Neighbour(pos, best, best_m)
        node = best
    return Neighbour(pos, node, len(node.key))


def _tokens_after(nb: Neighbour, k: int) -> list[int]:
    """Up to ``k`` cached tokens following the neighbour's common prefix: the
    rest of its node, then down the most recently used children."""
    out = list(nb.node.key[nb.offset : nb.offset + k])
    node = nb.node
    while len(out) < k and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out.extend(node.key[: k - len(out)])
    return out


def explain_match(
    tree: "PrefixCache",
    prompt: Sequence[int],
    namespace: Hashable,
    matched: int,
    max_prefix_len: int,
    full: bool = False,
) -> dict[str, Any]:
    """The wire dict explaining a match of ``matched`` tokens of ``prompt`` in
    ``namespace``, where at most ``max_prefix_len`` tokens could be reused (the
    request's cap). ``full``: the operator's view (see the module docstring);
    otherwise only the request's own text and match are used. Call it right
    after the match, before the tree changes."""
    if full:
        return {"view": "full", **explain_full(tree, prompt, namespace, matched, max_prefix_len).to_wire()}
    n = len(prompt)
    if not tree.stores_prefixes:
        reason = CACHE_DISABLED
    elif matched >= max_prefix_len:
        reason = LAST_TOKEN if max_prefix_len >= n - 1 else PROMPT_LOGPROBS
    else:
        reason = NOT_CACHED
    return {
        "view": "own",
        "prompt_tokens": n,
        "matched_tokens": matched,
        "stop_position": matched,
        "reason": reason,
        "prompt_before": list(prompt[max(0, matched - CONTEXT_TOKENS) : matched]),
        "prompt_after": list(prompt[matched : matched + CONTEXT_TOKENS]),
    }


def explain_full(
    tree: "PrefixCache", prompt: Sequence[int], namespace: Hashable, matched: int, max_prefix_len: int
) -> CacheExplanation:
    """The operator's view of a match (`explain_match` with ``full``)."""
    n = len(prompt)
    if not tree.stores_prefixes:
        return CacheExplanation(n, matched, 0, 0, CACHE_DISABLED, [], list(prompt[:CONTEXT_TOKENS]), [])
    nb = closest_neighbour(tree, prompt, namespace)
    depth = nb.depth if nb is not None else 0
    divergence = depth if depth < n else None
    if depth == 0:
        reason = NO_CACHED_PREFIX
    elif depth > max_prefix_len:
        reason = LAST_TOKEN if max_prefix_len >= n - 1 else PROMPT_LOGPROBS
    elif matched < depth:
        reason = PAGE_ALIGNMENT
    else:
        reason = DIVERGED
    split = depth if divergence is not None else matched
    exp = CacheExplanation(
        prompt_tokens=n,
        matched_tokens=matched,
        neighbour_tokens=depth,
        divergence_position=divergence,
        reason=reason,
        prompt_before=list(prompt[max(0, split - CONTEXT_TOKENS) : split]),
        prompt_after=list(prompt[split : split + CONTEXT_TOKENS]),
        cached_after=_tokens_after(nb, CONTEXT_TOKENS) if nb is not None and 0 < depth < n else [],
    )
    if namespace is not None:
        shared = closest_neighbour(tree, prompt, None)
        exp.default_namespace_neighbour_tokens = shared.depth if shared is not None else 0
    return exp


def tier_hits(matched: int, loaded: int, storage: int) -> dict[str, int]:
    """Where a request's ``matched`` tokens came from: already on the device,
    loaded back from the host tier, or read from the storage tier first."""
    return {"device": matched - loaded, "host": loaded - storage, "storage": storage}


def render_cache_info(wire: dict[str, Any], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """``wire`` (from `explain_match`) with the decoded text of its token
    lists added as ``<name>_text``."""
    out = dict(wire)
    for name in ("prompt_before", "prompt_after", "cached_after"):
        if name in wire:
            out[name + "_text"] = decode(list(wire[name] or []))
    return out
