"""Beam search inside the step loop: a request's hypotheses are branches of the radix tree.

A beam request (``sampling_params.beam_width`` W > 1) runs as a `BeamGroup`
of up to W live hypotheses, each an ordinary `Req` of the running batch: it
computes one token per step, batched with every other request, and may be
retracted and readmitted like any. Its rows do not sample: the sampler
returns each one's best K continuations (`sampler.beam_candidates`, raw
log-probabilities; K = max(2, 1 + number of EOS ids) * W, as transformers
keeps), which wait on the request (``beam_candidates``) until every live
beam of the group has them. Then `BeamSearch.advance` takes one step of the
search, with transformers' rules (``generate(num_beams=W, do_sample=False)``):

- the K best continuations over all beams by cumulative log-probability;
- those among them that end (EOS, a stop token or string, ``max_new_tokens``,
  the context length) and rank in the first W become finished hypotheses,
  scored ``logprob / generated_length ** length_penalty``; the best W are kept;
- the best W that do not end are the next live beams. A beam chosen once
  takes its token itself; one chosen k > 1 times forks k - 1 new requests
  (`KVCacheManager.fork`): its whole pages go to the radix tree, which the
  children share under their own locks, and its partly filled last page is
  copied for each child (copy on write). A beam chosen by none is dropped and
  its private pages are freed at once (`release(keep_prefix=False)`);
- the search ends when ``early_stopping`` is True and W hypotheses finished;
  when it is False (transformers' heuristic) or "never" and the best live
  beam cannot beat the worst of W finished ones (for "never" with a positive
  ``length_penalty``, scored at ``max_new_tokens``); or when no continuation
  is left.

Its ``n`` best hypotheses are the request's outputs, one `TokenOutput` each
for the ids ``sample_rids(rid, n)``, sent when the search ends (a beam
request does not stream), with the score in ``TokenOutput.beam``.

Ownership: `BeamSearch` creates and drops the beams' `Req` objects and moves
them between the queues; their KV goes through `KVCacheManager` only (fork,
release); the copy-on-write copies run at once through ``copy_kv``: a step
with beam rows is completed before the next one is launched, so when its
results are processed no step is in flight to read or write the pool.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from radixrt.memory.kv_manager import KVCacheManager
from radixrt.requests.finish import FinishReason
from radixrt.requests.messages import TokenOutput
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.beam_state import BeamGroup, Hypothesis
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Phase, Req

# a hypothesis the search could not score (it never had a candidate): last
UNSCORED = float("-inf")


def held_slots(beams: list[Req]) -> int:
    """Distinct KV slots the hypotheses hold: each one's private slots, plus the
    tree's nodes on their paths counted once (a walk up from each one's node that
    stops at a node already counted: the work grows with the nodes where they
    parted, not with their tokens)."""
    total = 0
    seen: set[int] = set()
    for b in beams:
        total += len(b.slots) - b.tree_len
        node = b.last_node
        while node is not None and node.parent is not None and id(node) not in seen:
            seen.add(id(node))
            total += len(node.key)
            node = node.parent
    return total


class BeamSearch:
    def __init__(
        self,
        kv: KVCacheManager,
        queues: RequestQueues,
        copy_kv: Callable[[Sequence[int], Sequence[int]], None],
        finish_check: Callable[[Req, int], Optional[FinishReason]],
        eos_token_ids: Iterable[int],
        max_running_requests: int,
    ) -> None:
        """``copy_kv(src, dst)`` copies stored K/V between slots (the pool's);
        ``finish_check(req, token)``: the reason ``req`` would end if ``token``
        were its next output (the result processor's stop conditions)."""
        self.max_running_requests = max_running_requests
        self.kv = kv
        self.queues = queues
        self.copy_kv = copy_kv
        self.finish_check = finish_check
        self.eos_token_ids = frozenset(eos_token_ids)
        self._ready: list[BeamGroup] = []
        self.searches_finished = 0
        self.forks = 0
        self.copied_slots = 0
        self.requeued = 0  # searches sent back to waiting because a fork found no memory

    def check(self, prompt_len: int, sp: SamplingParams) -> None:
        """Raise ValueError for a beam request this server can never run: its beams
        run at once, and alone in the pool they must fit without any sharing."""
        if not sp.uses_beam_search:
            return
        W = sp.beam_width
        if W > self.max_running_requests:
            raise ValueError(f"beam_width {W} is more than this server runs at once ({self.max_running_requests})")
        need = prompt_len + W * (sp.max_new_tokens + self.kv.page_size)
        total = self.kv.allocator.total_slots
        if need > total:
            raise ValueError(
                f"a beam search of width {W} over {prompt_len} prompt tokens and {sp.max_new_tokens} new ones "
                f"may need {need} KV slots; this server has {total}"
            )

    def start(self, root: Req, out_rids: list[str]) -> BeamGroup:
        """Make ``root`` (a new request, not queued yet) the first beam of a search."""
        sp = root.sampling
        group = BeamGroup(
            rid=root.parent,  # the request's id (the root's own is f"{rid}#beam0")
            out_rids=out_rids,
            width=sp.beam_width,
            length_penalty=sp.length_penalty,
            early_stopping=sp.early_stopping,
            max_new_tokens=sp.max_new_tokens,
            # as transformers: max(2, 1 + the ids that end a hypothesis) candidates a beam, so that W of them
            # live on even when the likeliest all end
            candidates_per_beam=max(2, 1 + len(self.eos_token_ids | set(sp.stop_token_ids or ()))) * sp.beam_width,
            return_logprob=root.return_logprob,
            prompt_tokens=len(root.input_ids),
        )
        root.return_logprob = False  # its rows report candidates instead; the outputs carry the logprobs
        root.beam = group
        group.beams.append(root)
        return group

    def collect(self, req: Req, candidates: Optional[list[tuple[float, int]]]) -> None:
        """A beam's row gave its continuations (best first)."""
        group = req.beam
        assert group is not None and candidates is not None, "a beam row reports its candidates"
        req.beam_candidates = candidates
        if group.ready() and group not in self._ready:
            self._ready.append(group)

    def advance(self) -> tuple[list[TokenOutput], int]:
        """Take a search step for every group whose beams all reported; the outputs
        of the searches that ended, and how many ended."""
        outputs: list[TokenOutput] = []
        ended = 0
        ready, self._ready = self._ready, []
        for group in ready:
            if not group.ended and self._step(group):
                outputs += self._end(group, None)
                ended += 1
        return outputs, ended

    def end(self, req: Req, reason: FinishReason) -> list[TokenOutput]:
        """``req``, a beam, is ended from outside (aborted, refused, out of memory):
        the whole search ends with ``reason`` (it is out of the queues already or
        is taken out here). Outputs once per search: none when it had ended."""
        group = req.beam
        assert group is not None
        if group.ended:
            self._drop(req, keep_prefix=True)
            return []
        return self._end(group, reason)

    def stats(self) -> dict[str, int]:
        return {
            "beam_searches_finished": self.searches_finished,
            "beam_forks": self.forks,
            "beam_copied_slots": self.copied_slots,
            "beam_requeued": self.requeued,
        }

    # ------------------------------------------------------------------ one search step
    def _step(self, g: BeamGroup) -> bool:
        """One step of the search (transformers' order of updates); True when it ended."""
        beams = g.beams
        g.steps += 1
        # the pass just computed wrote its tokens' KV: the beams hold the most now
        g.peak_kv_slots = max(g.peak_kv_slots, held_slots(beams))
        n_gen = len(beams[0].output_ids) + 1  # generated length of every candidate
        K = g.candidates_per_beam
        cands = sorted(
            (
                (b.beam_logprob + lp, i, t, lp)
                for i, b in enumerate(beams)
                for lp, t in b.beam_candidates or ()
                if lp != float("-inf")
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )[:K]
        for b in beams:
            b.beam_candidates = None
        ends = [self.finish_check(beams[i], t) for _, i, t, _ in cands]
        if g.improvable and not (g.early_stopping is True and len(g.finished) >= g.width):
            for rank, ((total, i, t, lp), end) in enumerate(zip(cands, ends)):
                if end is not None and rank < g.width:
                    b = beams[i]
                    score = total / n_gen**g.length_penalty
                    g.finished.append(Hypothesis(b.output_ids + [t], total, score, end, b.beam_token_logprobs + [lp]))
            g.finished.sort(key=lambda h: -h.score)  # stable: an older hypothesis wins a tie
            del g.finished[g.width :]
        live = [c for c, end in zip(cands, ends) if end is None][: g.width]
        if g.improvable:
            hypothetical = g.max_new_tokens if g.early_stopping == "never" and g.length_penalty > 0 else n_gen
            best = live[0][0] / hypothetical**g.length_penalty if live else float("-inf")
            worst = g.finished[-1].score if len(g.finished) >= g.width else float("-inf")
            g.improvable = best > worst
        if not g.improvable or not live or (g.early_stopping is True and len(g.finished) >= g.width):
            return True
        self._branch(g, live)
        return False

    def _branch(self, g: BeamGroup, live: list[tuple[float, int, int, float]]) -> None:
        """Make ``live`` (score, parent index, token, logprob) the group's beams:
        parents chosen by none are dropped first (their memory serves the forks),
        a parent's first pick continues it, each further pick forks it."""
        old = g.beams
        picks: dict[int, list[tuple[float, int, float]]] = {}
        for total, i, t, lp in live:
            picks.setdefault(i, []).append((total, t, lp))
        for i, b in enumerate(old):
            if i not in picks:
                self._drop(b, keep_prefix=False)
        chosen: dict[int, list[Req]] = {}
        for i, choices in picks.items():
            parent = old[i]
            reqs = [self._fork(g, parent) for _ in choices[1:]]  # before the parent takes its own token
            chosen[i] = [parent, *reqs]
            for req, (total, t, lp) in zip(chosen[i], choices):
                req.output_ids.append(t)
                req.beam_logprob = total
                req.beam_token_logprobs.append(lp)
                if req.grammar is not None:
                    req.grammar.accept(t)
        taken: dict[int, int] = {}
        g.beams = []
        for _, i, _, _ in live:  # score order
            k = taken.get(i, 0)
            taken[i] = k + 1
            g.beams.append(chosen[i][k])
        self.queues.running_ordered = False
        if g.requeue:
            self._requeue(g)
        g.peak_kv_slots = max(g.peak_kv_slots, held_slots(g.beams))

    def _fork(self, g: BeamGroup, parent: Req) -> Req:
        """A new beam with ``parent``'s tokens and state. It shares the parent's KV
        when the parent holds it (running) and memory allows, and runs at once;
        otherwise it waits and is admitted as any request (its prefix from the tree)."""
        child = Req(
            rid=f"{g.rid}#beam{g.next_id}",
            input_ids=parent.input_ids,
            sampling=parent.sampling,
            seed=parent.seed,
            namespace=parent.namespace,
            arrival=parent.arrival,
            parent=parent.parent,
            group=parent.group,
            priority=parent.priority,
            urgency=parent.urgency,
            max_stop_bytes=parent.max_stop_bytes,
            output_ids=list(parent.output_ids),
            cached_tokens=parent.cached_tokens,
            admitted_once=True,
            grammar_future=parent.grammar_future,
            grammar=parent.grammar.fork() if parent.grammar is not None else None,
            beam=g,
            beam_logprob=parent.beam_logprob,
            beam_token_logprobs=list(parent.beam_token_logprobs),
            retractions=parent.retractions,
            lora_name=parent.lora_name,
            lora=parent.lora,
            lora_start=parent.lora_start,
            tree_limit=parent.tree_limit,
        )
        g.next_id += 1
        g.forks += 1
        self.forks += 1
        copies = self.kv.fork(parent, child) if parent.phase is Phase.RUNNING and parent.slots else None
        if copies is None:  # short of memory (or the parent waits): the search waits and is admitted as a unit
            self.queues.waiting.insert(0, child)
            g.requeue = True
            return child
        if copies:
            src, dst = zip(*copies)
            self.copy_kv(src, dst)
            g.copied_slots += len(copies)
            self.copied_slots += len(copies)
        child.phase = Phase.RUNNING
        self.queues.running.append(child)
        return child

    def _requeue(self, g: BeamGroup) -> None:
        """A beam could not be given its KV: the search's running beams go back to
        the waiting queue too (their computed prefixes stay in the tree), so that
        the planner admits all of them together (`BatchPlanner._admit_beams`)
        instead of some holding memory while they wait for the others."""
        g.requeue = False
        self.requeued += 1
        for b in g.beams:
            if b.phase is Phase.RUNNING:
                self.queues.running.remove(b)
                self.kv.release(b)
                b.phase = Phase.WAITING
                b.retractions += 1
                self.queues.waiting.insert(0, b)

    def _drop(self, req: Req, keep_prefix: bool) -> None:
        """Take a beam out of the queues (if still in one) and release its KV."""
        if req.beam is not None:
            req.beam.retractions = max(req.beam.retractions, req.retractions)
        if req.phase is not Phase.FINISHED:
            if req in self.queues.running or req in self.queues.waiting:
                self.queues.remove(req)
            req.phase = Phase.FINISHED
        if req.slots or req.last_node is not None:
            self.kv.release(req, keep_prefix=keep_prefix)

    # ------------------------------------------------------------------ the end
    def _end(self, g: BeamGroup, reason: Optional[FinishReason]) -> list[TokenOutput]:
        """End the search: its beams go (a finished search's KV stays in the tree),
        and its outputs are made: the ``n`` best hypotheses, or, when ``reason``
        (an abort) cuts it short, that reason with no tokens."""
        g.ended = True
        self.searches_finished += 1
        live = list(g.beams)
        for b in live:
            self._drop(b, keep_prefix=True)
        cached = live[0].cached_tokens if live else 0
        hyps = list(g.finished)
        if len(hyps) < len(g.out_rids):  # cut short: the best live beams stand in
            for b in live[: len(g.out_rids) - len(hyps)]:
                n = max(len(b.output_ids), 1)
                hyps.append(
                    Hypothesis(
                        list(b.output_ids),
                        b.beam_logprob,
                        b.beam_logprob / n**g.length_penalty if b.output_ids else UNSCORED,
                        FinishReason.length(len(b.output_ids)),
                        list(b.beam_token_logprobs),
                    )
                )
        outputs = []
        for rank, rid in enumerate(g.out_rids):
            hyp = hyps[rank] if rank < len(hyps) and reason is None else None
            tokens = hyp.output_ids if hyp is not None else []
            why = hyp.finish_reason if hyp is not None else reason or FinishReason.length(0)
            out = TokenOutput(rid, list(tokens), g.prompt_tokens, len(tokens), cached, why)
            out.num_retractions = g.retractions or None
            if hyp is not None:
                out.beam = g.describe(rank, hyp)
                if g.return_logprob:
                    out.output_token_logprobs = list(zip(hyp.token_logprobs, tokens))
            outputs.append(out)
        g.beams = []
        return outputs
