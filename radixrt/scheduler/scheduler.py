"""Cache-aware continuous batching.

One `Scheduler` serves both transports: the in-process Engine feeds it from a
thread with queues, the server's scheduler process from ZMQ (see
`event_loop`). It knows nothing of HTTP.

Every step re-forms the batch: running requests take one token each (decode)
or their next prefill chunk, then waiting requests are admitted in policy
order while the step's token budget and KV memory last. A request's step
computes tokens ``seq[len(slots):len(slots)+q]``; once all of ``seq`` has KV,
the last position's logits sample the next token. Prefill, chunked prefill,
decode and recompute after retraction are all this one mechanism.

Constrained decoding (grammar.py): a request with a regex, JSON schema or EBNF
grammar waits in the queue until its grammar is compiled (on the grammar
backend's thread; other requests keep running), then carries an xgrammar
matcher. Every step fills the bitmasks of the constrained rows and the
sampler applies them; the matcher accepts each sampled token and the request
stops when it terminates. With ``enable_jump_forward``, the text a grammar
forces is appended as a draft that the next step computes as one extend and
verifies position by position, so outputs equal token-by-token decoding.
"""
from __future__ import annotations

import concurrent.futures
import logging
import random
import time
from typing import Any, Callable, Optional

import torch

from radixrt.config import EngineConfig
from radixrt.memory.kv_manager import KVCacheManager
from radixrt.memory.kv_pool import PageAllocator
from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import Limits, sample_rids, validate_prompt
from radixrt.requests.messages import (
    AbortReq, ControlReply, FlushCacheReq, GenerateReq, StatsReq, TokenBatch, TokenOutput,
)
from radixrt.sampling.grammar import GrammarBackend, grammar_key, new_bitmask
from radixrt.executor.model_runner import ModelRunner
from radixrt.memory.radix_cache import RadixCache
from radixrt.scheduler.request import Phase, Req
from radixrt.sampling.sampler import SamplingRow, token_logprobs
from radixrt.scheduler.policy import order_waiting

logger = logging.getLogger(__name__)

# Reserve for running requests' future decode tokens, as a fraction of their
# remaining max_new_tokens; rises after a retraction, decays while all is well.
INIT_NEW_TOKEN_RATIO = 0.5
RESERVE_CAP_PER_REQUEST = 4096  # a request's share of the reserve is capped (as SGLang does)
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
PROMPT_LOGITS_BLOCK = 256  # rows of prompt logits materialized at once
MAX_DRAFT_TOKENS = 256  # longest jump-forward draft appended at once
GRAMMAR_WAIT_S = 0.01  # idle wait for a compiling grammar when nothing else can run


class Scheduler:
    def __init__(self, config: EngineConfig, runner: Optional[ModelRunner] = None) -> None:
        self.config = config
        self.runner = runner or ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.context_length = self.runner.context_length
        mc = self.runner.model_config
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.vocab_size = mc.vocab_size
        allocator = PageAllocator(self.runner.num_pages, config.page_size)
        tree = RadixCache(allocator, page_size=config.page_size, disable=config.disable_radix_cache)
        self.kv = KVCacheManager(allocator, tree)
        self.sampler = self.runner.create_sampler(mc.vocab_size, self.eos_token_ids)
        self.rng = random.Random(config.random_seed)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.arrivals = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.pending_outputs: list[TokenOutput] = []
        self.counters = {
            "steps": 0, "retractions": 0, "prompt_tokens_computed": 0, "generated_tokens": 0,
            "requests_finished": 0, "peak_kv_used_slots": 0,
            # constrained decoding: draft tokens proposed by jump-forward, and
            # kept after verification (each kept token is a decode step saved)
            "jump_forward_proposed": 0, "jump_forward_tokens": 0,
        }
        self._grammars: Optional[GrammarBackend] = None
        self._log_window = (time.perf_counter(), 0)
        self.max_stop_len = 0

    # ------------------------------------------------------------------ intake
    def validate(self, input_ids: list[int], sampling) -> None:
        """Raise ValueError for a request that can never be served (the front door's checks)."""
        validate_prompt(input_ids, sampling, Limits(
            self.context_length, self.kv.allocator.num_pages * self.config.page_size, self.vocab_size))

    @property
    def grammars(self) -> GrammarBackend:
        """The grammar compiler and cache, created on first use."""
        if self._grammars is None:
            self._grammars = GrammarBackend(
                self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                cache_size=self.config.grammar_cache_size,
            )
        return self._grammars

    def close(self) -> None:
        """Stop background work (grammar compilation)."""
        if self._grammars is not None:
            self._grammars.shutdown()

    def add_request(self, msg: GenerateReq) -> None:
        try:
            self.validate(msg.input_ids, msg.sampling)
        except ValueError as e:
            self._emit_abort(msg.rid, len(msg.input_ids), str(e))
            return
        key = grammar_key(msg.sampling)
        grammar_future = self.grammars.compile_async(key) if key is not None else None
        for i, rid in enumerate(sample_rids(msg.rid, msg.sampling.n)):
            base_seed = msg.sampling.seed
            seed = self.rng.getrandbits(62) if base_seed is None else base_seed + i
            req = Req(
                rid=rid, input_ids=list(msg.input_ids), sampling=msg.sampling, seed=seed,
                return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
                top_logprobs_num=msg.top_logprobs_num, namespace=msg.cache_salt, arrival=self.arrivals,
                grammar_future=grammar_future,
            )
            self.arrivals += 1
            self.waiting.append(req)
        stops = msg.sampling.stop or []
        self.max_stop_len = max([self.max_stop_len] + [len(s) for s in stops])

    def abort(self, rid: str) -> None:
        """Abort one request (or all, for rid ""), at any stage; its KV is released."""
        def hit(r: Req) -> bool:
            return rid == "" or r.rid == rid or r.rid.startswith(rid + "-")

        for r in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(r)
            self._finish(r, FinishReason.abort("aborted"))
        for r in [r for r in self.running if hit(r)]:
            self.running.remove(r)
            self._finish(r, FinishReason.abort("aborted"))

    def flush_cache(self) -> bool:
        """Drop every cached prefix. Only when nothing is running (like SGLang)."""
        if self.running or self.waiting:
            return False
        self.kv.tree.reset()
        self.kv.tree.reset_stats()
        return True

    def handle(self, msg: Any) -> Optional[ControlReply]:
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            return ControlReply("flush_cache", ok=self.flush_cache())
        elif isinstance(msg, StatsReq):
            return ControlReply("stats", payload=self.stats())
        else:
            raise TypeError(f"unknown scheduler message {type(msg).__name__}")
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ loop
    def event_loop(
        self,
        recv: Callable[[bool], list[Any]],
        send: Callable[[Any], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Serve until ``should_stop()``: ``recv(block)`` returns incoming messages
        (blocking only while idle); ``send`` ships TokenBatch and ControlReply."""
        while not should_stop():
            for msg in recv(not self.has_work() and not self.pending_outputs):
                reply = self.handle(msg)
                if reply is not None:
                    send(reply)
            outputs = self.step()
            if outputs:
                send(TokenBatch(outputs))

    def step(self) -> list[TokenOutput]:
        """Run one scheduling step and one forward; return what requests produced."""
        batch = self._schedule()
        if batch:
            self._run_batch(batch)
            self.counters["steps"] += 1
            self._log_step(batch)
            if self.config.debug_check_invariants:
                self.check_invariants()
        elif self.waiting and not self.running:
            self._wait_for_grammars()
        out, self.pending_outputs = self.pending_outputs, []
        return out

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> list[tuple[Req, int]]:
        self._resolve_grammars()
        batch: list[tuple[Req, int]] = []
        budget = max(self.config.chunked_prefill_size, 1)
        # Running requests first: decoders (one token each, or a token and its
        # draft), then unfinished prefills.
        # Retraction victims come from the end: fewest outputs, longest prompts.
        self.running.sort(key=lambda r: (
            r.seq_len - len(r.draft_ids) - len(r.slots) > 1, -len(r.output_ids), len(r.input_ids)))
        queue = list(self.running)
        while queue:
            req = queue.pop(0)
            if req.draft_ids and req.seq_len - len(req.slots) > max(budget, 1):
                self._drop_draft(req)  # a draft is computed in one piece or not at all
            need = req.seq_len - len(req.slots)
            q = 1 if need == 1 else min(need, budget)
            if q <= 0:
                continue
            while not self.kv.extend(req, q):
                if req.draft_ids:  # short of memory: decode one token rather than retract anyone
                    self._drop_draft(req)
                    need = req.seq_len - len(req.slots)
                    q = 1 if need == 1 else min(need, budget)
                    continue
                victim = queue.pop() if queue else None
                if victim is None:
                    if batch:  # retract this one; the others keep running
                        victim = req
                    else:
                        self.running.remove(req)
                        self._finish(req, FinishReason.abort("out of KV memory for a single request"))
                        break
                self._retract(victim)
                if victim is req:
                    break
            else:
                batch.append((req, q))
                budget -= q
        self._admit(batch, budget)
        return batch

    def _retract(self, req: Req) -> None:
        """Release a running request's KV (its prefix stays in the tree) and re-queue it.
        Its output and grammar matcher stay; a pending draft is dropped."""
        self.running.remove(req)
        self._drop_draft(req)
        self.kv.release(req)
        if req.input_logprobs is None:
            req.prompt_logprob_acc = []
        req.phase = Phase.WAITING
        req.retractions += 1
        self.waiting.insert(0, req)
        self.counters["retractions"] += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        logger.info("retracted %s (%d tokens) under KV pressure", req.rid, req.seq_len)

    def _remaining_tokens(self, req: Req) -> int:
        return min(max(req.sampling.max_new_tokens - len(req.output_ids), 0), RESERVE_CAP_PER_REQUEST)

    def _decode_reserve(self) -> int:
        return int(sum(self._remaining_tokens(r) for r in self.running) * self.new_token_ratio)

    def _admit(self, batch: list[tuple[Req, int]], budget: int) -> None:
        if not self.waiting or budget <= 0:
            return
        ordered = order_waiting(self.config.schedule_policy, self.waiting, self.kv.match)
        # Prefixes being computed in this step (or by an unfinished chunked prefill):
        # a request sharing a long uncached prefix with one of them waits a step
        # and then reads that prefix from the tree instead of computing it again.
        inflight = RadixCache(None, page_size=1)
        for r, q in batch:
            if q > 1:
                inflight.insert(r.seq, [0] * r.seq_len)
        reserve = self._decode_reserve()
        threshold = self.config.in_batch_prefix_threshold
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.grammar_pending:
                continue  # its grammar is still compiling
            match = self.kv.match(req)
            if not self.kv.tree.disable:
                shared = inflight.match_prefix(req.seq[: req.max_prefix_len], record_stats=False).length
                if shared - match.length >= threshold:
                    continue
            extend = req.seq_len - match.length
            if req.draft_ids and extend > budget:
                self._drop_draft(req)  # a draft is computed in one piece or not at all
                extend = req.seq_len - match.length
            q = min(extend, budget)
            if self.running and self.kv.available_slots() - q < reserve:
                break
            self.kv.admit(req, match)
            if not self.kv.extend(req, q):
                self.kv.release(req)
                break
            if not req.admitted_once:
                req.cached_tokens = match.length
                req.admitted_once = True
                self.kv.record_admission(req, match.length)
            self.waiting.remove(req)
            req.phase = Phase.RUNNING
            self.running.append(req)
            batch.append((req, q))
            budget -= q
            reserve += int(self._remaining_tokens(req) * self.new_token_ratio)
            inflight.insert(req.seq, [0] * req.seq_len)

    # ------------------------------------------------------------------ forward + sampling
    def _run_batch(self, batch: list[tuple[Req, int]]) -> None:
        input_ids: list[int] = []
        seq_slots: list[list[int]] = []
        q_lens: list[int] = []
        for req, q in batch:
            start = len(req.slots) - q
            input_ids.extend(req.seq[start:start + q])
            seq_slots.append(req.slots)
            q_lens.append(q)
        hidden = self.runner.forward(input_ids, seq_slots, q_lens)

        rows: list[int] = []
        samplers: list[tuple[Req, int]] = []  # (request, index of its first row in rows)
        offset = 0
        for req, q in batch:
            start = len(req.slots) - q
            if start < len(req.input_ids):
                self.counters["prompt_tokens_computed"] += min(q, len(req.input_ids) - start)
            if req.wants_prompt_logprobs and req.input_logprobs is None:
                self._prompt_logprobs(req, hidden[offset:offset + q], start)
            if len(req.slots) == req.seq_len and not req.prefill_only:
                # One row per draft token and one after them: the last k+1 positions.
                k = len(req.draft_ids)
                assert q > k, "a draft must be computed in the step that verifies it"
                samplers.append((req, len(rows)))
                rows.extend(range(offset + q - 1 - k, offset + q))
            offset += q

        if samplers:
            logits = self.runner.logits(hidden[rows])
            sampling_rows, bitmask, masked_rows = self._sampling_inputs(samplers)
            result = self.sampler.sample(logits, sampling_rows, bitmask, masked_rows)
            for req, first in samplers:
                self._take_samples(req, result, first)

        for req, q in batch:
            if req.finish_reason is None and req.prefill_only and len(req.slots) == req.seq_len:
                req.finish_reason = FinishReason.length(0)
            if req.finish_reason is not None:
                self.running.remove(req)
                self._finish(req, req.finish_reason)
            else:
                if q > 1:
                    self.kv.cache_prefix(req)
                if req.unsent_ids:
                    self._emit(req)
        used = self.kv.allocator.num_pages * self.config.page_size - self.kv.allocator.num_free_slots
        self.counters["peak_kv_used_slots"] = max(self.counters["peak_kv_used_slots"], used)
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def _sampling_row(self, req: Req, output_ids: Optional[list[int]] = None) -> SamplingRow:
        return SamplingRow(
            params=req.sampling, seed=req.seed, output_ids=req.output_ids if output_ids is None else output_ids,
            prompt_ids=req.input_ids, top_logprobs_num=req.top_logprobs_num, return_logprob=req.return_logprob,
        )

    def _sampling_inputs(
        self, samplers: list[tuple[Req, int]]
    ) -> tuple[list[SamplingRow], Optional[torch.Tensor], list[int]]:
        """Sampling rows for this step and the grammar bitmask of the constrained ones.

        A request with a draft of k tokens has k+1 rows: row j samples output
        index ``len(output_ids) + j`` as if the draft's first j tokens were
        already output (same penalties, same random draw as a decode step there).
        """
        rows: list[SamplingRow] = []
        masked: list[tuple[int, Req, int]] = []  # (row, request, draft position)
        for req, _ in samplers:
            k = len(req.draft_ids)
            for j in range(k + 1):
                if req.grammar is not None:
                    masked.append((len(rows), req, j))
                rows.append(self._sampling_row(req, req.output_ids + req.draft_ids[:j] if j else None))
        if not masked:
            return rows, None, []
        bitmask = new_bitmask(len(masked), self.vocab_size)
        for i, (_, req, j) in enumerate(masked):
            if j < len(req.draft_ids):
                bitmask[i] = req.grammar.draft_masks[j]
            else:
                req.grammar.fill_mask(bitmask, i)  # the matcher's current state: after the draft
        return rows, bitmask, [r for r, _, _ in masked]

    def _take_samples(self, req: Req, result: Any, first: int) -> None:
        """Append the tokens sampled for ``req`` from its rows ``first..first+k``.

        Without a draft (k == 0) that is one token. With one, draft tokens are
        kept while they equal what was sampled at their position; the first
        sampled token that differs (or the token after a fully kept draft) is
        the model's own and ends the step. KV computed for the rejected rest is
        dropped and the matcher rolled back over it. Stop conditions are
        checked token by token, as decoding one token per step would."""
        draft, req.draft_ids = req.draft_ids, []
        base = len(req.input_ids) + len(req.output_ids)  # position of draft[0]
        state = req.grammar
        kept = 0
        for j in range(len(draft) + 1):
            i = first + j
            token = result.token_ids[i]
            lp = result.logprobs[i] if result.logprobs is not None else None
            top = result.top_logprobs[i] if result.top_logprobs else None
            if j < len(draft) and token == draft[j]:
                kept += 1  # the matcher accepted it with the draft
                self._append_token(req, token, lp, top)
                if req.finish_reason is not None:
                    break
                continue
            accepted = True
            if state is not None:
                state.settle_draft(kept)
                accepted = state.accept(token)
            self._append_token(req, token, lp, top)
            if not accepted:
                logger.error("request %s: grammar rejected sampled token %d", req.rid, token)
                req.finish_reason = FinishReason.abort(f"the grammar rejected sampled token {token}")
            break
        if draft:
            if state.draft_len:
                state.settle_draft(kept)  # finished inside the draft
            self.counters["jump_forward_tokens"] += kept
            self.kv.truncate(req, base + kept)
        if req.finish_reason is None and state is not None and self.config.enable_jump_forward:
            self._propose_draft(req)

    def _propose_draft(self, req: Req) -> None:
        """Append the continuation the grammar forces as a draft (none when the
        next token is free), bounded by max_new_tokens and the context length."""
        limit = min(
            req.sampling.max_new_tokens - len(req.output_ids) - 1,  # the step's own token comes after it
            self.context_length - 1 - req.seq_len,
            MAX_DRAFT_TOKENS,
        )
        req.draft_ids = req.grammar.propose_draft(limit)
        self.counters["jump_forward_proposed"] += len(req.draft_ids)

    def _drop_draft(self, req: Req) -> None:
        """Forget a pending draft (it has no KV yet); the matcher rolls back over it."""
        if req.draft_ids:
            assert len(req.slots) <= len(req.input_ids) + len(req.output_ids), "dropping a computed draft"
            req.grammar.settle_draft(0)
            req.draft_ids = []

    def _resolve_grammars(self) -> None:
        """Give waiting requests whose grammar finished compiling their matcher
        (and, with jump-forward, the draft forced at the start); a grammar that
        failed to compile ends its request with an error."""
        for req in [r for r in self.waiting if r.grammar_pending and r.grammar_future.done()]:
            try:
                compiled = req.grammar_future.result()
            except Exception as e:  # noqa: BLE001 - reported to the client, never raised here
                self.waiting.remove(req)
                self._finish(req, FinishReason.abort(
                    f"the {grammar_key(req.sampling)[0]} grammar failed to compile: {e}", status_code=400))
                continue
            req.grammar = self.grammars.new_state(compiled)
            if self.config.enable_jump_forward and not req.output_ids:
                self._propose_draft(req)

    def _wait_for_grammars(self) -> None:
        """Nothing can run: sleep until a compiling grammar is done (or briefly)."""
        pending = [r.grammar_future for r in self.waiting if r.grammar_pending]
        if pending:
            concurrent.futures.wait(pending, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def _prompt_logprobs(self, req: Req, hidden: torch.Tensor, start: int) -> None:
        """Score prompt tokens [logprob_start_len, len(input)) from this chunk's
        positions; the list is complete once the prompt's last chunk ran."""
        acc = req.prompt_logprob_acc
        first = max(req.logprob_start_len, 1)  # token 0 has no logprob
        lo = max(first - 1, start)  # positions whose next token is scored
        hi = min(len(req.input_ids) - 1, start + hidden.shape[0])
        for b in range(lo, hi, PROMPT_LOGITS_BLOCK):
            e = min(b + PROMPT_LOGITS_BLOCK, hi)
            logits = self.runner.logits(hidden[b - start:e - start])
            targets = torch.tensor(req.input_ids[b + 1:e + 1], device=logits.device)
            lps, tops = token_logprobs(logits, targets, req.top_logprobs_num)
            for j in range(e - b):
                acc.append((lps[j], req.input_ids[b + 1 + j], tops[j] if tops else None))
        if start + hidden.shape[0] >= len(req.input_ids):
            pairs: list = [(None, req.input_ids[0])] if req.logprob_start_len == 0 else []
            tops_out: list = [None] if req.logprob_start_len == 0 else []
            pairs += [(lp, t) for lp, t, _ in acc]
            tops_out += [tp for _, _, tp in acc]
            req.input_logprobs = pairs
            req.input_top_logprobs = tops_out

    def _append_token(self, req: Req, token: int, logprob: Optional[float], top) -> None:
        req.output_ids.append(token)
        req.unsent_ids += 1
        self.counters["generated_tokens"] += 1
        if req.return_logprob:
            req.pending_output_logprobs.append((logprob, token))
            if req.top_logprobs_num:
                req.pending_top_logprobs.append(top or [])
        req.finish_reason = self._check_finish(req, token)

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
            if sp.stop:
                # Decode only the tail that can contain a newly completed stop string.
                tail_tokens = self.max_stop_len + 8
                tail = self.tokenizer.decode(req.output_ids[-tail_tokens:], skip_special_tokens=False)
                for s in sp.stop:
                    if s in tail:
                        return FinishReason.stop(s)
        if n_out >= sp.max_new_tokens:
            return FinishReason.length(sp.max_new_tokens)
        if req.seq_len >= self.context_length:
            return FinishReason.length(n_out)
        return None

    # ------------------------------------------------------------------ outputs
    def _finish(self, req: Req, reason: FinishReason) -> None:
        self._drop_draft(req)
        if req.slots or req.last_node is not None:
            self.kv.release(req)
        req.finish_reason = reason
        req.phase = Phase.FINISHED
        self.counters["requests_finished"] += 1
        self._emit(req)

    def _emit(self, req: Req) -> None:
        new_ids = req.output_ids[len(req.output_ids) - req.unsent_ids:] if req.unsent_ids else []
        out = TokenOutput(
            rid=req.rid, new_token_ids=new_ids, prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
            finish_reason=req.finish_reason,
            output_token_logprobs=req.pending_output_logprobs, output_top_logprobs=req.pending_top_logprobs,
        )
        if req.input_logprobs is not None and not req.input_logprobs_sent:
            out.input_token_logprobs = req.input_logprobs
            out.input_top_logprobs = req.input_top_logprobs
            req.input_logprobs_sent = True
        req.unsent_ids = 0
        req.pending_output_logprobs = []
        req.pending_top_logprobs = []
        self.pending_outputs.append(out)

    def _emit_abort(self, rid: str, prompt_tokens: int, message: str) -> None:
        self.pending_outputs.append(TokenOutput(
            rid=rid, new_token_ids=[], prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=0,
            finish_reason=FinishReason.abort(message, status_code=400),
        ))

    # ------------------------------------------------------------------ introspection
    def kv_usage(self) -> dict[str, int]:
        return self.kv.usage(self.running)

    def check_invariants(self) -> None:
        self.kv.check_invariant(self.running)
        self.kv.tree.check_integrity()

    def stats(self) -> dict[str, Any]:
        tree_stats = self.kv.tree.stats()
        return {
            **self.counters,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv": self.kv_usage(),
            "cache": tree_stats,
        }

    def _log_step(self, batch: list[tuple[Req, int]]) -> None:
        if not logger.isEnabledFor(logging.INFO) or self.counters["steps"] % self.config.log_interval:
            return
        t0, gen0 = self._log_window
        now, gen = time.perf_counter(), self.counters["generated_tokens"]
        self._log_window = (now, gen)
        u = self.kv_usage()
        used = u["total_slots"] - u["free_slots"]
        logger.info(
            "step %d: batch %d (prefill %d tok), running %d, waiting %d, gen %.1f tok/s, "
            "cache hit %.1f%%, KV used %d/%d (tree %d)",
            self.counters["steps"], len(batch), sum(q for _, q in batch if q > 1), len(self.running),
            len(self.waiting), (gen - gen0) / max(now - t0, 1e-9), 100 * self.kv.tree.stats()["hit_rate"],
            used, u["total_slots"], u["tree_slots"],
        )
