"""Context keys of the draft index (draft_index.py, draft_own.py): a 60-bit
hash of a window of L tokens, L <= `MAX_CONTEXT`.

The key of the window ``seq[i-L:i]`` is a polynomial hash of its tokens
(the nearest token weighted 1), mixed with L so windows of different lengths
never share a key by construction. Two implementations give the same keys:
`window_keys` (numpy, every window of a run at once: what insertions use) and
`tail_keys` (pure Python, the windows ending at a sequence's end: what a
proposal asks for, token by token). A collision of two windows only merges
their counts: a draft is a guess the model verifies, never trusted output.
Keys stay below 2**60 so that CPython stores each in 32 bytes.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

MAX_CONTEXT = 16
_M64 = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15
_MIX = 0xBF58476D1CE4E5B9
_POW = [pow(_BASE, j, 1 << 64) for j in range(MAX_CONTEXT)]
_SALT = [((L + 1) * 0x94D049BB133111EB) & _M64 for L in range(MAX_CONTEXT + 1)]
_NP_POW = [np.uint64(p) for p in _POW]
_NP_SALT = [np.uint64(s) for s in _SALT]
_NP_MIX = np.uint64(_MIX)
_NP_4 = np.uint64(4)


def tail_keys(tail: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """Keys of the windows ``tail[-L:]`` for the ascending `lengths` that
    `tail` covers (the list stops at the first L longer than `tail`)."""
    out: list[int] = []
    h = j = 0
    n = len(tail)
    for L in lengths:
        if L > n:
            break
        while j < L:
            h = (h + (tail[n - 1 - j] + 1) * _POW[j]) & _M64
            j += 1
        out.append((((h ^ _SALT[L]) * _MIX) & _M64) >> 4)
    return out


def window_keys(seq: Sequence[int], start: int, lengths: Sequence[int]) -> Iterator[tuple[int, int, np.ndarray]]:
    """For each L of the ascending `lengths`: ``(L, i0, keys)`` where ``keys[k]``
    is the key of the window ``seq[i-L:i]`` for ``i = i0 + k``, over every
    ``i`` in ``[max(start, L), len(seq))`` (none when that range is empty).
    O(len(seq) - start) per length: only the windows' tokens are read."""
    if start >= len(seq) or not lengths:
        return
    top = lengths[-1]
    base = max(0, start - top)  # the windows need nothing before seq[base]
    seq = seq[base:]
    start -= base
    n = len(seq)
    padded = np.zeros(top + n, dtype=np.uint64)
    padded[top:] = np.asarray(seq, dtype=np.uint64) + np.uint64(1)
    h = np.zeros(n - start, dtype=np.uint64)
    j = 0
    with np.errstate(over="ignore"):
        for L in lengths:
            while j < L:
                h += padded[top + start - 1 - j : top + n - 1 - j] * _NP_POW[j]
                j += 1
            i0 = max(start, L)
            if i0 < n:
                yield L, base + i0, ((h[i0 - start :] ^ _NP_SALT[L]) * _NP_MIX) >> _NP_4
