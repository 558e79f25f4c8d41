"""KV budgets in the step loop: scoring, compaction, offload and reload.

A request under a KV budget (radixrt/memory/kv_budget.py: policies ``h2o``,
``infinigen``, ``window``) carries a `RequestBudget`. Every step it computes
in, the forward adds the attention mass each layer's KV heads give each of
its columns to its accumulator (kernels/kv_scores.py;
`RequestBudget.score_job`). At the start of a step, `KVBudgeter.compact`
brings every request that has grown past its budget back to it: each head
chooses its kept positions, their K/V are gathered (from the pool, or from
the host copy under ``infinigen``) and written into the request's private
slots, one column per kept place, the surplus private slots are freed, and
the KV manager rewrites the request's slot list (`KVCacheManager.compact`).

How the step loop changes for such a request:

- its prefill runs in chunks of at most ``slack`` tokens, and the prompt's
  last token in a step of its own, so a compaction (and, under
  ``infinigen``, a reload) runs between any two chunks and before the first
  output's logits: it never holds more than ``budget + slack`` slots;
- it neither inserts what it computes into the radix tree (``insert_into_tree``
  False: once compressed its KV is not the exact prefix another request
  would need) nor reads a prefix from it (``tree_limit`` 0): the KV of a cached
  prefix was computed with full attention, which is not what its compressed
  attention computes past its first compaction, and its scores (h2o's
  accumulated attention) need the prompt's own queries, so its answer would
  depend on what the cache held;
- its batch is not overlapped with the next step (a compaction reads the
  scores of the step before), it does not speculate and takes no
  jump-forward drafts (both would need its slot list to follow its tokens);
- a retraction releases everything (scores and offloaded KV included); when
  it runs again its prompt and output are recomputed and compressed again.

Threads: everything here runs on the scheduler's thread, between steps; the
forward thread only adds to the accumulators of the step it runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

from radixrt.config.sections import KVBudgetSettings
from radixrt.memory.kv_budget import MIN_KV_BUDGET, KVBudget, resolve_budget
from radixrt.memory.kv_budget_ops import (
    choose_positions,
    gather_columns,
    mark_wanted,
    mean_attention,
    principal_axes,
    sketch_keys,
    write_columns,
)
from radixrt.memory.kv_manager import KVCacheManager
from radixrt.memory.kv_pool import KVPool
from radixrt.scheduler.budget_state import BudgetCounters, RequestBudget

if TYPE_CHECKING:
    from radixrt.scheduler.request import Req


class KVBudgeter:
    """Gives requests their budgets and compacts them between steps."""

    def __init__(self, settings: KVBudgetSettings, kv: KVCacheManager, pool: KVPool) -> None:
        self.settings = settings
        self.kv = kv
        self.pool = pool
        self.totals = BudgetCounters()
        self.requests = 0

    def check(self, kv_budget: Optional[float], policy: Optional[str] = None) -> None:
        """Raise ValueError for a request budget this server cannot run, or a policy with no budget
        to apply it to (neither the request's nor the server's --kv-budget)."""
        if kv_budget is not None and self.kv.page_size != 1:
            raise ValueError(f"kv_budget needs a server started with --page-size 1 (it has {self.kv.page_size})")
        if policy is not None and kv_budget is None and self.settings.kv_budget is None:
            raise ValueError(
                "kv_budget_policy applies to a KV budget: give kv_budget too (this server has no --kv-budget)"
            )

    def budget_for(self, req: "Req") -> Optional[KVBudget]:
        """The request's budget in tokens (its own, else the server's), or None. At most
        what the request can ever hold (its prompt and output, and the KV pool): the
        budget's buffers are sized by it, so a client's huge number costs nothing."""
        sp, s = req.sampling, self.settings
        value = sp.kv_budget if sp.kv_budget is not None else s.kv_budget
        if value is None:
            return None
        longest = len(req.input_ids) + sp.max_new_tokens
        tokens = max(MIN_KV_BUDGET, min(resolve_budget(value, longest), longest, self.kv.allocator.total_slots))
        sinks = min(s.kv_budget_sink_tokens, tokens // 4)
        recent = max(1, math.floor(tokens * s.kv_budget_recent_fraction))
        return KVBudget(sp.kv_budget_policy or s.kv_budget_policy, tokens, sinks, min(recent, tokens - sinks))

    def start(self, req: "Req") -> None:
        """Attach the request's budget state (before it first runs)."""
        budget = self.budget_for(req)
        if budget is None:
            return
        req.kv_budget = RequestBudget(budget, self.pool)
        req.insert_into_tree = False
        req.tree_limit = 0  # matches no cached prefix either (module docstring)
        req.draft_limit = 0  # no jump-forward drafts: its slot list must follow its tokens
        self.requests += 1

    def compact(self, running: list["Req"]) -> None:
        """Bring every running request that wants it back to its budget."""
        for req in running:
            b = req.kv_budget
            if b is None or req.row is None:
                continue
            b.sync(req.retractions)
            if b.wants_compaction(len(req.slots), req.uncomputed, bool(req.output_ids)):
                self._compact(req, b)

    def _compact(self, req: "Req", b: RequestBudget) -> None:
        """Choose each head's kept positions, copy them into the request's private
        slots (columns), free the rest of its private slots; tree-owned slots are
        only read (the request stops listing them)."""
        pool, dev = self.pool, self.pool.device
        L, H = pool.num_layers, pool.num_kv_heads
        n = len(req.slots)
        computed = n + req.kv_dropped
        slots = torch.tensor(req.slots, dtype=torch.int64, device=dev)
        col_pos = b.column_positions(n)  # [L, H, n]
        exact = torch.full((L, H, computed), -math.inf, dtype=torch.float32, device=dev)
        exact.scatter_(2, col_pos, b.acc[:, :, :n])
        # h2o ranks by attention per query that saw a position; infinigen's scores already age
        # (decayed per query row), and ranking them so measured no different
        scores = mean_attention(exact) if b.budget.policy == "h2o" else exact
        if b.host is not None and b.est.shape[2]:
            # infinigen: each head's positions with the most estimated mass for the current queries come
            # back (or stay), ahead of the heavy hitters; the rest compete by their exact scores
            scores = mark_wanted(exact.clone(), b.est, b.budget.reload)
        kept = choose_positions(scores.view(L * H, computed), b.budget, computed).view(L, H, -1)
        K = kept.shape[2]

        private = req.slots[req.tree_len :]
        fresh: list[int] = []
        if K > len(private):
            got = self.kv.alloc_private(K - len(private))
            if got is None:  # short of memory: stay as it is until the next chance
                return
            fresh = got
        if b.host is not None:  # every position goes to the host (and the sketch) before columns are rewritten
            new_slots = slots[n - (computed - b.base) :]
            b.host.save(torch.arange(b.base, computed, device=dev), new_slots)
            if b.axes is None:
                b.axes = principal_axes(pool, slots)
            rows = sketch_keys(pool, new_slots, b.axes)
            b.sketch = rows if b.sketch.shape[3] == 0 else torch.cat([b.sketch, rows], dim=3)
        col_of = torch.full((L, H, computed), -1, dtype=torch.int64, device=dev)
        col_of.scatter_(2, col_pos, torch.arange(n, device=dev).expand(L, H, n))
        cols = col_of.gather(2, kept)
        src = torch.where(cols >= 0, slots[cols.clamp(min=0)], torch.full_like(cols, -1))
        data = gather_columns(pool, src, kept, b.host)
        targets = (private + fresh)[:K]
        write_columns(pool, data, torch.tensor(targets, dtype=torch.int64, device=dev))

        heads = L * H
        done = BudgetCounters(compactions=1)
        dropped = (heads * n - int((cols >= 0).sum())) / heads
        if b.host is not None:
            done.offloaded = dropped
            done.reloaded = int((cols < 0).sum()) / heads
        else:
            done.evicted = dropped
        b.counters.add(done)
        self.totals.add(done)

        self.kv.compact(req, targets, private[K:], computed)
        b.pos = kept
        b.base = computed
        b.acc.zero_()
        b.acc[:, :, :K] = exact.gather(2, kept).clamp(min=0.0)  # a reloaded position starts from nothing
        if b.host is not None:  # the new positions' estimates start from nothing
            b.est = torch.cat([b.est, b.est.new_zeros((L, H, computed - b.est.shape[2]))], dim=2)

    def stats(self) -> dict:
        t = self.totals
        return {
            "kv_budget_requests": self.requests,
            "kv_budget_compactions": t.compactions,
            "kv_budget_evicted_tokens": round(t.evicted, 1),
            "kv_budget_offloaded_tokens": round(t.offloaded, 1),
            "kv_budget_reloaded_tokens": round(t.reloaded, 1),
        }
