"""KV budgets in the step loop: scoring, compaction, offload and reload.

A request under a KV budget (radixrt/memory/kv_budget.py: policies ``h2o``,
``infinigen``, ``window``) carries a `RequestBudget`. Every step it computes
in, the forward adds the attention mass each of its kept positions receives
to its accumulator (kernels/kv_scores.py; `RequestBudget.score_job`). At the
start of a step, `KVBudgeter.compact` shrinks every request that has grown
``slack`` past its budget back to the budget: the policy chooses the kept
positions, the KV manager rewrites the request's slot list
(`KVCacheManager.compact`), private slots no longer attended are freed (their
KV first copied to host memory under ``infinigen``), and offloaded positions
the policy wants back are loaded into fresh slots.

How the step loop changes for such a request:

- its prefill runs in chunks of at most ``slack`` tokens, and the prompt's
  last token in a step of its own, so a compaction (and, under
  ``infinigen``, a reload) runs between any two chunks and before the first
  output's logits: its KV never exceeds ``budget + slack`` slots;
- it never inserts what it computes into the radix tree (``insert_into_tree``
  False): once compressed its KV is not the exact prefix another request
  would need. It reads what it matched at admission, and those tree-owned
  slots stay the tree's when it stops attending them;
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from radixrt.config.sections import KVBudgetSettings
from radixrt.kernels.kv_scores import OffloadSketch, ScoreJob
from radixrt.memory.kv_budget import KVBudget, resolve_budget
from radixrt.memory.kv_budget_ops import OffloadedKV, choose_kept
from radixrt.memory.kv_manager import KVCacheManager
from radixrt.memory.kv_pool import KVPool

if TYPE_CHECKING:
    from radixrt.scheduler.request import Req


@dataclass
class BudgetCounters:
    """What budgets did, in tokens (the server's totals, and one request's)."""

    compactions: int = 0
    evicted: int = 0  # positions dropped for good (h2o, window), tree-owned ones included
    offloaded: int = 0  # positions moved to the offload store (infinigen)
    reloaded: int = 0  # positions loaded back from it

    def add(self, other: "BudgetCounters") -> None:
        self.compactions += other.compactions
        self.evicted += other.evicted
        self.offloaded += other.offloaded
        self.reloaded += other.reloaded


class RequestBudget:
    """One request's budget state, for one admission (a retraction resets it).

    Column ``j`` of the request's slot list is position ``kept_positions[j]``
    for the columns kept at the last compaction, and ``base + (j - len(kept_positions))``
    for those computed since (``base``: its computed tokens then). ``acc[j]``
    is column ``j``'s score."""

    def __init__(self, budget: KVBudget, pool: KVPool) -> None:
        self.budget = budget
        self.pool = pool
        self.counters = BudgetCounters()
        self.peak_kv = 0  # the most slots it attended in one step
        self._reset(retractions=0)

    def _reset(self, retractions: int) -> None:
        self.retractions = retractions
        self.acc = torch.zeros(self.budget.tokens + 2 * self.budget.slack, dtype=torch.float32, device=self.pool.device)
        self.kept_positions: list[int] = []
        self.base = 0
        self.store: Optional[OffloadedKV] = None
        if self.budget.policy == "infinigen":
            self.store = OffloadedKV(self.pool, torch.device("cpu"))

    def sync(self, req: "Req") -> None:
        """Start over after a retraction (the request's KV was all released)."""
        if req.retractions != self.retractions:
            self._reset(req.retractions)

    def score_job(self, batch_index: int, kv_len: int, req: "Req") -> ScoreJob:
        """The scoring pass's job for this request's step (``kv_len`` kept slots after it)."""
        self.sync(req)
        if self.acc.shape[0] < kv_len:
            grown = torch.zeros(2 * kv_len, dtype=torch.float32, device=self.acc.device)
            grown[: self.acc.shape[0]] = self.acc
            self.acc = grown
        self.peak_kv = max(self.peak_kv, kv_len)
        sketch = None
        store = self.store
        if store is not None and len(store) and store.channels is not None:
            sketch = OffloadSketch(store.sketch, store.channels, store.acc)
        return ScoreJob(batch_index, self.acc, self.budget.decay, sketch)

    def positions(self, kv_len: int) -> list[int]:
        """The position of each of the request's ``kv_len`` columns."""
        m = len(self.kept_positions)
        return self.kept_positions + list(range(self.base, self.base + kv_len - m))

    def wants_compaction(self, req: "Req") -> bool:
        """Grown ``slack`` past the budget (decoding), past it while chunks of at
        most ``slack`` tokens remain (prefilling: so no chunk takes it beyond
        ``budget + slack``), or (infinigen, with something offloaded) about to
        compute the prompt's last token, whose logits give the first output:
        the reload before it must have run."""
        n, b = len(req.slots), self.budget
        uncomputed = req.uncomputed
        if n >= b.tokens + b.slack or (uncomputed > 1 and n > b.tokens):
            return True
        last_prompt_token = not req.output_ids and uncomputed == 1
        return last_prompt_token and self.store is not None and len(self.store) > 0

    def describe(self) -> dict:
        """The request's figures for its result's ``meta_info["kv_budget"]``."""
        b = self.budget
        return {
            "policy": b.policy,
            "budget_tokens": b.tokens,
            "peak_kv_tokens": self.peak_kv,
            "evicted_tokens": self.counters.evicted,
            "offloaded_tokens": self.counters.offloaded,
            "reloaded_tokens": self.counters.reloaded,
        }


class KVBudgeter:
    """Gives requests their budgets and compacts them between steps."""

    def __init__(self, settings: KVBudgetSettings, kv: KVCacheManager, pool: KVPool) -> None:
        self.settings = settings
        self.kv = kv
        self.pool = pool
        self.totals = BudgetCounters()
        self.requests = 0

    def check(self, kv_budget: Optional[float]) -> None:
        """Raise ValueError for a request budget this server cannot run."""
        if kv_budget is not None and self.kv.page_size != 1:
            raise ValueError(f"kv_budget needs a server started with --page-size 1 (it has {self.kv.page_size})")

    def budget_for(self, req: "Req") -> Optional[KVBudget]:
        """The request's budget in tokens (its own, else the server's), or None."""
        sp, s = req.sampling, self.settings
        value = sp.kv_budget if sp.kv_budget is not None else s.kv_budget
        if value is None:
            return None
        tokens = resolve_budget(value, len(req.input_ids) + sp.max_new_tokens)
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
        req.draft_limit = 0  # no jump-forward drafts: its slot list must follow its tokens
        self.requests += 1

    def compact(self, running: list["Req"]) -> None:
        """Bring every running request that wants it back to its budget."""
        for req in running:
            b = req.kv_budget
            if b is None or req.row is None:
                continue
            b.sync(req)
            if b.wants_compaction(req):
                self._compact(req, b)

    def _compact(self, req: "Req", b: RequestBudget) -> None:
        done = BudgetCounters(compactions=1)
        n = len(req.slots)
        computed = n + req.kv_dropped
        positions = b.positions(n)
        store = b.store
        cand_pos = torch.tensor(positions, dtype=torch.int64)
        cand_score = b.acc[:n].cpu()
        import os
        if os.environ.get("KVB_NORM") == "1":
            cand_score = cand_score / (computed - cand_pos).clamp(min=1).float()
        if store is not None and len(store):
            cand_pos = torch.cat([cand_pos, torch.tensor(store.positions, dtype=torch.int64)])
            cand_score = torch.cat([cand_score, store.acc.cpu()])
        keep = choose_kept(cand_pos, cand_score, b.budget, computed)
        kept_cols = keep[:n].nonzero().flatten().tolist()
        dropped_cols = (~keep[:n]).nonzero().flatten().tolist()
        back = keep[n:].nonzero().flatten().tolist()  # offloaded entries to load back

        # (position, slot, score) of everything kept, reloads included; tree-owned positions come first
        kept = [(positions[c], req.slots[c], float(cand_score[c])) for c in kept_cols]
        tree_len = sum(1 for c in kept_cols if c < req.tree_len)
        if back and store is not None:
            host_back = [e for e in back if store.tree_slots[e] < 0]
            slots = self.kv.alloc_private(len(host_back)) if host_back else []
            if slots is None:  # short of memory: reload only what the tree still holds
                back = [e for e in back if store.tree_slots[e] >= 0]
                host_back, slots = [], []
            fresh = iter(slots)
            for e in back:
                tree_slot = store.tree_slots[e]
                slot = tree_slot if tree_slot >= 0 else next(fresh)
                kept.append((store.positions[e], slot, float(cand_score[n + e])))
                tree_len += tree_slot >= 0
            store.take(back, slots)
            done.reloaded += len(back)
        kept.sort()

        freed = [req.slots[c] for c in dropped_cols if c >= req.tree_len]
        if store is not None:
            store.add(
                [positions[c] for c in dropped_cols],
                [req.slots[c] for c in dropped_cols],
                [c < req.tree_len for c in dropped_cols],
                b.acc[torch.tensor(dropped_cols, dtype=torch.int64, device=b.acc.device)],
                [s for _, s, _ in kept],
            )
            done.offloaded += len(dropped_cols)
        else:
            done.evicted += len(dropped_cols)
        b.counters.add(done)
        self.totals.add(done)

        self.kv.compact(req, [s for _, s, _ in kept], tree_len, freed, computed)
        b.kept_positions = [p for p, _, _ in kept]
        b.base = computed
        b.acc.zero_()
        if kept:
            b.acc[: len(kept)] = torch.tensor([a for _, _, a in kept], dtype=torch.float32)

    def stats(self) -> dict:
        t = self.totals
        return {
            "kv_budget_requests": self.requests,
            "kv_budget_compactions": t.compactions,
            "kv_budget_evicted_tokens": t.evicted,
            "kv_budget_offloaded_tokens": t.offloaded,
            "kv_budget_reloaded_tokens": t.reloaded,
        }
