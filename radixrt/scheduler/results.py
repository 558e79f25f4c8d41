"""Phase 4 of a step: fold a finished step's output into its requests.

Sampled tokens are appended (verifying a jump-forward draft position by
position), stop conditions are checked token by token, prompt logprobs are
collected, and every request that produced something or finished gets a
`TokenOutput`: `ResultProcessor.process` returns them, in batch order.
(Prefill chunks went to the radix tree when they were launched, see
`Scheduler._launch`.)

With overlap on, this runs one step late: by then the next step is already
launched, and a request of this step may have been aborted (it is skipped),
retracted (its tokens are kept; it recomputes its KV when readmitted) or have
finished in the step just launched (the extra token computed for it is
dropped with its KV).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from radixrt.memory.kv_manager import KVCacheManager
from radixrt.requests.finish import FinishReason
from radixrt.requests.messages import TokenOutput
from radixrt.sampling import stop_regex
from radixrt.sampling.sampler import SampleResult
from radixrt.scheduler.constrained import ConstrainedDecoding, drop_draft
from radixrt.scheduler.hidden_capture import file_rows, keep_branch_rows, keep_rows, pack_rows
from radixrt.scheduler.inputs import StepInputs
from radixrt.scheduler.launcher import PromptScores, StepOutput
from radixrt.scheduler.planner import Batch
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Phase, Req
from radixrt.scheduler.speculative import Speculator

if TYPE_CHECKING:
    from radixrt.scheduler.beam import BeamSearch

logger = logging.getLogger(__name__)
# --enable-request-time-stats-logging sets it to INFO (Scheduler.__init__)
time_stats_logger = logging.getLogger("radixrt.request_time_stats")


def finish_request(req: Req, reason: FinishReason, kv: KVCacheManager) -> TokenOutput:
    """End a request that is in neither queue any more: its draft is dropped, its
    KV released (its prefix stays in the tree), its phase FINISHED; returns its
    last `TokenOutput`, which carries ``reason``."""
    drop_draft(req)
    if req.slots or req.last_node is not None:
        kv.release(req)
    req.finish_reason = reason
    req.phase = Phase.FINISHED
    if time_stats_logger.isEnabledFor(logging.INFO):
        log_time_stats(req)
    return token_output(req)


def log_time_stats(req: Req) -> None:
    """SGLang's --enable-request-time-stats-logging line for a finished ``req``: its token counts and
    where its time went (waiting for admission, to its first token, decoding, in all)."""
    now = time.monotonic()
    admitted = req.started_at if req.started_at is not None else now
    first = req.first_token_at if req.first_token_at is not None else now
    time_stats_logger.info(
        "Req time stats: rid=%s prompt_tokens=%d cached_tokens=%d output_tokens=%d finish=%s retractions=%d "
        "queue=%.4fs to_first_token=%.4fs decode=%.4fs e2e=%.4fs",
        req.rid,
        len(req.input_ids),
        req.cached_tokens,
        len(req.output_ids),
        req.finish_reason.type if req.finish_reason is not None else "abort",
        req.retractions,
        admitted - req.queued_at,
        first - admitted,
        now - first,
        now - req.queued_at,
    )


@dataclass
class StepResults:
    """What processing one step's output gave."""

    outputs: list[TokenOutput]  # in batch order: each request's news, or its last output when it finished
    finished: int  # how many of the batch's requests finished here


class ResultProcessor:
    def __init__(
        self,
        kv: KVCacheManager,
        queues: RequestQueues,
        constrained: ConstrainedDecoding,
        tokenizer: Any,
        eos_token_ids: set[int],
        context_length: int,
        enable_jump_forward: bool,
        speculator: Optional[Speculator] = None,
    ) -> None:
        """``tokenizer``: decodes output tails for stop strings (a Hugging Face
        tokenizer; its fast backend's ``decode`` when it has one)."""
        self.kv = kv
        self.queues = queues
        self.constrained = constrained
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.enable_jump_forward = enable_jump_forward
        self.speculator = speculator
        # the fast tokenizer's own decode: stop strings are checked every step
        self._decode: Callable[..., str] = getattr(tokenizer, "backend_tokenizer", tokenizer).decode
        self.generated_tokens = 0
        self.beams: "Optional[BeamSearch]" = None  # set by the scheduler: takes beam rows' candidates
        # seconds of stop_regex search this step, per request (its n samples and drafts share one limit)
        self.regex_spent: dict[str, float] = {}

    def process(self, batch: Batch, inputs: StepInputs, output: StepOutput) -> StepResults:
        """Fold ``output`` into the batch's requests, request by request in batch
        order: take its samples, then end it (out of the queues, KV released) or
        report what it produced; then the beam searches whose hypotheses all
        reported take their step (beam.py). Returns the outputs, in batch order
        (the searches' after the rows')."""
        for job, scores in zip(inputs.prompt_jobs, output.prompt_scores):
            req = batch[job.batch_index][0]
            if req.phase is Phase.RUNNING and req.retractions == job.retractions:
                self._add_prompt_logprobs(req, scores, inputs.computed_to(job.batch_index))
        for hidden_job, rows in zip(inputs.hidden_jobs, output.hidden_rows):
            req = batch[hidden_job.batch_index][0]
            if req.phase is Phase.RUNNING and req.retractions == hidden_job.retractions:
                file_rows(req, hidden_job, rows)
        sample = output.sample
        self.regex_spent.clear()
        outputs: list[TokenOutput] = []
        one_token_decoders = finished = 0  # running rows that decoded exactly one token; rows finished here
        ends = inputs.kv_lens if inputs.position_offsets is None else list(map(inputs.computed_to, range(len(batch))))
        for (req, q), first, computed_to in zip(batch, inputs.sample_starts, ends):
            if first >= 0:
                req.inflight_tokens -= 1
                if req.phase is Phase.FINISHED:
                    continue
                assert sample is not None, "a step with sampling rows has a sample result"
                if req.beam is not None and self.beams is not None:  # its search steps once all its beams report
                    self.beams.collect(req, sample.beam_candidates[first] if sample.beam_candidates else None)
                    continue
                if req.draft_ids or req.grammar is not None or req.spec is not None:
                    self._take_samples(req, sample, first)
                else:  # a plain row (most rows): its one token, no draft to verify or grammar to advance
                    if q == 1 and req.phase is Phase.RUNNING:
                        one_token_decoders += 1
                    self._append_token(req, sample.token_ids[first], sample, first)
            elif req.phase is Phase.FINISHED:
                continue
            elif req.finish_reason is None and req.prefill_only and computed_to == req.seq_len:
                req.finish_reason = FinishReason.length(0)
            if req.finish_reason is not None:
                self.queues.remove(req)
                outputs.append(finish_request(req, req.finish_reason, self.kv))
                finished += 1
            elif req.report_due:
                outputs.append(token_output(req))
        for hidden_job in inputs.hidden_jobs:  # rows past what a request kept (a rejected draft's) go
            keep_rows(batch[hidden_job.batch_index][0])
        if self.beams is not None:
            searched, ended = self.beams.advance()
            outputs += searched
            finished += ended
        # Unless every row was a running one-token decoder and every running request is one of
        # them, some running request's order key moved differently from the others'.
        if one_token_decoders != len(batch) or len(self.queues.running) != one_token_decoders - finished:
            self.queues.running_ordered = False
        return StepResults(outputs, finished)

    # ------------------------------------------------------------------ prompt logprobs
    @staticmethod
    def _add_prompt_logprobs(req: Req, scores: PromptScores, computed_to: int) -> None:
        """Collect one chunk's scores; the list is complete once the prompt's last chunk ran."""
        req.prompt_logprob_acc.extend(scores)
        if computed_to >= len(req.input_ids):
            acc = req.prompt_logprob_acc
            # the token at logprob_start_len comes first, with no logprob (SGLang's list; clients
            # such as its select() average the entries that have one)
            pairs: list = [(None, req.input_ids[req.logprob_start_len])]
            tops: list = [None]
            req.input_logprobs = pairs + [(lp, t) for lp, t, _, _, _ in acc]
            req.input_top_logprobs = tops + [tp for _, _, tp, _, _ in acc]
            req.input_token_ranks = tops + [rank for _, _, _, _, rank in acc]
            if req.token_ids_logprob:
                req.input_token_ids_logprobs = tops + [by_id for _, _, _, by_id, _ in acc]

    # ------------------------------------------------------------------ sampled tokens
    def _take_samples(self, req: Req, result: SampleResult, first: int) -> None:
        """Append the tokens sampled for ``req`` from its rows ``first..first+k``.

        Without a draft (k == 0) that is one token. With one (jump-forward's
        or speculative decoding's), draft tokens are
        kept while they equal what was sampled at their position; the first
        sampled token that differs (or the token after a fully kept draft) is
        the model's own and ends the step. KV computed for the rejected rest is
        dropped and the matcher rolled back over it. Stop conditions are
        checked token by token, as decoding one token per step would."""
        draft = req.draft_ids
        state = req.grammar
        n_out = len(req.output_ids)
        kept = 0
        speculated = req.spec is not None and req.spec.drafting  # else a grammar's jump-forward draft, or none
        parents = req.spec.parents if req.spec is not None else None
        if not draft:
            self._take_token(req, result, first)
        elif parents is not None:
            kept = self._take_tree(req, result, first, draft, parents)
        else:
            req.draft_ids = []
            base = len(req.input_ids) + len(req.output_ids)  # position of draft[0]
            kept = 0
            tokens = result.token_ids
            while kept < len(draft) and tokens[first + kept] == draft[kept]:
                self._append_token(req, draft[kept], result, first + kept)  # the matcher accepted it with the draft
                kept += 1
                if req.finish_reason is not None:
                    break
            if state is not None:  # the grammar rolls back over the rejected rest
                state.settle_draft(kept)
            if state is not None and not speculated:  # a jump-forward draft
                self.constrained.next_draft_limit(req, len(draft), kept)
                self.constrained.kept += kept
            if req.finish_reason is None:  # else it finished inside the draft
                self._take_token(req, result, first + kept)
            self.kv.truncate(req, base + kept)
        if req.spec is not None and n_out and self.speculator is not None:  # a decode step: it verified a draft
            drafted = len(draft) if speculated else 0
            self.speculator.settle(req, drafted, kept if speculated else 0, len(req.output_ids) - n_out)
        if req.finish_reason is None and state is not None and self.enable_jump_forward:
            self.constrained.propose_draft(req)

    def _take_tree(self, req: Req, result: SampleResult, first: int, draft: list[int], parents: list[int]) -> int:
        """`_take_samples` for a speculative draft tree (rows: ``first`` samples after
        the request's last token, ``first + 1 + i`` after draft token ``i``): from the
        top, the child whose token equals what was sampled after its parent is
        kept, until none does; that sample is the model's own token. The kept
        branch's KV becomes the sequence's next positions and the rest is freed.
        Returns the number of draft tokens kept."""
        req.draft_ids = []
        base = len(req.input_ids) + len(req.output_ids)  # sequence index of draft[0]
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        tokens = result.token_ids
        node = -1
        branch: list[int] = []
        while True:
            row = first + 1 + node
            sampled = tokens[row]
            nxt = next((c for c in children.get(node, ()) if draft[c] == sampled), None)
            if nxt is None:
                self._take_token(req, result, row)
                break
            self._append_token(req, sampled, result, row)
            branch.append(nxt)
            node = nxt
            if req.finish_reason is not None:  # it finished inside the draft
                break
        self.kv.keep_branch(req, base, branch)
        keep_branch_rows(req, base, branch)  # the branch's hidden rows too, where the request asked
        return len(branch)

    def _take_token(self, req: Req, result: SampleResult, i: int) -> None:
        """Append the model's own token of row ``i`` (its matcher holds no draft)."""
        token = result.token_ids[i]
        if req.grammar is not None and not req.grammar.accept(token):
            # the mask allowed no token (a grammar with no text the vocabulary can write from here):
            # the sampled token is not the grammar's, so it is not output
            logger.warning("request %s: its grammar allows no token after %d", req.rid, len(req.output_ids))
            where = "at the start" if not req.output_ids else f"after {len(req.output_ids)} tokens"
            req.finish_reason = FinishReason.abort(
                f"the grammar allows no token {where}: it matches no text this model's vocabulary can write",
                status_code=400,
            )
            return
        self._append_token(req, token, result, i)

    def _append_token(self, req: Req, token: int, result: SampleResult, i: int) -> None:
        """Append ``token``, sampled in row ``i`` of ``result``, and check the stop conditions."""
        if not req.output_ids:
            req.first_token_at = time.monotonic()
        req.output_ids.append(token)
        req.unsent_ids += 1
        self.generated_tokens += 1
        if req.return_logprob:
            logprob = result.logprobs[i] if result.logprobs is not None else None
            assert logprob is not None, "the sampler gives a logprob to every row that asks for one"
            req.unsent_output_logprobs.append((logprob, token))
            if req.top_logprobs_num:
                req.unsent_top_logprobs.append((result.top_logprobs[i] if result.top_logprobs else None) or [])
            if req.token_ids_logprob:
                by_id = result.token_ids_logprobs
                req.unsent_token_ids_logprobs.append((by_id[i] if by_id else None) or [])
        req.finish_reason = self._check_finish(req, token)

    def candidate_finish(self, req: Req, token: int) -> Optional[FinishReason]:
        """Why ``req`` would end if ``token`` were its next output (None: it would
        not); ``req`` is left as it was (a beam search's candidate)."""
        req.output_ids.append(token)
        try:
            return self._check_finish(req, token)
        finally:
            req.output_ids.pop()

    def _check_finish(self, req: Req, token: int) -> Optional[FinishReason]:
        sp = req.sampling
        n_out = len(req.output_ids)
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason.stop(token)  # the grammar is complete and accepted a stop token
        if n_out >= sp.min_new_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                return FinishReason.stop(token)
            if sp.stop_token_ids and token in sp.stop_token_ids:
                return FinishReason.stop(token)
            if sp.stop or sp.stop_regex:
                stops, regexes = sp.stop or (), sp.stop_regex or ()
                # Decode only the tail that can contain a newly completed stop string or regex match:
                # a token is at least one byte of text, and a character up to four tokens.
                n_tail = req.max_stop_bytes + 8
                if regexes:
                    n_tail = max(n_tail, stop_regex.window_tokens(regexes))
                tail_ids = req.output_ids[-n_tail:]
                tail = self._decode(tail_ids, skip_special_tokens=False)
                start = 0
                if n_out - len(tail_ids) + 1 < sp.min_new_tokens:
                    # the tail holds tokens min_new_tokens kept from stopping: only an occurrence this
                    # token completed counts (every earlier token was checked when it came otherwise)
                    before = self._decode(tail_ids[:-1], skip_special_tokens=False).rstrip("\ufffd")
                    start = len(before)
                for s in stops:
                    if tail.find(s, max(0, start - len(s) + 1)) >= 0:
                        return FinishReason.stop(s)
                if regexes:
                    new_chars = len(self._decode([token], skip_special_tokens=False))
                    spent = self.regex_spent.get(req.parent, 0.0)
                    life_left = stop_regex.life_budget_s(n_out) - req.stop_regex_cpu_s
                    start_s = time.thread_time()  # CPU time, as the budget (stop_regex.search)
                    try:
                        whole = len(tail_ids) == n_out
                        hit = stop_regex.search(regexes, tail, whole, new_chars, spent, start, life_left)
                    except stop_regex.SearchTimeout as e:
                        logger.warning("request %s: %s", req.rid, e)
                        return FinishReason.abort(str(e), status_code=400)
                    finally:
                        took = time.thread_time() - start_s
                        self.regex_spent[req.parent] = spent + took
                        req.stop_regex_cpu_s += took
                    if hit is not None:
                        return FinishReason.stop(hit)  # SGLang reports the pattern
        if n_out >= sp.max_new_tokens:
            return FinishReason.length(sp.max_new_tokens)
        if len(req.input_ids) + n_out + len(req.draft_ids) >= self.context_length:  # req.seq_len, inlined
            return FinishReason.length(n_out)
        return None


def token_output(req: Req) -> TokenOutput:
    """The request's news since its last TokenOutput (and its finish reason);
    the request's unsent deltas are handed over and reset."""
    n_out = len(req.output_ids)
    new_ids = req.output_ids[n_out - req.unsent_ids :] if req.unsent_ids else []
    # Positional (one is built per request per step; keyword arguments cost twice as much):
    # rid, new_token_ids, prompt_tokens, completion_tokens, cached_tokens, finish_reason,
    # output_token_logprobs, output_top_logprobs.
    out = TokenOutput(
        req.rid,
        new_ids,
        len(req.input_ids),
        n_out,
        req.cached_tokens,
        req.finish_reason,
        req.unsent_output_logprobs,
        req.unsent_top_logprobs,
    )
    if req.spec is not None:
        out.spec_verify_ct = req.spec.verify_ct
        out.spec_drafts = (req.spec.drafted, req.spec.kept)
    if req.retractions:
        out.num_retractions = req.retractions
    if req.kv_budget is not None and req.finish_reason is not None:
        out.kv_budget = req.kv_budget.describe()
    if req.hidden_rows is not None and req.finish_reason is not None:
        out.hidden_states = pack_rows(req)
    if req.cache_info is not None:  # sent once, with the first output after admission
        out.cache_info, req.cache_info = req.cache_info, None
    if req.input_logprobs is not None and not req.input_logprobs_sent:
        out.input_token_logprobs = req.input_logprobs
        out.input_top_logprobs = req.input_top_logprobs
        out.input_token_ids_logprobs = req.input_token_ids_logprobs
        out.input_token_ranks = req.input_token_ranks
        req.input_logprobs_sent = True
    if req.token_ids_logprob:
        out.output_token_ids_logprobs, req.unsent_token_ids_logprobs = req.unsent_token_ids_logprobs, []
    req.unsent_ids = 0
    req.unsent_output_logprobs = []
    req.unsent_top_logprobs = []
    return out
