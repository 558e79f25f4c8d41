"""KV budgets: which positions a request keeps, and where the others' KV goes.

A request under a budget of ``B`` tokens attends, in every layer and KV
head, at most ``B`` of its positions (``B + slack`` while it grows between
two compactions). Each head chooses its own (`choose_positions`), from the
attention mass each position received from that head's queries
(kernels/kv_scores.py):

- ``window`` (StreamingLLM): the first ``sinks`` positions (attention sinks)
  and the most recent ones; scores are not read, every head keeps the same.
- ``h2o`` (Heavy-Hitter Oracle): sinks, a recent window (``recent``
  positions), and the "heavy hitters", the positions with the highest
  accumulated attention; the rest are evicted for good.
- ``infinigen``: the same, and the whole KV of the request is also kept in
  host memory. Each step a sketch of every key estimates the mass every
  earlier position would get from the current queries (decayed, so recent
  attention weighs most); at a compaction each head keeps, or loads back from
  the host, its ``reload`` positions with the most estimated mass (and the
  few right after each, `kv_budget_ops.mark_wanted`), ahead of the heavy
  hitters: a position the current queries need again can come back. And
  within every step (InfiniGen's prefetch), each head of each layer also
  attends the ``fetch`` host positions the step's own queries estimate most
  wanted, read from the host for that layer's attention only: a question at
  the end of a long prompt reads the fact it asks about in the same step, in
  every layer, before any compaction could have known to keep it.

Only request-private slots are ever written or freed: a compaction copies
each head's kept K/V into the request's own slots (tree-owned ones are only
read) and gives the rest of its private slots back; the tree-owned slots it
stops listing stay the tree's (kv_manager.KVCacheManager.compact).

This module holds a budget's terms and imports no torch (the config reads
it); kv_budget_ops.py the choice and the copies (pool, host);
radixrt/scheduler/kv_budget.py applies them to running requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KV_BUDGET_POLICIES = ("h2o", "infinigen", "window")
MIN_KV_BUDGET = 32  # tokens: sinks, a recent window and a few heavy hitters
INFINIGEN_DECAY = 0.98  # per query row: a position's score halves over ~34 queries that ignore it
FETCH_FRACTION = 8  # infinigen: a step attends budget / 8 host positions per head besides its columns
SKETCH_FRACTION = 2  # a key's sketch: head_dim / 2 directions (with / 4, 1 of 4 needles found at 25%)


@dataclass(frozen=True)
class KVBudget:
    """One request's budget, resolved to tokens.

    ``tokens``: the most positions it attends after a compaction. ``sinks``:
    the first positions always kept. ``recent``: the latest positions always
    kept. ``slack``: how far the kept count may grow past ``tokens`` before the
    next compaction (decode compacts every ``slack`` tokens, not every step),
    which is also the longest prefill chunk: peak KV is ``tokens + slack``."""

    policy: str
    tokens: int
    sinks: int
    recent: int

    def __post_init__(self) -> None:
        if self.policy not in KV_BUDGET_POLICIES:
            raise ValueError(f"unknown kv_budget_policy {self.policy!r}; choose {', '.join(KV_BUDGET_POLICIES)}")
        if self.tokens < MIN_KV_BUDGET:
            raise ValueError(f"kv_budget must be at least {MIN_KV_BUDGET} tokens, got {self.tokens}")
        if self.sinks + self.recent > self.tokens:
            raise ValueError("the KV budget's sink and recent tokens exceed the budget")

    @property
    def slack(self) -> int:
        return max(16, self.tokens // 8)

    @property
    def reload(self) -> int:
        """infinigen: at each compaction, the positions per head with the most
        estimated mass for the current queries, kept or brought back."""
        return max(8, self.tokens // 16)

    @property
    def fetch(self) -> int:
        """infinigen: host positions each KV head of each layer attends in a step
        besides its columns, those the step's queries estimate most wanted
        (InfiniGen's prefetch; kernels/kv_scores.py)."""
        return max(8, self.tokens // FETCH_FRACTION) if self.policy == "infinigen" else 0

    @property
    def decay(self) -> float:
        """How the scoring pass ages scores, per query row (1.0: H2O's plain sum)."""
        return INFINIGEN_DECAY if self.policy == "infinigen" else 1.0


def resolve_budget(value: float, total_tokens: int) -> int:
    """A budget given as tokens (an int >= 1, or a float >= 1) or as a fraction
    of the request's context (a float in (0, 1): of ``total_tokens``, its prompt
    plus ``max_new_tokens``) -> tokens."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"kv_budget must be a positive number of tokens or a fraction in (0, 1), got {value!r}")
    if value < 1:
        return max(MIN_KV_BUDGET, math.ceil(value * total_tokens))
    return int(value)
