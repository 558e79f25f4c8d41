"""Phase 3 of a step: run the forward, the logits and the sampler.

`StepLauncher.launch` returns a future of the step's `StepOutput` (host lists).
With overlap on, the work runs on one forward thread, in launch order, while
the scheduler thread processes the previous step's results and prepares the
next one (SGLang's zero-overhead scheduler and vLLM's async scheduling do the
same). On CUDA the two really run at once: the forward thread only launches
kernels. On the CPU the forward's many small ops each need the interpreter
lock that the scheduler's Python holds, so the threads mostly take turns,
and overlap is off there by default (`EngineConfig.overlap_schedule`). With
overlap off the work runs inline.

Device state owned here: ``last_tokens[row]``, the last token sampled for the
request holding row ``row`` of the request-to-slot table, kept for the steps
after which another is launched before their results are processed
(``StepInputs.last_token_rows``). A decode step whose input token is still in
flight reads it from there, so a sampled token never has to reach the host
before the step that consumes it is launched.

Everything the forward thread touches (the runner, its KV pool and table, the
sampler) is touched by no other thread while a step is in flight: the
scheduler only queues table writes, which travel inside `StepInputs`, and
host-tier copies (`KVTransfers`, radixrt/memory/host_pool.py), which run
here: loads and offloads before the step's forward (the forward that needs a
loaded prefix waits for it), write-through copies of what the step computes
after it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from radixrt.memory.host_pool import HostKVPool
from radixrt.memory.kv_transfer import KVTransfers
from radixrt.sampling.sampler import SampleResult, token_logprobs
from radixrt.sampling.token_filters import needs_each_token
from radixrt.scheduler.hidden_capture import copy_rows
from radixrt.scheduler.inputs import PromptLogprobJob, StepInputs
from radixrt.scheduler.interfaces import StepRunner, StepSampler

if TYPE_CHECKING:
    from radixrt.scheduler.planner import Batch
    from radixrt.scheduler.request import Req

PROMPT_LOGITS_BLOCK = 256  # rows of prompt logits materialized at once

# (logprob, token, top, by_id): by_id are the logprobs of the request's token_ids_logprob
# per scored prompt position: (logprob, token, top list, named tokens' list, the token's rank)
PromptScores = list[tuple[float, int, Optional[list[tuple[float, int]]], Optional[list[tuple[float, int]]], int]]


@dataclass
class StepOutput:
    """A launched step's results, on the host."""

    sample: Optional[SampleResult]  # one token per StepInputs.sampling_rows entry; None without any
    prompt_scores: list[PromptScores]  # one list per StepInputs.prompt_jobs entry
    hidden_rows: list[torch.Tensor] = field(default_factory=list)  # one per StepInputs.hidden_jobs entry


@dataclass
class InFlight:
    """A launched step whose results are not processed yet."""

    batch: "Batch"
    inputs: StepInputs
    output: "Future[StepOutput]"
    overlappable: bool  # the next step may be scheduled before these results are in
    started_at: float = 0.0  # time.perf_counter() when its step began (drafting and planning included)


def needs_host_tokens(req: "Req") -> bool:
    """Its next step's inputs depend on this step's token (grammar mask, penalties)."""
    sp = req.sampling
    return (
        req.grammar is not None
        or req.grammar_future is not None
        or sp.repetition_penalty != 1.0
        or sp.frequency_penalty != 0.0
        or sp.presence_penalty != 0.0
        or req.spec is not None  # its next draft continues from this step's token
        or req.kv_budget is not None  # its compaction reads this step's attention scores
        or req.beam is not None  # its search's next step chooses its next token
        or needs_each_token(sp.bad_words_ids)  # which tokens it bans depends on the last ones
    )


class StepLauncher:
    def __init__(
        self, runner: StepRunner, sampler: StepSampler, overlap: bool, host_pool: Optional[HostKVPool] = None
    ) -> None:
        """``overlap``: run steps on a forward thread (else inline, in `launch`);
        ``host_pool``: the host tier's pool, which runs a step's host-tier copies
        (None without a host tier: a step then carries none)."""
        self.runner = runner
        self.sampler = sampler
        self.host_pool = host_pool
        self.device = torch.device(runner.device)
        self.last_tokens = torch.zeros(runner.req_to_token.max_requests + 1, dtype=torch.int64, device=self.device)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="radixrt-forward") if overlap else None

    @property
    def overlap(self) -> bool:
        return self._thread is not None

    def launch(self, inputs: StepInputs, transfers: Optional[KVTransfers] = None) -> "Future[StepOutput]":
        """Start the step (on the forward thread, after those launched before it)
        and return the future of its output; an error in the step is raised by
        the future's ``result()``."""
        if self._thread is not None:
            return self._thread.submit(self.run, inputs, transfers)
        done: Future[StepOutput] = Future()
        try:
            done.set_result(self.run(inputs, transfers))
        except BaseException as e:  # noqa: BLE001 - re-raised by result(), as a thread's would be
            done.set_exception(e)
        return done

    def between_steps(self, fn: Callable[[], Any]) -> "Future[Any]":
        """Run ``fn`` where the steps run, after those launched so far (inline without a forward
        thread): what must see the forward's thread (the profiler) goes through here."""
        if self._thread is not None:
            return self._thread.submit(fn)
        done: Future[Any] = Future()
        done.set_result(fn())
        return done

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, transfers: Optional[KVTransfers] = None) -> StepOutput:
        """The step itself: host-tier loads and offloads, forward, logits, sampling,
        then the write-through copies."""
        host = self.host_pool
        if transfers:
            assert host is not None, "host-tier copies without a host pool"
            host.run(transfers.before)
        out = self._run(inputs)
        if transfers and host is not None:
            host.run(transfers.after)
        return out

    def _to_device(self, values: list) -> torch.Tensor:
        """An int64 tensor of host ints (a list, or a list of equal-length lists) on the device."""
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def _input_ids(self, inputs: StepInputs) -> torch.Tensor:
        """The step's token ids on the device; those still in flight are read from ``last_tokens``."""
        if len(inputs.future_positions) == len(inputs.input_ids):  # all in flight: a decode step under overlap
            return self.last_tokens[self._to_device(inputs.future_rows)]
        ids = self._to_device(inputs.input_ids)
        if inputs.future_positions:
            where = self._to_device([inputs.future_positions, inputs.future_rows])
            ids[where[0]] = self.last_tokens[where[1]]
        return ids

    def _run(self, inputs: StepInputs) -> StepOutput:
        ids = self._input_ids(inputs)
        plain = inputs.tree is None and inputs.position_offsets is None and not inputs.score_jobs
        if plain and inputs.lora_rows is None:  # most steps
            hidden = self.runner.forward_batch(ids, inputs.rows, inputs.q_lens, inputs.kv_lens, inputs.table_writes)
        else:  # a step verifying a draft tree, holding requests under a KV budget or with LoRA adapters
            hidden = self.runner.forward_batch(
                ids,
                inputs.rows,
                inputs.q_lens,
                inputs.kv_lens,
                inputs.table_writes,
                tree=inputs.tree,
                position_offsets=inputs.position_offsets,
                score_jobs=inputs.score_jobs,
                lora_rows=inputs.lora_rows,
            )
        scores = [self._score_prompt(hidden, job) for job in inputs.prompt_jobs]
        hidden_rows = [copy_rows(hidden, job) for job in inputs.hidden_jobs]
        sample = None
        positions = inputs.sample_positions
        if positions:
            if len(positions) < hidden.shape[0]:  # else (increasing, distinct) they are all the rows: a decode batch
                hidden = hidden.index_select(0, self._to_device(positions))
            logits = self.runner.logits(hidden)
            sample = self.sampler.sample(logits, inputs.sampling_rows, inputs.bitmask, inputs.masked_rows)
            if inputs.last_token_rows:
                tokens = [sample.token_ids[i] for i in inputs.last_token_samples]
                last = self._to_device([inputs.last_token_rows, tokens])
                self.last_tokens[last[0]] = last[1]
        return StepOutput(sample, scores, hidden_rows)

    def _score_prompt(self, hidden: torch.Tensor, job: PromptLogprobJob) -> PromptScores:
        out: PromptScores = []
        for b in range(job.lo, job.hi, PROMPT_LOGITS_BLOCK):
            e = min(b + PROMPT_LOGITS_BLOCK, job.hi)
            first = job.offset + b - job.start
            logits = self.runner.logits(hidden[first : first + e - b])
            targets = job.targets[b - job.lo : e - job.lo]
            lps, tops, by_id, ranks = token_logprobs(logits, targets, job.top_k, token_ids=job.token_ids)
            out.extend(
                (lps[j], targets[j], tops[j] if tops else None, by_id[j] if by_id else None, ranks[j])
                for j in range(e - b)
            )
        return out
