"""Speculative decoding drafted from the radix tree (``--speculative-algorithm RADIX``).

Before each step is planned, every running request that decodes gets a
*draft*: the tokens it will most likely produce next, proposed by the
`DraftIndex` (radixrt/memory/draft_index.py) from the token runs the radix
tree holds in the request's own cache namespace and from the request's own
prompt and output. The draft joins the request's sequence as ``draft_ids``;
the step computes it in one extend with the decode token before it and
samples at every position; the result processor keeps the draft's tokens
while they equal what was sampled there and then takes the model's own
token, exactly as for a grammar's jump-forward draft (results.py). So a
greedy request decodes the same tokens as without speculation, and a sampled
one the same distribution (a seeded one the same tokens: each position draws
with the seed and output index it would have had). Rejected tokens' KV is
freed in the same step; drafts never enter the radix tree.

Which draft tokens are worth computing is decided per step by the measured
`StepCost`: a token the request accepts with estimated probability ``p^j``
(``p``: the request's recent per-token acceptance) is added while it raises
the step's expected tokens per second, at what a token at that request's
context length costs (its attention reads the whole context). At batch 1 on
a CPU nearly any draft pays; in a large batch only confident ones do, and
none when they cost more than they save, so speculation turns itself off per
step.

Who speculates: running requests with no ``sampling_params.speculative =
False``, nothing in flight (the overlap scheduler is not used for their
steps), and a sampled token to continue from. A request with a grammar drafts
chains only, cut to the prefix its grammar allows (``_assign``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Optional

from radixrt.memory.prefix_cache import PrefixCache
from radixrt.scheduler.request import Req
from radixrt.scheduler.spec_cost import OnlineStepCost, StepCost, runs_fast_path
from radixrt.scheduler.spec_state import ServerCalibration, SpecState

# Draft tokens the index rates below this (estimated chance of acceptance) are not proposed; the
# cost model trims the rest per step.
MIN_PROB = 0.05


@dataclass
class SpecStats:
    """Server-wide totals (counters: they only grow)."""

    verify_steps: int = 0  # decode steps of speculating requests
    verify_tokens: int = 0  # tokens those steps produced (accepted drafts + the model's own)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    skipped_steps: int = 0  # steps where the cost model chose no draft at all (none could pay, or none proposed did)
    tree_drafts: int = 0  # drafts verified as a tree (some token with two or more children)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_verify_tokens": self.verify_tokens,
            "spec_drafted_tokens": self.drafted_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_skipped_steps": self.skipped_steps,
            "spec_tree_drafts": self.tree_drafts,
            # SGLang's name (its internal_states): tokens per verification
            "avg_spec_accept_length": self.verify_tokens / self.verify_steps if self.verify_steps else 0.0,
        }


@dataclass
class _Candidate:
    req: Req
    tokens: list[int]
    parents: list[int]  # a draft tree (draft_search.Draft): -1 for a child of the request's last token
    probs: list[float]  # the index's estimate that each token (and its ancestors) is accepted
    gains: list[float] = field(default_factory=list)  # the same, calibrated by the request's history
    children: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, p in enumerate(self.parents):
            self.children.setdefault(p, []).append(i)


class Speculator:
    """Drafts for the running requests, sized by the step cost model.

    Mutates only ``req.draft_ids`` (set before the planner runs; the planner
    may drop a draft it has no memory or budget for) and ``req.spec``.
    ``max_width``: most children a draft token may have (1: chains; more: a
    draft tree, verified with a tree attention mask)."""

    def __init__(
        self,
        tree: PrefixCache,
        cost: OnlineStepCost,
        max_draft_tokens: int,
        ngram_order: int,
        context_length: int,
        max_width: int = 1,
        graph_max_bs: int = 0,
        fast_path_tokens: int = 0,
    ) -> None:
        from radixrt.memory.draft_index import TREE_LENGTHS, DraftIndex

        self.index = DraftIndex(tuple(n for n in TREE_LENGTHS if n <= ngram_order) or (ngram_order,))
        if tree.stores_prefixes:
            tree.add_observer(self.index)
        self.cost = cost
        self.max_draft_tokens = max_draft_tokens
        self.max_width = max_width
        self.context_length = context_length
        self.graph_max_bs = graph_max_bs  # decode batches up to this size replay a CUDA graph (0: none)
        # steps of fewer token rows run the CPU's native decode stack, drafts included (0: none)
        self.fast_path_tokens = fast_path_tokens
        self.stats = SpecStats()
        self.calibration = ServerCalibration()

    def wants(self, req: Req) -> bool:
        """Whether ``req`` speculates (decided once, at admission)."""
        return req.sampling.speculative and req.sampling.max_new_tokens > 1

    def start(self, req: Req) -> None:
        from radixrt.memory.draft_index import OwnTokens

        if req.spec is None and self.wants(req):
            own = OwnTokens(req.input_ids)
            req.spec = SpecState(own, len(req.input_ids))

    def replays_graph(self, q_lens: list[int]) -> bool:
        """Whether a step of these token counts replays a decode CUDA graph or runs the native
        decode stack (see `runs_fast_path`)."""
        return runs_fast_path(q_lens, self.graph_max_bs, self.fast_path_tokens)

    def leaves_fast_path(self, q_lens: list[int]) -> bool:
        """Whether a step of these token counts runs eagerly where the runner has a faster path
        (the cost model's ``leaves_fast``)."""
        return (self.graph_max_bs > 0 or self.fast_path_tokens > 0) and not self.replays_graph(q_lens)

    # ------------------------------------------------------------------ drafting
    def draft(self, running: list[Req]) -> None:
        """Give the running requests this step's drafts (see the module docstring)."""
        rows = len(running)
        contexts = [len(r.slots) + 1 for r in running]  # where each request's step token sits
        attended = sum(contexts)
        # a fitted cost can reach 0 on a fast device
        plain = max(self.cost.seconds(rows, rows, attended, self.leaves_fast_path([1] * rows)), 1e-12)
        # a step with drafts leaves a decode CUDA graph; the native stack takes it below its tokens
        tokens = rows
        leaves = self._drafted_step_leaves(rows, tokens + 1)
        time = max(self.cost.seconds(rows, tokens, attended, leaves), 1e-12)
        expected = float(rows)
        # A draft token joins only while its gain exceeds expected * (its cost) / time, a bar that
        # rises with every token chosen: the bar before any is chosen bounds what is worth proposing,
        # so a batch where no draft can pay spends nothing on drafting.
        first_costs = [self._token_cost(c, tokens) for c in contexts]
        if min(first_costs, default=0.0) > 0 and expected * min(first_costs) / time >= 1.0:
            self.stats.skipped_steps += any(r.spec is not None for r in running)
            self._age_idle(running)
            return
        candidates, where = [], []
        for req, context, first in zip(running, contexts, first_costs):
            c = self._propose(req, expected * first / time)
            if c is not None:
                candidates.append(c)
                where.append(context)
        if not candidates:
            self._age_idle(running)
            return

        # draft tokens by marginal gain per second, decreasing: a request's draft token gains its
        # estimated acceptance (the index's path probability, calibrated by the request's own
        # history) and costs a token at its context where the step's tokens stand (the dense part's
        # cost per token rises with them); a token becomes a candidate once its parent is chosen,
        # so the chosen tokens of a request form a tree
        def key(i: int, j: int) -> tuple[float, int, int]:
            return (-candidates[i].gains[j] / self._token_cost(where[i], tokens), i, j)

        heap = [key(i, j) for i, c in enumerate(candidates) for j in c.children.get(-1, ())]
        heapq.heapify(heap)
        chosen: list[list[int]] = [[] for _ in candidates]
        while heap:
            _, i, j = heapq.heappop(heap)
            gain = candidates[i].gains[j]
            after = self._drafted_step_leaves(rows, tokens + 1)
            cost = self._token_cost(where[i], tokens) + (self.cost.leave_fast if after > leaves else 0.0)
            if gain * time <= expected * cost:  # throughput would drop (and would for every later one)
                break
            chosen[i].append(j)
            expected += gain
            time += cost
            tokens += 1
            leaves = after
            for child in candidates[i].children.get(j, ()):
                heapq.heappush(heap, key(i, child))
        # without drafts the step may replay its graph or run the native stack where with them it
        # would not: the drafts must beat that step
        if any(chosen) and expected / time <= rows / plain:
            chosen = [[] for _ in candidates]
        if not any(chosen):
            self.stats.skipped_steps += 1
        for c, nodes in zip(candidates, chosen):
            if nodes:
                self._assign(c, sorted(nodes))
        self._age_idle(running)

    def _age_idle(self, running: list[Req]) -> None:
        """Fade the calibration evidence of the requests that draft nothing this step, and
        the server's when none does (spec_state.IDLE_DECAY)."""
        specs = [r.spec for r in running if r.spec is not None]
        idle = [s for s in specs if not s.drafting]
        for spec in idle:
            spec.age()
        if idle and len(idle) == len(specs):
            self.calibration.age()

    def _token_cost(self, context: int, tokens: int) -> float:
        """What one more draft token at ``context`` adds to a step of ``tokens`` tokens
        (leaving the fast path is priced where a token makes the step leave it)."""
        return max(self.cost.token_seconds(context, tokens), 1e-12)

    def _drafted_step_leaves(self, rows: int, tokens: int) -> bool:
        """Whether a step of ``rows`` requests with drafts, ``tokens`` tokens in all, leaves the fast path."""
        return self.leaves_fast_path([tokens - rows + 1] + [1] * (rows - 1))

    @staticmethod
    def _assign(c: _Candidate, nodes: list[int]) -> None:
        """Make the draft's tokens ``nodes`` (indices into the candidate, closed
        under parents, increasing) the request's draft; a constrained request's
        grammar keeps only the prefix it allows of a chain (and records its masks)."""
        req = c.req
        new_index = {j: n for n, j in enumerate(nodes)}
        tokens = [c.tokens[j] for j in nodes]
        parents = [new_index.get(c.parents[j], -1) for j in nodes]
        if req.grammar is not None:
            tokens = req.grammar.take_draft(tokens)  # (a constrained request's drafts are chains)
        if tokens:
            assert req.spec is not None
            req.draft_ids = tokens
            req.spec.pending_expected = sum(c.probs[j] for j in nodes[: len(tokens)])
            req.spec.drafting = True
            chain = all(p == n - 1 for n, p in enumerate(parents))
            req.spec.parents = None if chain else parents

    def _propose(self, req: Req, bar: float = 0.0) -> Optional[_Candidate]:
        """``req``'s candidate draft: tokens whose calibrated gain can reach ``bar``."""
        spec = req.spec
        if spec is None or req.draft_ids or req.inflight_tokens:  # (a jump-forward draft goes first)
            return None
        n_in, n_out = len(req.input_ids), len(req.output_ids)
        if not n_out or len(req.slots) != n_in + n_out - 1:  # not a decoder with a sampled token
            return None
        if spec.synced < n_in + n_out:
            spec.own.extend(req.output_ids[spec.synced - n_in :])
            spec.synced = n_in + n_out
        room = self.context_length - 1 - n_in - n_out  # slots the draft's tokens may take
        # the longest path: the step's own token comes after the draft
        depth = min(self.max_draft_tokens, req.sampling.max_new_tokens - n_out - 1, room)
        if depth < 1:
            return None
        width = self.max_width if req.grammar is None else 1
        limit = min(depth * width, room)  # a tree may hold width x the longest path's tokens
        c = spec.calibration(self.calibration.ratio)
        min_prob = max(MIN_PROB, bar / c)
        if min_prob >= 1.0:
            return None
        draft = self.index.propose(req.namespace, spec.own, limit, width, min_prob, max_depth=depth)
        if not draft.tokens:
            return None
        return _Candidate(req, draft.tokens, draft.parents, draft.probs, [min(1.0, c * q) for q in draft.probs])

    def stats_dict(self) -> dict[str, Any]:
        """The counters, the server-wide calibration of the index's estimates (accepted
        over expected draft tokens), and the draft index's size (entries, tokens, bytes)."""
        return {
            **self.stats.to_dict(),
            "spec_calibration": round(self.calibration.ratio, 3),
            "spec_index": self.index.stats(),
        }

    def log_text(self) -> str:
        """The tail of the scheduler's info line: acceptance since start."""
        s = self.stats
        rate = s.accepted_tokens / s.drafted_tokens if s.drafted_tokens else 0.0
        return f", spec accept length {s.to_dict()['avg_spec_accept_length']:.2f} (drafts kept {100 * rate:.0f}%)"

    # ------------------------------------------------------------------ outcome
    def settle(self, req: Req, drafted: int, kept: int, produced: int) -> None:
        """Record one verification of ``req``: ``drafted`` draft tokens of which
        ``kept`` were accepted; the step produced ``produced`` tokens."""
        spec = req.spec
        assert spec is not None
        spec.verify_ct += 1
        self.stats.verify_steps += 1
        self.stats.verify_tokens += produced
        if not drafted:
            return
        spec.drafted += drafted
        spec.kept += kept
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += kept
        self.stats.tree_drafts += spec.parents is not None
        self.calibration.record(kept, spec.pending_expected)
        spec.record(kept)


# A tensor-parallel runner cannot run the probe forwards: a step whose cost is mostly fixed (the
# common case on one machine), so drafts pay unless the batch is large.
DEFAULT_COST = StepCost(fixed=1.0, per_row=0.0, per_token=0.02)


def build_speculator(config: Any, runner: Any, kv: Any, context_length: int) -> Optional[Speculator]:
    """The speculator ``config.speculative`` asks for (None: off), its cost model
    measured on ``runner`` with free slots of ``kv``'s allocator (returned free)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    allocator = kv.allocator
    need = StepCost.probe_slots_needed()
    if allocator.num_free_slots >= StepCost.long_probe_slots_needed():
        need = max(need, StepCost.long_probe_slots_needed())  # the long-context probes run too
    cost = OnlineStepCost(DEFAULT_COST)
    if getattr(runner, "tp", None) is None and allocator.num_free_slots >= need:
        slots = allocator.alloc_slots_for(need)
        assert slots is not None
        try:
            cost = StepCost.measure(runner, slots)
        finally:
            allocator.free_slots(slots)
    # the fixed-split (deterministic) attention reads no tree
    tree_ok = not config.execution.enable_deterministic_inference
    return Speculator(
        kv.tree,
        cost,
        spec.speculative_num_draft_tokens,
        spec.speculative_ngram_order,
        context_length,
        max_width=spec.speculative_tree_width if tree_ok else 1,
        graph_max_bs=runner.cuda_graph.max_bs if getattr(runner, "cuda_graph", None) is not None else 0,
        fast_path_tokens=getattr(runner, "fast_path_tokens", 0),
    )
