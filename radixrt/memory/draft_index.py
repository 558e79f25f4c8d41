"""`DraftIndex`: speculative drafts from the token runs the radix tree holds,
per namespace, plus the request's own tokens (`OwnTokens`, draft_own.py).

What it holds
=============
For each namespace (the tree's sub-roots: ``cache_salt`` /
``prompt_cache_key``), a multiset of (context -> next token) counts over every
token position the tree holds, for each context length L in `lengths`
(default `TREE_LENGTHS`): a position whose path has at least L tokens before
it adds one to ``count[namespace][key(those L tokens)][its token]``
(draft_keys.py). The tree tells the index of every node that enters or leaves
it (radix_observer.py): insertion adds counts, removal subtracts them (an
entry whose count reaches 0 is deleted). A split moves no token, so the index
is exactly a function of what the tree holds, whatever the history:
`check_integrity` recounts it from a walk of the tree. Namespaces never mix:
a proposal reads its own namespace's table and the request's own tokens only.

Bounds: entries <= tokens held x len(lengths); each entry is an int key (the
window's hash) and a packed int value (token << 32 | count) while its context
has one continuation, a small dict of counts once it has several: about 110
bytes per entry, so at most about 110 x len(lengths) bytes per token held
(shared contexts cost less; `stats` reports the estimate). Insertion and
removal cost O(len(lengths)) dict operations per token (keys hashed with
numpy per run).

Proposals (draft_search.py) cost O(len(lengths)) dict look-ups per drafted
token, whatever the tree's size.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Hashable, Optional, Sequence

from radixrt.memory.draft_keys import MAX_CONTEXT, tail_keys, window_keys
from radixrt.memory.draft_own import OwnTokens
from radixrt.memory.draft_search import Draft, chain, search
from radixrt.memory.radix_observer import tree_runs

if TYPE_CHECKING:
    from radixrt.memory.prefix_cache import PrefixCache

__all__ = ["Draft", "DraftIndex", "OwnTokens", "TREE_LENGTHS"]

# 2 catches short structure (a closing quote, a bracket), 8 tells a copied
# stretch from a coincidence; lengths 3 and 5 as well drafted no better in a
# replay of source-code history and cost a third more memory and time.
TREE_LENGTHS = (2, 4, 8)
_M32 = (1 << 32) - 1
_NUMPY_FROM = 32  # runs this long hash their windows with numpy


class _Table:
    """One namespace's counts: key -> packed (token << 32 | count), or
    {token: count} once the context has several continuations."""

    __slots__ = ("counts", "tokens", "multi")

    def __init__(self) -> None:
        self.counts: dict[int, Any] = {}
        self.tokens = 0  # token positions indexed
        self.multi = 0  # entries holding a dict

    def add(self, keys: Sequence[int], nexts: Sequence[int]) -> None:
        counts = self.counts
        get = counts.get
        for key, tok in zip(keys, nexts):
            v = get(key)
            if v is None:
                counts[key] = (tok << 32) | 1
            elif v.__class__ is int:
                if v >> 32 == tok:
                    counts[key] = v + 1
                else:
                    counts[key] = {v >> 32: v & _M32, tok: 1}
                    self.multi += 1
            else:
                v[tok] = v.get(tok, 0) + 1

    def remove(self, keys: Sequence[int], nexts: Sequence[int]) -> None:
        counts = self.counts
        for key, tok in zip(keys, nexts):
            v = counts[key]
            if v.__class__ is int:
                assert v >> 32 == tok, "draft index: removing a continuation it never counted"
                if v & _M32 == 1:
                    del counts[key]
                else:
                    counts[key] = v - 1
                continue
            c = v[tok]
            if c > 1:
                v[tok] = c - 1
                continue
            del v[tok]
            if len(v) == 1:
                ((t, c),) = v.items()
                counts[key] = (t << 32) | c
                self.multi -= 1

    def approx_bytes(self) -> int:
        return sys.getsizeof(self.counts) + 68 * len(self.counts) + 240 * self.multi


class DraftIndex:
    """Counts of (context -> next token) over the tree's tokens, per namespace;
    attach with ``cache.add_observer(index)``; draft with `propose`."""

    def __init__(self, lengths: Sequence[int] = TREE_LENGTHS) -> None:
        self.lengths = tuple(sorted(set(lengths)))
        if not self.lengths or self.lengths[0] < 1 or self.lengths[-1] > MAX_CONTEXT:
            raise ValueError(f"draft context lengths must lie in [1, {MAX_CONTEXT}], got {lengths}")
        self.context_len = self.lengths[-1]
        self._tables: dict[Hashable, _Table] = {}

    # ------------------------------------------------------- tree observer
    def on_insert(self, namespace: Hashable, context: Sequence[int], tokens: Sequence[int]) -> None:
        table = self._tables.get(namespace)
        if table is None:
            table = self._tables[namespace] = _Table()
        for keys, nexts in self._windows(context, tokens):
            table.add(keys, nexts)
        table.tokens += len(tokens)

    def on_remove(self, namespace: Hashable, context: Sequence[int], tokens: Sequence[int]) -> None:
        table = self._tables[namespace]
        for keys, nexts in self._windows(context, tokens):
            table.remove(keys, nexts)
        table.tokens -= len(tokens)
        if not table.tokens:
            assert not table.counts, "draft index: counts left in a namespace with no token"
            del self._tables[namespace]

    def on_reset(self) -> None:
        self._tables = {}

    def _windows(self, context: Sequence[int], tokens: Sequence[int]) -> list[tuple[Sequence[int], Sequence[int]]]:
        """``(keys, next tokens)`` of every window of the run ``tokens`` (with
        up to `context_len` tokens of `context` before it)."""
        seq = [*context[max(0, len(context) - self.context_len) :], *tokens]
        start = len(seq) - len(tokens)
        if len(tokens) >= _NUMPY_FROM:
            return [(keys.tolist(), seq[i0:]) for _, i0, keys in window_keys(seq, start, self.lengths)]
        top, lengths = self.context_len, self.lengths
        out: list[tuple[Sequence[int], Sequence[int]]] = []
        for i in range(start, len(seq)):
            keys = tail_keys(seq[max(0, i - top) : i], lengths)
            out.append((keys, [seq[i]] * len(keys)))
        return out

    # ----------------------------------------------------------- proposals
    def propose(
        self,
        namespace: Hashable,
        own: OwnTokens,
        max_tokens: int,
        max_width: int = 1,
        min_prob: float = 0.2,
        max_depth: Optional[int] = None,
    ) -> Draft:
        """A draft of at most `max_tokens` tokens continuing ``own.tokens`` from
        `namespace`'s counts and the request's own earlier tokens, at most
        `max_width` children per token and no path longer than `max_depth`,
        every token's estimated path probability at least `min_prob`
        (draft_search.py)."""
        table = self._tables.get(namespace)
        counts = table.counts if table is not None else None
        if max_width == 1 and max_tokens > 0:
            return chain(self.lengths, counts, own, min(max_tokens, max_depth or max_tokens), min_prob)
        return search(self.lengths, counts, own, max_tokens, max_width, min_prob, max_depth)

    # -------------------------------------------------------- checks, sizes
    def check_integrity(self, cache: PrefixCache) -> None:
        """Assert the index holds exactly the counts of what `cache`'s tree
        holds now (recounted from a walk of the tree; O(tree size))."""
        fresh = DraftIndex(self.lengths)
        for namespace, context, key in tree_runs(cache.root, self.context_len):
            fresh.on_insert(namespace, context, key)
        assert self._tables.keys() == fresh._tables.keys(), (
            f"draft index namespaces {sorted(map(repr, self._tables))} != tree's {sorted(map(repr, fresh._tables))}"
        )
        for namespace, table in self._tables.items():
            want = fresh._tables[namespace]
            assert table.tokens == want.tokens, (
                f"namespace {namespace!r}: {table.tokens} tokens indexed, tree holds {want.tokens}"
            )
            if table.counts != want.counts:
                diff = table.counts.keys() ^ want.counts.keys()
                wrong = sum(1 for k in table.counts.keys() & want.counts.keys() if table.counts[k] != want.counts[k])
                raise AssertionError(f"namespace {namespace!r}: {len(diff)} entries extra or missing, {wrong} wrong")
            assert table.multi == want.multi, f"namespace {namespace!r}: multi counter {table.multi} != {want.multi}"

    def stats(self) -> dict[str, Any]:
        """Entries, tokens indexed and an estimate of the bytes held."""
        tables = self._tables.values()
        entries = sum(len(t.counts) for t in tables)
        tokens = sum(t.tokens for t in tables)
        nbytes = sum(t.approx_bytes() for t in tables)
        return {
            "namespaces": len(self._tables),
            "entries": entries,
            "tokens_indexed": tokens,
            "approx_bytes": nbytes,
            "bytes_per_token": round(nbytes / tokens, 1) if tokens else 0.0,
            "context_lengths": list(self.lengths),
        }

    def entries(self, namespace: Hashable) -> int:
        table = self._tables.get(namespace)
        return len(table.counts) if table is not None else 0
