"""Phase 1 of a step: choose the batch.

Running requests come first: decoders (one token each, or a token and its
jump-forward draft), then unfinished chunked prefills. Then waiting requests
are admitted in policy order while the step's token budget, the running-
request cap and KV memory last; a share of memory stays reserved for the
running requests' future decode tokens. When a running request cannot get a
slot, requests are retracted from the end of the order (fewest outputs,
longest prompts): their KV goes back (their prefix stays in the tree) and
they wait to be recomputed; with ``--preemption-mode swap`` a retracted
request's own KV moves to the host tier instead, when the cost model
(radixrt/memory/swap_cost.py) says copying it out and back is cheaper than
recomputing it, and is loaded back when it is admitted again.

Per-request host work per step is kept small: the decoders at the head of the
order (one token, no draft) take their KV slots in one allocator call
(`KVCacheManager.extend_decode`) when memory suffices for all of them; only
otherwise are they extended one by one, which is where retraction happens.
The running list is sorted only when its order may have changed
(`RequestQueues.running_ordered`): a step in which every running request
decoded one token keeps it.

The planner mutates the `RequestQueues` (moves requests between waiting and
running) and the requests' KV through `KVCacheManager`; it runs no model.
`BatchPlanner.schedule` returns a `Plan`: the batch, the requests it
retracted and those it had to end.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Optional

from radixrt.config import SchedulingSettings
from radixrt.memory.kv_manager import KVCacheManager
from radixrt.memory.radix_cache import RadixCache
from radixrt.memory.radix_explain import explain_match, tier_hits
from radixrt.memory.radix_node import MatchResult
from radixrt.memory.swap_cost import SwapCostModel
from radixrt.requests.finish import FinishReason
from radixrt.scheduler.constrained import drop_draft
from radixrt.scheduler.policy import (
    by_priority,
    fair_share_retractions,
    interleave_calls,
    order_waiting,
    priority_retractions,
)
from radixrt.scheduler.queues import RequestQueues, running_order
from radixrt.scheduler.request import Phase, Req

logger = logging.getLogger(__name__)

# Reserve for running requests' future decode tokens, as a fraction of their
# remaining max_new_tokens; rises after a retraction, decays while all is well.
INIT_NEW_TOKEN_RATIO = 0.5
RESERVE_CAP_PER_REQUEST = 4096  # a request's share of the reserve is capped (as SGLang does)
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002

Batch = list[tuple[Req, int]]  # (request, tokens it computes this step)


@dataclass
class Plan:
    """What scheduling one step decided.

    ``batch``: the requests that compute this step, each with its token count;
    their KV slots for it are allocated. ``retracted``: running requests moved
    back to the head of the waiting queue (their KV released), in the order
    retracted. ``ended``: requests that can never run (alone in the KV pool and
    unable to grow), each with its finish reason; they are in neither queue,
    their KV is released, and the caller reports them as finished."""

    batch: Batch = field(default_factory=list)
    retracted: list[Req] = field(default_factory=list)
    ended: list[tuple[Req, FinishReason]] = field(default_factory=list)


# A step's prompt tokens while several calls have work, in requests' shares (`BatchPlanner._step_budget`)
PROMPT_SHARES_WHEN_SHARED = 4
# the fewest prompt tokens a step gives a request, however long its context (`_prompt_cap`)
MIN_STEP_PROMPT_TOKENS = 32


class BatchPlanner:
    def __init__(
        self,
        config: SchedulingSettings,
        kv: KVCacheManager,
        queues: RequestQueues,
        context_length: int,
        swap_cost: Optional[SwapCostModel] = None,
        shared_step_prefill_cap: Optional[int] = None,
        max_loras_per_batch: int = 1 << 30,
        keys_per_dense_token: int = 0,
    ) -> None:
        """``swap_cost``: under ``--preemption-mode swap``, the model that decides
        whether a retracted request's KV moves to the host tier; None: recompute.
        ``shared_step_prefill_cap``: most prompt tokens one request computes in a
        step while another request runs or waits (None: ``chunked_prefill_size``).
        ``max_loras_per_batch``: most distinct LoRA adapters in one batch (a
        request of one more waits). ``keys_per_dense_token``: the model's, for
        `_prompt_cap` (`ModelConfig.keys_per_dense_token`; 0: a token counts as one)."""
        self.keys_per_dense_token = keys_per_dense_token
        self.max_loras_per_batch = max_loras_per_batch
        self.config = config
        self.shared_step_prefill_cap = shared_step_prefill_cap or config.chunked_prefill_size
        self.prefill_cap = config.chunked_prefill_size  # this step's: see `schedule`
        self.kv = kv
        self.queues = queues
        self.context_length = context_length
        self.swap_cost = swap_cost
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def schedule(self, admit: bool = True) -> Plan:
        """Plan the next step: its batch, and the requests retracted or ended to make it
        (``admit`` False: no request starts; the running ones, and those retracted since
        they started, go on, and none is retracted for a waiting one)."""
        plan = Plan()
        # alone, a request's prompt takes the whole step; shared, a long one yields between short steps
        alone = len(self.queues.running) + len(self.queues.waiting) <= 1
        self.prefill_cap = self.config.chunked_prefill_size if alone else self.shared_step_prefill_cap
        if not admit:  # a weight update waits for the requests that started to finish
            budget = self._schedule_running(plan, self._step_budget())
            self._admit(plan.batch, budget, set(), resumed_only=True)
            return plan
        cfg, queues = self.config, self.queues
        if cfg.enable_priority_scheduling:
            threshold = cfg.priority_scheduling_preemption_threshold
            for victim in priority_retractions(queues.running, queues.waiting, cfg.max_running_requests, threshold):
                self.retract(victim, plan)
        else:
            for victim in fair_share_retractions(queues.running, queues.waiting, cfg.max_running_requests):
                self.retract(victim, plan, pressure=False)
        # calls with a prompt being computed (only asked about while requests wait)
        busy = {r.group for r in self.queues.running if not r.output_ids} if self.queues.waiting else set()
        held = self._held_for_other_calls(busy)
        budget = self._schedule_running(plan, self._step_budget(), held)
        self._admit(plan.batch, budget, busy if held else set())
        if plan.batch:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return plan

    def _tokens_this_step(self, req: Req, budget: int) -> int:
        need = req.uncomputed
        return 1 if need == 1 else self._prefill_tokens(req, need, budget)

    def _prefill_tokens(self, req: Req, need: int, budget: int) -> int:
        """Tokens of a request's ``need`` uncomputed ones this step's ``budget``
        lets it compute. Under a KV budget (kv_budget.py) at most its slack,
        and the prompt's last token in a step of its own: it is compacted
        between chunks and before the first output's logits."""
        cap = self._prompt_cap(req.seq_len - need - req.kv_dropped)
        b = req.kv_budget
        if b is not None and need > 1:
            # it compacts after every chunk, so its chunks depend on it alone, not on what else the step
            # holds (that changed its answer): a step with less room gives it nothing, not a smaller chunk
            own = min(need - 1, cap, b.budget.slack)
            return own if own <= budget else 0
        return min(need, budget, cap)

    def _prompt_cap(self, keys: int) -> int:
        """The cap (chunk or shared) on the prompt tokens of a request with ``keys`` keys (an
        admitted one's: its cached prefix). A token's attention over ``c`` keys costs ``c /
        keys_per_dense_token`` of its dense products (on the CPU 256 tokens over 7,000 keys took
        1.6 s, not 0.5), so it counts that much more (at least `MIN_STEP_PROMPT_TOKENS` a step)."""
        cap, k0 = self.prefill_cap, self.keys_per_dense_token
        if k0 <= 0:
            return cap
        return max(min(cap, MIN_STEP_PROMPT_TOKENS), cap * k0 // (k0 + max(keys, 0)))

    def _will_stop_at_length(self, req: Req) -> bool:
        """A request whose in-flight token is its last: nothing to compute for it."""
        n_out = len(req.output_ids) + req.inflight_tokens
        return n_out >= req.sampling.max_new_tokens or req.seq_len + req.inflight_tokens >= self.context_length

    def _step_budget(self) -> int:
        """Tokens this step may compute: ``chunked_prefill_size`` while one call has all
        the work (a batch's steps stay long) or nothing decodes (prompts only: nobody waits
        on the step for a token); while several calls have work and requests decode, the
        prompts get at most `PROMPT_SHARES_WHEN_SHARED` requests' shares
        (``shared_step_prefill_cap``) besides the decoders' tokens: every decoder's next
        token waits for the whole step, and on a CPU 2,048 prompt tokens take seconds."""
        full = max(self.config.chunked_prefill_size, 1)
        cap = PROMPT_SHARES_WHEN_SHARED * self.shared_step_prefill_cap
        running, waiting = self.queues.running, self.queues.waiting
        if cap >= full or not running:
            return full
        decoding = sum(1 + len(r.draft_ids) for r in running if r.output_ids)
        first = running[0].group
        if not decoding or (all(r.group == first for r in running) and all(r.group == first for r in waiting)):
            return full
        return min(full, cap + decoding)

    def _held_for_other_calls(self, busy: set[str]) -> int:
        """Prompt tokens of this step that running prompts may not take: one request's share
        (at most half the step) while a request waits whose call has no prompt in progress (its
        group not in ``busy``), so that a call of many long prompts, admitted together, holds
        another call's request for a step and not until all of them are computed."""
        running, waiting = self.queues.running, self.queues.waiting
        if not waiting or len(running) >= self.config.max_running_requests:
            return 0
        if all(r.group in busy or r.grammar_compiling for r in waiting):
            return 0
        return min(self.prefill_cap, self.config.chunked_prefill_size // 2)

    def _schedule_running(self, plan: Plan, budget: int, held: int = 0) -> int:
        """Put the running requests into ``plan.batch`` in `running_order`, each
        with its KV for this step, while ``budget`` tokens last (prompts still being
        computed leave ``held`` of them to `_admit`); short of memory, retract from
        the end of the order. Returns the budget left."""
        running, batch = self.queues.running, plan.batch
        if not self.queues.running_ordered:
            running.sort(key=running_order)
            self.queues.running_ordered = True
        taken = self._take_decoders(running, batch)
        budget -= len(batch)  # one token for each decoder taken (the batch was empty)
        queue = deque(running[taken:] if taken else running)
        while queue:
            req = queue.popleft()
            if req.phase is not Phase.RUNNING:  # a beam retracted with a sibling (see `retract`)
                continue
            if req.inflight_tokens and self._will_stop_at_length(req):
                continue
            if req.draft_ids and req.uncomputed > min(budget, self.prefill_cap):
                drop_draft(req)  # a draft is computed in one piece or not at all
            q = self._tokens_this_step(req, budget if req.output_ids else budget - held)
            if q > 0:
                q = self._extend_or_retract(req, q, queue, plan, budget)
            if q > 0:
                batch.append((req, q))
                budget -= q
        return budget

    def _extend_or_retract(self, req: Req, q: int, queue: deque[Req], plan: Plan, budget: int) -> int:
        """Allocate ``req``'s KV for ``q`` tokens this step, retracting the requests
        at the end of ``queue`` while memory is short; short of memory, a draft is
        dropped first (fewer tokens). Returns the tokens allocated, or 0 when
        ``req`` itself was retracted or ended instead."""
        running = self.queues.running
        while not self.kv.extend(req, q):
            if req.draft_ids:  # short of memory: decode one token rather than retract anyone
                drop_draft(req)
                q = self._tokens_this_step(req, budget)
                continue
            while queue and queue[-1].phase is not Phase.RUNNING:
                queue.pop()  # beams retracted with a sibling
            victim = queue.pop() if queue else None
            if victim is None:
                # Others still hold KV (in this batch, or finishing in the step in
                # flight, which frees theirs once processed): retract this one.
                # Only a request alone in the pool that cannot grow is beyond saving.
                if plan.batch or len(running) > 1:
                    victim = req
                else:
                    running.remove(req)
                    drop_draft(req)
                    self.kv.release(req)  # now: what it held is admissible in this very step
                    plan.ended.append((req, FinishReason.abort("out of KV memory for a single request")))
                    return 0
            self.retract(victim, plan)
            if req.phase is not Phase.RUNNING:  # retracted itself, or with a sibling beam
                return 0
        return q

    def _take_decoders(self, running: list[Req], batch: Batch) -> int:
        """The decode fast path: the leading requests of (sorted) ``running`` that
        compute one token and have no draft take their slots in one allocation and
        join ``batch``, as the general loop would have scheduled them had memory
        sufficed for all. When it does not, nothing is taken here and the general
        loop takes them one by one (and retracts). Returns how many leading
        requests were handled (those whose in-flight token is their last compute
        nothing and join no batch)."""
        n = 0
        decoders = []
        for req in running:
            n_in, n_out = len(req.input_ids), len(req.output_ids)
            if req.draft_ids or n_in + n_out + req.inflight_tokens - len(req.slots) - req.kv_dropped != 1:
                break
            n += 1
            if not (req.inflight_tokens and self._will_stop_at_length(req)):
                decoders.append(req)
        if not decoders or not self.kv.extend_decode(decoders):
            return 0
        batch.extend(zip(decoders, repeat(1)))
        return n

    def retract(self, req: Req, plan: Plan, pressure: bool = True) -> None:
        """Release a running request's KV (its prefix stays in the tree) and re-queue it.
        Its output and grammar matcher stay; its draft is dropped. ``pressure``: retracted
        for memory (more KV is then kept in reserve), not to share the batch."""
        self.queues.running.remove(req)
        drop_draft(req)
        swap = self.swap_cost is not None and self.swap_cost.should_swap(len(req.slots))
        if self.swap_cost is not None and not swap:
            self.kv.swap_declined += 1
        self.kv.release(req, swap=swap)
        if req.input_logprobs is None:
            req.prompt_logprob_acc = []
        req.phase = Phase.WAITING
        req.retractions += 1
        self.queues.waiting.insert(0, req)
        plan.retracted.append(req)
        if pressure:
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        logger.info(
            "retracted %s (%d tokens) %s", req.rid, req.seq_len, "under KV pressure" if pressure else "for a call"
        )
        if req.beam is not None:  # a beam search is retracted as a unit: its other beams go too
            for sibling in req.beam.beams:
                if sibling.phase is Phase.RUNNING:
                    for i, (r, q) in enumerate(plan.batch):
                        if r is sibling:  # its slots for this step are not computed: they go first
                            del plan.batch[i]
                            self.kv.truncate(sibling, len(sibling.slots) - q)
                            break
                    self.retract(sibling, plan, pressure)

    def _remaining_tokens(self, req: Req) -> int:
        return min(max(req.sampling.max_new_tokens - len(req.output_ids), 0), RESERVE_CAP_PER_REQUEST)

    def _decode_reserve(self) -> int:
        return int(sum(self._remaining_tokens(r) for r in self.queues.running) * self.new_token_ratio)

    def _admit(self, batch: Batch, budget: int, busy: set[str], resumed_only: bool = False) -> None:
        """Admit waiting requests while ``budget`` and memory last; those of calls with a
        prompt in progress (``busy``) after the others (``resumed_only``: those admitted before)."""
        waiting, running = self.queues.waiting, self.queues.running
        if not waiting or budget <= 0:
            return
        ordered = interleave_calls(order_waiting(self.config.schedule_policy, waiting, self.kv.match))
        holding = {r.group for r in running}  # calls with nothing running first (a place retracted for one)
        ordered = sorted(ordered, key=lambda r: (r.group in busy, r.group in holding))  # stable
        if self.config.enable_priority_scheduling:
            ordered = by_priority(ordered)
        # Prefixes being computed, in this step or by an unfinished chunked prefill that gets
        # no tokens this one: a request sharing a long uncached prefix with one of them waits
        # and then reads that prefix from the tree instead of computing it again.
        inflight = RadixCache(None, page_size=1)
        computing = {id(r): r for r, q in batch if q > 1}
        # a prefill given no tokens this step has no KV allocated for it: still uncomputed
        computing.update((id(r), r) for r in running if r.uncomputed - len(r.draft_ids) > 1)
        for r in computing.values():
            inflight.insert(r.seq, [0] * r.seq_len)
        reserve = self._decode_reserve()
        threshold = self.config.in_batch_prefix_threshold
        adapters = {id(r.lora) for r in running if r.lora is not None}
        for req in ordered:
            if budget <= 0 or len(running) >= self.config.max_running_requests:
                break
            if req.phase is not Phase.WAITING or req.grammar_compiling or req.inflight_tokens:
                continue  # admitted with its beam search / its grammar is compiling / its last token is in flight
            if resumed_only and not req.admitted_once:
                continue
            if req.lora is not None and id(req.lora) not in adapters:
                if len(adapters) >= self.max_loras_per_batch:
                    continue  # one adapter too many for this batch
                adapters.add(id(req.lora))
            if req.beam is not None:
                admitted = self._admit_beams(req, batch, budget, reserve)
                if admitted is None:
                    break
                budget -= sum(q for _, q in admitted)
                reserve += sum(int(self._remaining_tokens(r) * self.new_token_ratio) for r, _ in admitted)
                continue
            match = self.kv.match(req, load=True)  # what the host tier holds comes back (copies queued)
            if self.kv.tree.stores_prefixes:
                shared = inflight.match_prefix(req.seq[: req.max_prefix_len], record_stats=False).length
                if shared >= threshold and shared > match.length:
                    continue  # even for its last few uncached tokens: a step's wait, not a second copy
            extend = req.seq_len - match.length
            if req.draft_ids and extend > min(budget, self.prefill_cap):
                drop_draft(req)  # a draft is computed in one piece or not at all
                extend = req.seq_len - match.length
            q = self._prefill_tokens(req, extend, budget)
            if q <= 0 or (running and self.kv.available_slots() - q < reserve):
                break
            explained = None  # before admit/extend change the tree: the match as it happened
            if req.cache_info_mode and not req.admitted_once:
                explained = explain_match(
                    self.kv.tree,
                    req.input_ids,
                    req.namespace,
                    match.length,
                    req.max_prefix_len,
                    full=req.cache_info_mode == "full",
                )
            if not self._admit_one(req, match, q, batch, explained):
                break
            budget -= q
            reserve += int(self._remaining_tokens(req) * self.new_token_ratio)
            inflight.insert(req.seq, [0] * req.seq_len)

    def _admit_one(self, req: Req, match: MatchResult, q: int, batch: Batch, explained: Optional[Any] = None) -> bool:
        """Admit ``req`` with its prefix ``match`` and KV for ``q`` tokens into ``batch``;
        False (nothing changed) when memory is short."""
        self.kv.admit(req, match)
        if not self.kv.extend(req, q):
            self.kv.release(req)
            return False
        if not req.admitted_once:
            req.cached_tokens = match.length
            req.cache_info = explained
            req.admitted_once = True
            req.started_at = time.monotonic()
            storage_hit = min(req.storage_tokens, match.loaded)
            self.kv.record_admission(req, match.length, match.loaded, storage_hit)
            if explained is not None:
                explained["tiers"] = tier_hits(match.length, match.loaded, storage_hit)
        self.queues.waiting.remove(req)
        req.phase = Phase.RUNNING
        self.queues.running.append(req)
        self.queues.running_ordered = False
        batch.append((req, q))
        return True

    def _admit_beams(self, req: Req, batch: Batch, budget: int, reserve: int) -> Optional[Batch]:
        """Admit the waiting beams of ``req``'s search together (a search steps only
        once all its live beams have computed), or none of them. Returns the
        beams admitted with their tokens (also appended to ``batch``), None when
        they do not fit."""
        assert req.beam is not None
        unit = [b for b in req.beam.beams if b.phase is Phase.WAITING]
        if len(self.queues.running) + len(unit) > self.config.max_running_requests:
            return None
        need = sum(b.seq_len - self.kv.match(b).length for b in unit)
        if self.queues.running and self.kv.available_slots() - need < reserve:
            return None
        admitted: Batch = []
        for i, b in enumerate(unit):
            match = self.kv.match(b, load=True)  # after the siblings' admission: what eviction left
            # a share of the budget each (a token at least): a retracted search larger than a step comes in chunks
            q = self._prefill_tokens(b, b.seq_len - match.length, max(1, budget // (len(unit) - i)))
            if q <= 0 or not self._admit_one(b, match, q, batch):
                for done, dq in admitted:  # back to waiting, their slots for this step not computed
                    batch.remove((done, dq))
                    self.queues.running.remove(done)
                    self.kv.truncate(done, len(done.slots) - dq)
                    self.kv.release(done)
                    done.phase = Phase.WAITING
                    self.queues.waiting.insert(0, done)
                return None
            admitted.append((b, q))
            budget -= q
        return admitted
