"""One request's KV-budget state (radixrt/scheduler/kv_budget.py applies it).

Owned by the request (``Req.kv_budget``) and touched only on the scheduler's
thread, except the accumulators, which the forward of a step the request is
in adds to (kernels/kv_scores.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from radixrt.kernels.kv_scores import OffloadSketch, ScoreJob
from radixrt.memory.kv_budget import KVBudget
from radixrt.memory.kv_budget_ops import HostKV
from radixrt.memory.kv_pool import KVPool


@dataclass
class BudgetCounters:
    """What budgets did, in tokens (the server's totals, and one request's)."""

    compactions: int = 0
    # positions per head (a position one head of every layer dropped counts 1 / (layers x KV heads)):
    evicted: float = 0.0  # dropped for good (h2o, window), tree-owned ones included
    offloaded: float = 0.0  # left the pool with their KV kept on the host (infinigen)
    reloaded: float = 0.0  # brought back from the host

    def add(self, other: "BudgetCounters") -> None:
        self.compactions += other.compactions
        self.evicted += other.evicted
        self.offloaded += other.offloaded
        self.reloaded += other.reloaded


class RequestBudget:
    """One request's budget state, for one admission (a retraction resets it).

    Column ``j`` of the request's slot list holds, for layer ``l``'s KV head
    ``h``, position ``pos[l, h, j]`` for the ``m`` columns placed at the last
    compaction, and position ``base + (j - m)`` for those computed since (every
    head alike; ``base``: its computed tokens then). ``acc[l, h, j]`` is that
    head's score of that column. Under ``infinigen`` the request's whole KV is
    also in host memory (`HostKV`, every position up to ``base``), with a
    sketch of every key for the scoring pass's estimates."""

    def __init__(self, budget: KVBudget, pool: KVPool) -> None:
        self.budget = budget
        self.pool = pool
        self.counters = BudgetCounters()
        self.peak_kv = 0  # the most slots it attended in one step
        self._reset(retractions=0)

    def _reset(self, retractions: int) -> None:
        self.retractions = retractions
        pool, b = self.pool, self.budget
        L, H, dev = pool.num_layers, pool.num_kv_heads, pool.device
        self.acc = torch.zeros((L, H, b.tokens + 2 * b.slack), dtype=torch.float32, device=dev)
        self.pos = torch.zeros((L, H, 0), dtype=torch.int64, device=dev)
        self.base = 0
        self.host: Optional[HostKV] = HostKV(pool) if b.policy == "infinigen" else None
        self.axes: Optional[torch.Tensor] = None
        self.sketch = torch.zeros((L, H, 1, 0), dtype=torch.float32, device=dev)
        self.est = torch.zeros((L, H, 0), dtype=torch.float32, device=dev)

    def sync(self, retractions: int) -> None:
        """Start over after a retraction (``retractions``: the request's count; its KV was all released)."""
        if retractions != self.retractions:
            self._reset(retractions)

    def score_job(self, batch_index: int, kv_len: int, retractions: int) -> Optional[ScoreJob]:
        """The scoring pass's job for this request's step (``kv_len`` kept slots
        after it); None under ``window``, which reads no scores."""
        self.sync(retractions)
        self.peak_kv = max(self.peak_kv, kv_len)
        if self.acc.shape[2] < kv_len:  # (window reads no scores, but a compaction reads its columns' zeros)
            grown = torch.zeros((*self.acc.shape[:2], 2 * kv_len), dtype=torch.float32, device=self.acc.device)
            grown[:, :, : self.acc.shape[2]] = self.acc
            self.acc = grown
        if self.budget.policy == "window":
            return None
        sketch = None
        if self.axes is not None and self.sketch.shape[3]:
            host = self.host.layer_caches() if self.host is not None else None
            sketch = OffloadSketch(self.sketch, self.axes, self.est, self.pos, host, self.budget.fetch)
        return ScoreJob(batch_index, self.acc, self.budget.decay, sketch)

    def column_positions(self, n: int) -> torch.Tensor:
        """``[L, H, n]``: the position each head holds in each of the request's ``n`` columns."""
        m = self.pos.shape[2]
        L, H = self.pos.shape[:2]
        since = torch.arange(self.base, self.base + n - m, device=self.pos.device)
        return torch.cat([self.pos, since.expand(L, H, -1)], dim=2)

    def wants_compaction(self, kv_len: int, uncomputed: int, has_output: bool) -> bool:
        """Grown ``slack`` past the budget (decoding), past it while chunks of at
        most ``slack`` tokens remain (prefilling: so no chunk takes it beyond
        ``budget + slack``), or (infinigen, with KV on the host) about to
        compute the prompt's last token, whose logits give the first output:
        the reload before it must have run. ``kv_len``: the request's columns;
        ``uncomputed``: its tokens without KV."""
        b = self.budget
        if kv_len >= b.tokens + b.slack or (uncomputed > 1 and kv_len > b.tokens):
            return True
        last_prompt_token = not has_output and uncomputed == 1
        return last_prompt_token and self.base > 0 and self.host is not None

    def describe(self) -> dict:
        """The request's figures for its result's ``meta_info["kv_budget"]``."""
        b = self.budget
        return {
            "policy": b.policy,
            "budget_tokens": b.tokens,
            "peak_kv_tokens": self.peak_kv,
            "evicted_tokens": round(self.counters.evicted, 1),
            "offloaded_tokens": round(self.counters.offloaded, 1),
            "reloaded_tokens": round(self.counters.reloaded, 1),
        }
