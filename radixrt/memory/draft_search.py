"""Drafting: the search behind `DraftIndex.propose` (draft_index.py).

Each drafted token's children are the next tokens two sources suggest for
the sequence so far (the request's tokens, then the draft path):

- the request's own copy (`OwnTokens.match`): the token that followed the
  last place the sequence's end occurred before, trusted by the length m of
  that match: ``m / (m + 4)`` (a 4-token match 0.5, 12 tokens 0.75);
- the namespace's counts: at the longest context length L with an entry,
  each continuation seen c times out of a total T gets
  ``(c / T) * c L' / (c L' + 4)``: its share, times a trust that grows with
  the evidence (one sighting after 8 tokens 0.67, after 2 tokens 0.33).
  ``L' = L``, except at the longest length, where L' adds the run of tokens
  before (real, then drafted) that the longest contexts predicted too: a
  long stretch the tree holds is trusted like a long own match. A context
  with more than `MAX_FANOUT` distinct continuations is too ambiguous to
  draft from (and shorter ones more so): no tree suggestion.

Where both suggest the same token its probability is ``1 - (1 - p1)(1 - p2)``;
siblings exclude each other, so a less likely child gets at most the
probability its likelier siblings leave (they are not normalized otherwise).
A draft token's probability is the product along its path; the search is
best first (a heap on that product), keeps at most `max_width` children per
token and stops at `max_tokens` tokens or when the best open candidate falls
below `min_prob`. So a long match or a continuation seen often gives a long
draft, a weak one a short or empty draft; with ``max_width == 1`` the result
is a chain (`chain` builds it without the heap: what most steps ask for).
Cost per drafted token: len(lengths) hashes of at most `max(lengths)` tokens
and as many dict look-ups: nothing grows with the tree.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Optional

from radixrt.memory.draft_keys import tail_keys
from radixrt.memory.draft_own import OwnTokens

MAX_FANOUT = 16
OWN_TRUST = 4.0  # an own match of m tokens: m / (m + OWN_TRUST)
TREE_TRUST = 4.0  # c sightings after L tokens: c L / (c L + TREE_TRUST), times the share
_M32 = (1 << 32) - 1


@dataclass
class Draft:
    """A draft tree in topological order (a parent before its children, the
    more likely sibling first); a chain when ``parents == [-1, 0, 1, ...]``.

    tokens: the drafted token ids.
    parents: index in `tokens` of each token's parent, -1 for a child of the
        request's last real token.
    probs: the estimated probability that the token and all its ancestors are
        accepted (a guide for sizing, not the model's probability).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def chain(self) -> list[int]:
        """The most likely root-to-leaf path (the first child at each level)."""
        out: list[int] = []
        want = -1
        for i, parent in enumerate(self.parents):
            if parent == want:
                out.append(self.tokens[i])
                want = i
        return out


_Copy = Optional[tuple[int, int]]
_second = itemgetter(1)
_RUN_LOOKBACK = 64  # real tokens a run is traced back at most


def search(
    lengths: tuple[int, ...],
    counts: Optional[dict[int, Any]],
    own: OwnTokens,
    max_tokens: int,
    max_width: int,
    min_prob: float,
    max_depth: Optional[int] = None,
) -> Draft:
    """The best-first draft (module docstring). `counts`: the namespace's
    table (None when it holds nothing); no path longer than `max_depth`."""
    draft = Draft()
    if max_tokens <= 0 or max_width <= 0:
        return draft
    base = own.tokens
    ctx = tuple(base[len(base) - lengths[-1] :] if len(base) > lengths[-1] else base)
    heap: list[tuple[float, int, int, int, tuple[int, ...], _Copy, int]] = []
    order = 0
    path: tuple[int, ...] = ()
    parent, prob, copy = -1, 1.0, own.match()
    run = _tree_run(own, counts, lengths[-1]) if counts is not None else 0
    depth_cap = max_tokens if max_depth is None else max_depth
    while True:
        kids = _children(lengths, counts, base, ctx, path, copy, run, max_width) if len(path) < depth_cap else []
        for p, tok, child_copy, child_run in kids:
            cum = prob * p
            if cum < min_prob:
                break
            heapq.heappush(heap, (-cum, order, parent, tok, path, child_copy, child_run))
            order += 1
        if not heap:
            break
        negcum, _, parent, tok, path, copy, run = heapq.heappop(heap)
        prob = -negcum
        parent_of = parent
        parent = len(draft.tokens)
        draft.tokens.append(tok)
        draft.parents.append(parent_of)
        draft.probs.append(prob)
        if len(draft.tokens) >= max_tokens:
            break
        path = (*path, tok)
    return draft


def chain(
    lengths: tuple[int, ...], counts: Optional[dict[int, Any]], own: OwnTokens, max_tokens: int, min_prob: float
) -> Draft:
    """`search` with ``max_width == 1``, the same draft without the heap (the
    per-token cost of every step's proposals)."""
    base = own.tokens
    n, top, last = len(base), lengths[-1], len(lengths) - 1
    tail = base[n - top :] if n > top else list(base)
    copy = own.match()
    run = _tree_run(own, counts, top) if counts is not None else 0
    toks: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while len(toks) < max_tokens:
        tree_tok, p, top_hit = -1, 0.0, False
        if counts is not None:
            t = tuple(tail)
            m = len(t)
            for i in range(last, -1, -1):
                L = lengths[i]
                v = counts.get(hash(t[m - L :])) if L <= m else None
                if v is None:
                    continue
                if i == last:
                    top_hit = True
                    L += run
                if v.__class__ is int:
                    c = v & _M32
                    tree_tok, p = v >> 32, c * L / (c * L + TREE_TRUST)
                elif len(v) <= MAX_FANOUT:
                    tree_tok, c = max(v.items(), key=_second)
                    p = c / sum(v.values()) * c * L / (c * L + TREE_TRUST)
                break
        tok = tree_tok
        if copy is not None:
            q, k = copy
            own_tok = base[q] if q < n else toks[q - n]
            p_own = k / (k + OWN_TRUST)
            if own_tok == tree_tok:
                p = 1.0 - (1.0 - p_own) * (1.0 - p)
            elif p_own > p:
                tok, p = own_tok, p_own
            copy = (q + 1, k + 1) if tok == own_tok else None
        if tok < 0 or prob * p < min_prob:
            break
        prob *= p
        run = run + 1 if top_hit and tok == tree_tok else 0
        toks.append(tok)
        probs.append(prob)
        tail.append(tok)
        if len(tail) > top:
            del tail[0]
    return Draft(toks, list(range(-1, len(toks) - 1)), probs)


def _children(
    lengths: tuple[int, ...],
    counts: Optional[dict[int, Any]],
    base: list[int],
    ctx: tuple[int, ...],
    path: tuple[int, ...],
    copy: _Copy,
    run: int,
    width: int,
) -> list[tuple[float, int, _Copy, int]]:
    """``(probability, token, its copy state, its run)`` of the likeliest
    `width` next tokens after ``base + path`` (`ctx`: the end of `base`), most
    likely first."""
    cands: dict[int, float] = {}
    runs = False  # the suggestions come from the longest context length
    if counts is not None:
        keys = tail_keys(ctx + path[-lengths[-1] :] if path else ctx, lengths)
        for i in range(len(keys) - 1, -1, -1):
            v = counts.get(keys[i])
            if v is None:
                continue
            L: float = lengths[i]
            if i == len(lengths) - 1:
                runs = True
                L += run
            if v.__class__ is int:
                c = v & _M32
                cands[v >> 32] = c * L / (c * L + TREE_TRUST)
            elif len(v) <= MAX_FANOUT:
                total = sum(v.values())
                for tok, c in sorted(v.items(), key=_second, reverse=True)[:width]:
                    cands[tok] = c / total * c * L / (c * L + TREE_TRUST)
            break
    tree_toks = tuple(cands) if runs else ()
    own_tok = -1
    if copy is not None:
        p, m = copy
        n = len(base)
        own_tok = base[p] if p < n else path[p - n]
        p_own = m / (m + OWN_TRUST)
        cands[own_tok] = 1.0 - (1.0 - p_own) * (1.0 - cands[own_tok]) if own_tok in cands else p_own
    best = sorted(cands.items(), key=_second, reverse=True)[:width] if len(cands) > 1 else cands.items()
    out: list[tuple[float, int, _Copy, int]] = []
    left = 1.0  # siblings exclude each other: a less likely one gets at most what the likelier left
    for tok, prob in best:
        prob = min(prob, left)
        if prob <= 0.0:
            break
        left -= prob
        tree_run = run + 1 if runs and tok in tree_toks else 0
        out.append((prob, tok, (copy[0] + 1, copy[1] + 1) if tok == own_tok and copy else None, tree_run))
    return out


def _tree_run(own: OwnTokens, counts: dict[int, Any], top: int) -> int:
    """How many of the request's last real tokens (up to `_RUN_LOOKBACK`) in a
    row followed a `top`-token context the namespace counts them after.
    Incremental: the tokens checked at the previous call are not checked again."""
    seq = own.tokens
    n = len(seq)
    run, upto = own.tree_run
    if upto > n or n - upto > _RUN_LOOKBACK:
        run, upto = 0, max(0, n - _RUN_LOOKBACK)
    for i in range(max(upto, top), n):
        v = counts.get(hash(tuple(seq[i - top : i])))
        hit = v is not None and (v >> 32 == seq[i] if v.__class__ is int else seq[i] in v)
        run = run + 1 if hit else 0
    own.tree_run = (run, n)
    return run
