"""`OwnTokens`: one request's own tokens (prompt and output so far), indexed
for prompt-lookup drafts (draft_index.py): the request copying from its own
prompt or earlier output (code edits, echoed tool arguments, repeated keys).

For every window of L tokens (L in `OWN_LENGTHS`) the index keeps the latest
position that followed it. `match` finds where the sequence's end occurred
before: the longest window length with an earlier occurrence, whose match
length is then counted token by token (so a hash collision is never taken
for a match). While the request keeps copying, each new token that equals
the copy's next one moves the copy on in O(1), so a long copy is found once.
When a copy breaks (an edit), the next token or two pick it up again at its
source (`_resync`): past a few skipped source tokens, or one replaced.

Memory: one dict entry per (position, length): about 100 bytes x
len(lengths) per token (`approx_bytes`).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from radixrt.memory.draft_keys import tail_keys, window_keys

OWN_LENGTHS = (2, 4, 8)
MATCH_CAP = 64  # a fresh match is counted back at most this far
RESYNC_SPAN = 6  # source positions past a broken copy searched for the token that broke it (`_resync`)
_NUMPY_FROM = 32  # extensions this long hash their windows with numpy


class OwnTokens:
    """One request's own tokens, indexed incrementally (`extend`: O(len(tokens)))."""

    __slots__ = ("tokens", "lengths", "_latest", "_copy", "_copy_len", "_lost", "tree_run")

    def __init__(self, tokens: Sequence[int], lengths: Sequence[int] = OWN_LENGTHS) -> None:
        self.lengths = tuple(sorted(lengths))
        self.tokens: list[int] = []
        self._latest: dict[int, int] = {}
        # The copy source at len(tokens) == _copy_len: (position of the token
        # that would come next, length of the match ending before it), or None.
        self._copy: Optional[tuple[int, int]] = None
        self._copy_len = -1
        # Where the last copy broke: (the position it expected to copy next, the length of the
        # sequence then), or None (see `_resync`).
        self._lost: Optional[tuple[int, int]] = None
        # (run, n): draft_search's count of the last tokens before position n
        # that the namespace's longest contexts predicted (its cache).
        self.tree_run = (0, 0)
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.tokens
        start = len(seq)
        copy = self._copy if self._copy_len == start else None
        seq.extend(tokens)
        n = len(seq)
        latest = self._latest
        if n - start >= _NUMPY_FROM:
            for _, i0, keys in window_keys(seq, start, self.lengths):
                latest.update(zip(keys.tolist(), range(i0, n)))
        else:
            top = self.lengths[-1]
            for i in range(start, n):
                for key in tail_keys(seq[max(0, i - top) : i], self.lengths):
                    latest[key] = i
        for i in range(start, n):
            if copy is None:
                break
            p, m = copy
            if seq[p] == seq[i]:
                copy = (p + 1, m + 1)
            else:  # (a copy that broke on its first token was a guess: nothing to pick up)
                copy, self._lost = None, (p, i) if m >= 2 else None
        self._copy, self._copy_len = (copy, n) if copy is not None else (None, -1)

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens (re-indexes them: O(n))."""
        if n >= len(self.tokens):
            return
        kept = self.tokens[:n]
        self.tokens = []
        self._latest = {}
        self._copy, self._copy_len, self._lost = None, -1, None
        self.tree_run = (0, 0)
        self.extend(kept)

    def match(self) -> Optional[tuple[int, int]]:
        """``(p, m)``: the sequence's last ``m`` tokens also end just before
        position ``p < len(self)`` (so ``tokens[p]`` is the copy's guess for the
        next token); None when no window of the end occurred before."""
        n = len(self.tokens)
        if self._copy_len == n:
            return self._copy
        seq = self.tokens
        found = None
        keys = tail_keys(seq[n - self.lengths[-1] :] if n > self.lengths[-1] else seq, self.lengths)
        for L, key in reversed(list(zip(self.lengths, keys))):
            p = self._latest.get(key)
            if p is None:
                continue
            m = 0
            cap = min(MATCH_CAP, p)
            while m < cap and seq[p - 1 - m] == seq[n - 1 - m]:
                m += 1
            if m >= L:
                found = (p, m)
                break
        if found is None:
            found = self._resync()
        self._copy, self._copy_len = found, n
        return found

    def _resync(self) -> Optional[tuple[int, int]]:
        """A copy that broke a token or two ago, picked up again at its source:
        when the sequence skipped a few of its tokens (an edit that drops a
        line break or a word), after the last token found within `RESYNC_SPAN`
        positions past where the copy broke; right after the break, one
        position on (a token replaced by another). As a match of one token
        (the window search needs two), so drafted with little confidence."""
        lost = self._lost
        n = len(self.tokens)
        if lost is None or n - lost[1] > 2:
            return None
        p, seq = lost[0], self.tokens
        last = seq[n - 1]
        for j in range(p + 1, min(p + RESYNC_SPAN, lost[1])):
            if seq[j] == last:
                return (j + 1, 1)
        if n - lost[1] == 1 and p + 1 < lost[1]:
            return (p + 1, 1)
        return None

    def approx_bytes(self) -> int:
        """Rough memory of the index and the token list."""
        return sys.getsizeof(self._latest) + 64 * len(self._latest) + sys.getsizeof(self.tokens) + 28 * len(self.tokens)
