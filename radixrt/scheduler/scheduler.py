"""Cache-aware continuous batching: the step loop.

One `Scheduler` serves both transports: the in-process Engine feeds it from a
thread with queues, the server's scheduler process from ZMQ (see
`event_loop`). It knows nothing of HTTP.

Every step re-forms the batch and runs four phases, each in its own module;
each phase returns what the next one (or the scheduler) needs:

1. schedule (planner.py, `BatchPlanner.schedule` -> `Plan`): running
   requests take one token each (decode) or their next prefill chunk, then
   waiting requests are admitted in policy order while the token budget and
   KV memory last; the plan also names the requests retracted or ended;
2. prepare inputs (inputs.py, `prepare_inputs` -> `StepInputs`): token ids,
   request-to-slot table rows and lengths, sampling rows, grammar bitmasks;
3. launch (launcher.py, `StepLauncher.launch` -> future of `StepOutput`):
   forward, logits and sampling, on the forward thread, through the
   `StepRunner` and `StepSampler` interfaces (interfaces.py);
4. process results (results.py, `ResultProcessor.process` -> `StepResults`):
   append tokens, check stops, end finished requests; the outputs, in batch
   order.

A request's step computes tokens ``seq[len(slots):len(slots)+q]``; once all of
``seq`` has KV, the last position's logits sample the next token. Prefill,
chunked prefill, decode and recompute after retraction are all this one
mechanism.

Overlap (``EngineConfig.overlap_schedule``: on CUDA unless
``disable_overlap_schedule``; on the CPU only when that is set to False): a
step launches its batch and only then processes the previous step's results,
so the CPU's work runs while the forward does. The step after a batch holding
constrained or penalized requests waits for that batch's tokens first (their
next masks and penalties need them on the host); outputs are the same either
way.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Callable, Optional

from radixrt.config import EngineConfig
from radixrt.executor.lora.pool import build_lora
from radixrt.executor.model_runner import ModelRunner
from radixrt.executor.models.compiled import warm_up as warm_up_compiled
from radixrt.executor.weight_groups import WeightGroups
from radixrt.memory.kv_manager import KVCacheManager
from radixrt.memory.kv_pool import PageAllocator
from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import sequences_of, validate_prompt
from radixrt.requests.messages import GenerateReq, TokenBatch, TokenOutput
from radixrt.requests.no_tokenizer import has_text
from radixrt.requests.rids import sample_rids
from radixrt.requests.token_id_lists import check_logprob_fields
from radixrt.sampling.draws import sample_seed
from radixrt.sampling.grammar import GrammarBackend
from radixrt.scheduler.arrivals import Arrivals
from radixrt.scheduler.beam import BeamSearch
from radixrt.scheduler.constrained import ConstrainedDecoding
from radixrt.scheduler.control_requests import SchedulerControl
from radixrt.scheduler.generation_control import STORAGE_KEYS_WEIGHTS, GenerationControl
from radixrt.scheduler.host_tier import build_host_tier, build_prefix_cache, build_storage_tier
from radixrt.scheduler.inputs import prepare_inputs
from radixrt.scheduler.interfaces import StepSampler
from radixrt.scheduler.kv_budget import KVBudgeter
from radixrt.scheduler.kv_event_publisher import build_kv_events
from radixrt.scheduler.launcher import InFlight, StepLauncher, needs_host_tokens
from radixrt.scheduler.lora_admission import LoRAAdmission
from radixrt.scheduler.memory_occupation import MemoryOccupation
from radixrt.scheduler.model_fit import fit_to_rope
from radixrt.scheduler.planner import Batch, BatchPlanner
from radixrt.scheduler.policy import arrival_urgency
from radixrt.scheduler.profiler import StepProfiler
from radixrt.scheduler.queues import RequestQueues, running_order
from radixrt.scheduler.request import Phase, Req
from radixrt.scheduler.results import ResultProcessor, finish_request, time_stats_logger
from radixrt.scheduler.speculative import build_speculator
from radixrt.scheduler.step_log import StepLog, scheduler_stats
from radixrt.scheduler.storage_tier import StorageTier
from radixrt.scheduler.timeouts import (
    RUNNING_MESSAGE,
    WAITING_MESSAGE,
    RequestTimeouts,
)

logger = logging.getLogger(__name__)


class Scheduler(SchedulerControl):
    def __init__(self, config: EngineConfig, runner: Optional[ModelRunner] = None) -> None:
        self.runner = runner or ModelRunner.from_config(config)
        self.config = config = fit_to_rope(config, self.runner.model.rope.rope_type)
        self.tokenizer = self.runner.tokenizer
        self.context_length = self.runner.context_length
        mc = self.runner.model_config
        self.eos_token_ids = set(mc.eos_token_ids) | ({self.tokenizer.eos_token_id} - {None})
        self.vocab_size = mc.vocab_size
        allocator = PageAllocator(self.runner.num_pages, config.cache.page_size)
        self.host = build_host_tier(config.host_cache, self.runner, allocator.total_slots)
        prefix_cache = build_prefix_cache(config.cache, allocator, self.host)
        self.kv = KVCacheManager(allocator, prefix_cache, self.runner.req_to_token, self.runner.copy_slots)
        self.limits = config.limits.for_runtime(
            self.context_length, allocator.total_slots, self.vocab_size, mc.hidden_size, has_text(self.tokenizer)
        )
        self.rng = random.Random(config.scheduling.random_seed)
        self.timeouts = RequestTimeouts.of(config.scheduling)
        self.queues = RequestQueues()
        self.arriving = self._arrivals(config, prefix_cache)
        self.arrivals = 0
        self._queued_outputs: list[TokenOutput] = []  # made between steps (aborts, refusals): sent first
        # peak_decoding: the most running requests at once that had all their prompt computed
        names = ("steps", "prompt_tokens_computed", "requests_finished", "peak_kv_used_slots", "peak_decoding")
        self.counters = dict.fromkeys(names + ("retractions",), 0)
        self.constrained = ConstrainedDecoding(
            self.tokenizer,
            self.vocab_size,
            sorted(self.eos_token_ids),
            self.limits.grammar,
            config.grammar.grammar_cache_size,
            config.grammar.enable_jump_forward,
            self.context_length,
        )
        self.planner = BatchPlanner(
            config.scheduling,
            self.kv,
            self.queues,
            self.context_length,
            self.host.swap_cost if self.host is not None and config.scheduling.preemption_mode == "swap" else None,
            config.scheduling.shared_step_prefill_cap(config.execution.device),
            config.lora.max_loras_per_batch,
            0 if config.execution.device.startswith("cuda") else mc.keys_per_dense_token(),
        )
        self.launcher = StepLauncher(
            self.runner,
            self.runner.create_sampler(mc.vocab_size, self.eos_token_ids),
            overlap=config.execution.overlap_schedule,
            host_pool=self.host.pool if self.host is not None else None,
        )
        warm_up_compiled(self.runner, self.kv.allocator)  # before the cost probes time the forward
        self.speculator = build_speculator(config, self.runner, self.kv, self.context_length)
        self.budgets = KVBudgeter(config.kv_budgets, self.kv, self.runner.kv_pool)
        self.results = ResultProcessor(
            self.kv,
            self.queues,
            self.constrained,
            self.tokenizer,
            self.eos_token_ids,
            self.context_length,
            config.grammar.enable_jump_forward,
            self.speculator,
        )
        self.beams = BeamSearch(
            self.kv,
            self.queues,
            self.runner.copy_slots,
            self.results.candidate_finish,
            self.eos_token_ids,
            config.scheduling.max_running_requests,
        )
        self.results.beams = self.beams
        self.kv_events = build_kv_events(
            config.kv_events.events, self.kv.tree, config.cache.page_size, config.execution.device, self.storage
        )
        self.inflight: Optional[InFlight] = None
        self.step_log = StepLog(config.debug.log_interval)
        self._operator_tools(config)
        self._restore_before_ready(config)

    def _operator_tools(self, config: EngineConfig) -> None:
        """The profiler, the memory release (SGLang's operator and RL calls) and the time stats' log lines."""
        # its own level either way: under --log-level info it would otherwise log without the flag
        time_stats_logger.setLevel(logging.INFO if config.debug.enable_request_time_stats_logging else logging.WARNING)
        self.profiler = StepProfiler(self.launcher.between_steps, cuda=config.execution.device.startswith("cuda"))
        self.memory = MemoryOccupation(
            self.runner, self.kv, self.control.released, self.is_running, self.install_weights
        )

    def _restore_before_ready(self, config: EngineConfig) -> None:
        if self.storage is not None and config.storage.hicache_storage_restore_wait:
            self.storage.finish_restore(self._idle)

    def _arrivals(self, config: EngineConfig, prefix_cache: Any) -> Arrivals:
        """The storage tier and the LoRA adapters, and the way in through them; weight updates
        (which a storage tier rules out)."""
        self.storage: Optional[StorageTier] = build_storage_tier(config.storage, self.runner, self.host, prefix_cache)
        refusal = STORAGE_KEYS_WEIGHTS if self.storage is not None else ""
        self.control = GenerationControl(self.runner.load_weights, self.runner.weights_with, refusal)
        self.weight_groups = WeightGroups(str(self.runner.device))  # trainers' broadcasts of new weights
        self.runner.lora = build_lora(config.lora, self.runner)
        lora = LoRAAdmission(self.runner.lora.pool) if self.runner.lora is not None else None
        return Arrivals(self.queues, lora, self.storage)

    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def sampler(self) -> StepSampler:
        return self.launcher.sampler

    # ------------------------------------------------------------------ intake
    @property
    def grammars(self) -> GrammarBackend:
        """The grammar compiler and cache, created on first use."""
        return self.constrained.grammars

    def close(self) -> None:
        """Stop background work (the forward thread, grammar compilation, tensor-parallel ranks)."""
        self.profiler.close()  # before the forward thread it runs on ends
        self.weight_groups.close()
        self.launcher.close()
        self.runner.close()
        self.constrained.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.storage is not None and self.host is not None:
            transfers = self.kv.take_transfers()  # storage writes not yet run (the forward thread is gone)
            self.host.pool.run(transfers.before + transfers.after)
            self.storage.close()

    def add_request(self, msg: GenerateReq) -> None:
        """Queue (or hold) the request's samples, or refuse it: a 400 for what it asks that
        this server cannot do, a 500 for a failure of its own set-up, which no other request
        shares (nothing of it is queued before every sample is set up)."""
        limit, why, status = self.config.scheduling.max_queued_requests, "", 0
        try:
            self.validate_request(msg)
            if limit is not None and len(self.queues.waiting) + sequences_of(msg.sampling) > limit:
                why, status = f"The request queue is full (--max-queued-requests {limit}).", 503  # SGLang's
                if sequences_of(msg.sampling) > limit:  # never admissible: no retry helps
                    why, status = f"{sequences_of(msg.sampling)} sequences; {why}", 400
            else:
                reqs = self._new_reqs(msg)
        except Exception as e:  # a ValueError is the request's fault; anything else, a bug it alone meets
            bad = isinstance(e, ValueError)
            if not bad:
                logger.exception("request %s failed before it was queued", msg.rid)
            why, status = (str(e), 400) if bad else (f"internal error: {type(e).__name__}", 500)
        if status:
            self._queued_outputs.append(TokenOutput.refusal(msg.rid, len(msg.input_ids), why, status))
            return
        for req in reqs:
            self.arriving.arrive(req, msg.lora)

    def validate_request(self, msg: GenerateReq) -> None:
        """ValueError (a 400) for what ``msg`` asks that this server cannot do. Its grammar is
        parsed by the compile thread, off the step loop (a large one takes half a second)."""
        validate_prompt(msg.input_ids, msg.sampling, self.limits, parse_grammar=False)
        self.budgets.check(msg.sampling.kv_budget, msg.sampling.kv_budget_policy)
        limits = self.limits
        top, ids = msg.top_logprobs_num, msg.token_ids_logprob
        check_logprob_fields(top, ids, limits.max_top_logprobs_num, limits.vocab_size, msg.sampling)
        self.beams.check(len(msg.input_ids), msg.sampling)
        self.arriving.check_lora(msg.lora)

    def _new_reqs(self, msg: GenerateReq) -> list[Req]:
        """The request's samples (one root for a beam search), set up but not yet queued."""
        grammar_future = self.constrained.compile(msg.sampling)
        max_stop_bytes = max((len(s.encode("utf-8")) for s in msg.sampling.stop or ()), default=0)
        prio = arrival_urgency(msg.priority, self.config.scheduling)
        beam = msg.sampling.uses_beam_search
        reqs = []
        for i, rid in enumerate([f"{msg.rid}#beam0"] if beam else sample_rids(msg.rid, msg.sampling.n)):
            base_seed = msg.sampling.seed
            seed = self.rng.getrandbits(62) if base_seed is None else sample_seed(base_seed, i)
            req = Req.from_message(msg, rid, seed, self.arrivals, grammar_future, prio, max_stop_bytes)
            if i > 0:  # the prompt's logprobs are the first sample's (the front copies them): the rest share its KV
                req.logprob_start_len = -1
            req.stream_interval = msg.sampling.stream_interval or self.config.output.stream_interval
            self.arrivals += 1
            if beam:  # a search's hypotheses share their KV: no budget compresses it (not even the server's)
                self.beams.start(req, sample_rids(msg.rid, msg.sampling.n))
            else:
                self.budgets.start(req)
            if self.speculator is not None and req.kv_budget is None and not beam:
                self.speculator.start(req)
            reqs.append(req)
        return reqs

    def is_running(self) -> bool:
        """A request runs (or a step is in flight)."""
        return bool(self.queues.running or self.inflight)

    def has_work(self) -> bool:
        queues = self.queues
        return bool(queues.waiting or queues.running or self.inflight or self.arriving.busy or self.control.updates)

    # ------------------------------------------------------------------ loop
    def event_loop(
        self,
        recv: Callable[[bool], list[Any]],
        send: Callable[[Any], None],
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Serve until ``should_stop()``: ``recv(block)`` returns incoming messages
        (blocking only while idle); ``send`` ships TokenBatch and ControlReply."""
        try:
            while not should_stop():
                self.runner.check_ranks()
                halted = self.control.halted and not self.control.updates
                for msg in recv((halted or not self.has_work()) and not self._queued_outputs):
                    reply = self.handle(msg)
                    if reply is not None:
                        send(reply)
                outputs = self.step()
                if outputs:
                    version = self.control.weight_version  # no step runs across an update (generation_control.py)
                    for out in outputs:
                        out.weight_version = version
                    send(TokenBatch(outputs))
                for reply in self.control_replies():
                    send(reply)
        finally:
            self.close()

    def step(self) -> list[TokenOutput]:
        """Schedule and launch one batch, process the results of the step before
        it (or of this one, when it cannot overlap); return what requests produced
        (after the outputs queued since the last step)."""
        started = time.perf_counter()
        self._update_weights()
        out, self._queued_outputs = self._queued_outputs, []
        if self.control.halted:
            return out
        out += self._abort_late()
        for req, error in self.arriving.ready():
            out += self._finish(req, FinishReason.abort(error, status_code=400))
        for req, reason in self.constrained.resolve(self.queues.waiting):
            if req.phase is Phase.FINISHED:  # a beam whose search an earlier one of these ended
                continue
            self.queues.waiting.remove(req)
            out += self._finish(req, reason)
        self.budgets.compact(self.queues.running)
        if self.speculator is not None:
            self.speculator.draft(self.queues.running)
        plan = self.planner.schedule(admit=not self.control.holds_admission)
        self.counters["retractions"] += len(plan.retracted)
        for req, reason in plan.ended:
            out += self._finish(req, reason)
        batch = plan.batch
        previous, self.inflight = self.inflight, self._launch(batch, started) if batch else None
        if previous is not None:
            out += self._complete(previous)
        if self.inflight is not None and not self.inflight.overlappable:
            out += self._complete(self.inflight)
            self.inflight = None
        if not batch and self.queues.waiting and not self.queues.running:
            self.constrained.wait(self.queues.waiting)
        if not batch and self.inflight is None:
            self._idle()
        if self.kv_events is not None:
            self.kv_events.flush()
        return out

    def _abort_late(self) -> list[TokenOutput]:
        """Abort (503) the requests past their waiting or running timeout (timeouts.py); their outputs."""
        late_waiting, late_running = self.timeouts.overdue(self.queues.waiting, self.queues.running, time.monotonic())
        for late, why in ((late_waiting, WAITING_MESSAGE), (late_running, RUNNING_MESSAGE)):
            if late:
                self.abort(*(r.rid for r in late), reason=FinishReason.abort(why, status_code=503))
        out, self._queued_outputs = self._queued_outputs, []
        return out

    def _idle(self) -> None:
        """Nothing runs: queued copies (storage writes) run now; wait briefly for held requests."""
        if self.storage is not None and self.host is not None:
            transfers = self.kv.take_transfers()
            self.host.pool.run(transfers.before + transfers.after)
        if not self.queues.waiting:
            self.arriving.wait(0.01)

    def _launch(self, batch: Batch, started: float) -> InFlight:
        overlappable = self.launcher.overlap and not any(needs_host_tokens(r) for r, _ in batch)
        inputs = prepare_inputs(
            batch, self.constrained, self.kv.req_to_token.take_writes(), keep_last_tokens=overlappable
        )
        self.counters["prompt_tokens_computed"] += inputs.prompt_tokens
        for (req, q), first_sample in zip(batch, inputs.sample_starts):
            if first_sample >= 0:
                req.inflight_tokens += 1
            if q > 1 + len(req.draft_ids):  # a prefill chunk: its prefix is matchable from the next schedule on
                self.kv.cache_prefix(req, limit=len(req.slots) - len(req.draft_ids), computed=False)
        # tier copies queued since the last launch run on the forward thread around this step's forward
        transfers = self.kv.take_transfers()
        self.profiler.launched()
        return InFlight(batch, inputs, self.launcher.launch(inputs, transfers or None), overlappable, started)

    def _complete(self, step: InFlight) -> list[TokenOutput]:
        """Process a launched step's results (waiting for them); its outputs."""
        results = self.results.process(step.batch, step.inputs, step.output.result())
        spec = self.speculator
        if spec is not None and not step.overlappable and not step.inputs.prompt_tokens:
            # the whole step as the requests waited for it: drafting, planning, forward, sampling, results
            q_lens = step.inputs.q_lens
            seconds = time.perf_counter() - step.started_at
            spec.cost.observe_step(q_lens, step.inputs.kv_lens, seconds, spec.leaves_fast_path(q_lens))
        self.counters["requests_finished"] += results.finished
        self.counters["steps"] += 1
        used = self.kv.allocator.total_slots - self.kv.allocator.num_free_slots
        self.counters["peak_kv_used_slots"] = max(self.counters["peak_kv_used_slots"], used)
        running = self.queues.running
        if len(running) > self.counters["peak_decoding"]:
            decoding = sum(1 for r in running if r.output_ids)
            self.counters["peak_decoding"] = max(self.counters["peak_decoding"], decoding)
        self.step_log.step(self, step.batch)
        if self.config.debug.debug_check_invariants:
            self.check_invariants()
        return results.outputs

    def _finish(self, req: Req, reason: FinishReason) -> list[TokenOutput]:
        """End a request that is in neither queue any more (its KV is released); its
        last output (a beam ends its whole search: its outputs, once)."""
        if req.beam is not None:
            outputs = self.beams.end(req, reason)
            self.counters["requests_finished"] += 1 if outputs else 0
            return outputs
        self.counters["requests_finished"] += 1
        return [finish_request(req, reason, self.kv)]

    # ------------------------------------------------------------------ introspection
    def kv_usage(self) -> dict[str, int]:
        return self.kv.usage(self.queues.running)

    def check_invariants(self) -> None:
        self.kv.check_invariant(self.queues.running)
        self.kv.tree.check_integrity()
        if self.speculator is not None:
            self.speculator.index.check_integrity(self.kv.tree)
        if self.queues.running_ordered:
            keys = [running_order(r) for r in self.queues.running]
            assert keys == sorted(keys), "running is marked ordered but is not in scheduling order"

    def stats(self) -> dict[str, Any]:
        """Counters since the start and the state now (/get_server_info, /metrics, Engine.get_stats)."""
        return scheduler_stats(self)
