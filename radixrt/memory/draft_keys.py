"""Context keys of the draft index (draft_index.py, draft_own.py): the key of
a window of L tokens (L <= `MAX_CONTEXT`) is ``hash(tuple(window))``.

CPython hashes a tuple of ints with a fixed xxHash-style loop (no per-process
salt for ints; the same since Python 3.8), in C: the cheapest key a proposal
can compute token by token (`tail_keys`). Insertions hash every window of a
run at once with numpy (`window_keys`), which replays the same loop; the
tests check that the two agree. The length is part of the hash, so windows
of different lengths do not share keys by construction; any other collision
only merges two contexts' counts: a draft is a guess the model verifies,
never trusted output.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

MAX_CONTEXT = 16
# CPython's tuplehash (Objects/tupleobject.c) on 64-bit builds.
_XXPRIME_1 = np.uint64(11400714785074694791)
_XXPRIME_2 = np.uint64(14029467366897019727)
_XXPRIME_5 = 2870177450012600261
_R31, _R33 = np.uint64(31), np.uint64(33)


def tail_keys(tail: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """Keys of the windows ``tail[-L:]`` for the ascending `lengths` that
    `tail` covers (the list stops at the first L longer than `tail`)."""
    t = tuple(tail)
    n = len(t)
    return [hash(t[n - L :]) for L in lengths if L <= n]


def window_keys(seq: Sequence[int], start: int, lengths: Sequence[int]) -> Iterator[tuple[int, int, np.ndarray]]:
    """For each L of the ascending `lengths`: ``(L, i0, keys)`` where ``keys[k]``
    is the key of the window ``seq[i-L:i]`` for ``i = i0 + k``, over every
    ``i`` in ``[max(start, L), len(seq))`` (none when that range is empty).
    O(len(seq) - start) per length: only the windows' tokens are read."""
    if start >= len(seq) or not lengths:
        return
    base = max(0, start - lengths[-1])  # the windows need nothing before seq[base]
    a = np.asarray(seq[base:], dtype=np.uint64)
    start -= base
    n = len(a)
    with np.errstate(over="ignore"):
        for L in lengths:
            i0 = max(start, L)
            if i0 >= n:
                return
            acc = np.full(n - i0, _XXPRIME_5, dtype=np.uint64)
            for j in range(L):  # the window of i is a[i-L:i], oldest token first
                acc += a[i0 - L + j : n - L + j] * _XXPRIME_2
                acc = (acc << _R31) | (acc >> _R33)
                acc *= _XXPRIME_1
            acc += np.uint64(L ^ (_XXPRIME_5 ^ 3527539))
            keys = acc.view(np.int64)
            yield L, base + i0, np.where(keys == -1, 1546275796, keys)
