"""A request's state inside the scheduler."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from radixrt.memory.kv_handle import RequestKV
from radixrt.requests.finish import FinishReason
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.penalties import TokenCounts

if TYPE_CHECKING:
    from radixrt.executor.lora.adapter import LoRAAdapter
    from radixrt.requests.messages import GenerateReq
    from radixrt.sampling.grammar import GrammarState
    from radixrt.scheduler.beam_state import BeamGroup
    from radixrt.scheduler.budget_state import RequestBudget
    from radixrt.scheduler.spec_state import SpecState


class Phase(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted under KV pressure)
    RUNNING = "running"  # admitted: holds KV slots, computes every step
    FINISHED = "finished"


@dataclass(eq=False)
class Req(RequestKV):
    """One sequence being generated.

    KV ownership: the fields of `RequestKV` (memory/kv_handle.py: ``slots``,
    ``tree_len``, ``last_node``, ``row``, ``namespace``), written only by the
    KV manager. ``slots[i]`` holds the KV of token ``seq[i]``. Invariant while
    RUNNING: ``len(slots) <= len(seq) + inflight_tokens``; each step computes
    the next ``uncomputed`` tokens or a chunk of them, and once all have KV the
    logits of the last one sample a new token. ``inflight_tokens`` counts
    sampled tokens whose step is still in flight (overlap scheduling): the next
    step already computes the KV of the last of them, whose id only the device
    knows yet.

    Constrained requests (see grammar.py): ``grammar_future`` is the
    compilation (the request waits in the queue while ``grammar_compiling``),
    then ``grammar`` holds the matcher, which has accepted every output token.
    It lives as long as the request, through retraction (the output persists).
    ``draft_ids`` is the unverified draft: tokens the grammar forces after
    ``output_ids`` (jump-forward), or those speculative decoding guesses
    (speculative.py), part of ``seq`` so that the next step computes
    their KV, but not output until that step has verified them. Between steps
    the draft never has KV (``len(slots) <= len(input_ids) + len(output_ids)``).

    What the front has not been sent yet: the last ``unsent_ids`` output
    tokens, with their ``unsent_output_logprobs``, ``unsent_top_logprobs`` and
    ``unsent_token_ids_logprobs``.
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()  # tokens whose logprobs every scored position returns
    arrival: int = 0
    queued_at: float = field(default_factory=time.monotonic)  # when it arrived (waiting timeout)
    started_at: Optional[float] = None  # when it was first admitted (running timeout)
    first_token_at: Optional[float] = None  # when its first output token was sampled (time stats)
    parent: str = ""  # the id of the request this is a sample of (its own rid when n == 1)
    group: str = ""  # the client call it came in (a batch's prompts and their samples share it)
    priority: int = 0  # waiting-queue order under enable_priority_scheduling
    urgency: int = 0  # its fixed sort key there: priority with aging (policy.urgency)
    cache_info_mode: str = ""  # "" / "own" / "full": explain the first admission's match (GenerateReq.cache_info)
    cache_info: Optional[dict] = None  # the explained prefix match of the first admission (to send once)

    output_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    cached_tokens: int = 0  # prompt tokens served from the radix cache at first admission
    # token counts for the penalty stage; empty until a penalized row samples
    penalty_counts: TokenCounts = field(default_factory=TokenCounts)
    admitted_once: bool = False
    storage_tokens: int = 0  # prompt tokens its storage read put in the tree (host tier)
    # LoRA (lora_admission.py): its adapter's name, the loaded adapter, and the first sequence index
    # computed with it (0; an activated adapter's invocation point)
    lora_name: Optional[str] = None
    lora: Optional["LoRAAdapter"] = None
    lora_start: int = 0
    finish_reason: Optional[FinishReason] = None
    retractions: int = 0
    grammar_future: Optional[Future] = None
    grammar: Optional["GrammarState"] = None
    draft_ids: list[int] = field(default_factory=list)
    # longest next jump-forward draft (None: constrained.MAX_DRAFT_TOKENS); it shrinks to what the model
    # kept when a draft is rejected and doubles when one is kept whole (constrained.next_draft_limit)
    draft_limit: Optional[int] = None
    # speculative decoding's per-request state (speculative.SpecState), None when it does not speculate;
    # its drafts are draft_ids too (a request speculates only without a grammar)
    spec: "Optional[SpecState]" = None
    # Tokens sampled by a launched step whose results are not processed yet (the
    # overlap scheduler keeps one step in flight). They are not in output_ids
    # and have no KV; the next decode step reads the last one on the device.
    inflight_tokens: int = 0
    # the longest of its stop strings, in UTF-8 bytes (how many output tokens to decode for them)
    max_stop_bytes: int = 0
    # CPU seconds its stop_regex searches have taken in all (stop_regex.life_budget_s bounds them)
    stop_regex_cpu_s: float = 0.0
    # its KV budget's state (budget_state.RequestBudget: the policy, scores, offloaded KV), None without one
    kv_budget: "Optional[RequestBudget]" = None
    # a beam search's hypothesis (beam.py): its search, cumulative logprob, each output token's logprob,
    # and the best continuations its last step reported (None until it reports, and after each search step)
    beam: "Optional[BeamGroup]" = None
    beam_logprob: float = 0.0
    beam_token_logprobs: list[float] = field(default_factory=list)
    beam_candidates: Optional[list[tuple[float, int]]] = None

    # Deltas not yet reported to the front: reported every stream_interval tokens (`report_due`).
    stream_interval: int = 1
    unsent_ids: int = 0
    unsent_output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    unsent_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    unsent_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: Optional[list[tuple[Optional[float], int]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    input_token_ids_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    input_token_ranks: Optional[list[Optional[int]]] = None  # each prompt token's rank (None: unscored)
    input_logprobs_sent: bool = False
    prompt_logprob_acc: list = field(default_factory=list)  # (logprob, token, top, by_id, rank) while prefilling
    # return_hidden_states: the final hidden row (a 1-D float32 host tensor) of each sequence position
    # computed so far, in order (hidden_capture.py); None when it did not ask
    hidden_rows: Optional[list] = None

    @classmethod
    def from_message(
        cls,
        msg: "GenerateReq",
        rid: str,
        seed: int,
        arrival: int,
        grammar_future: Optional[Future],
        urgency: int,
        max_stop_bytes: int,
    ) -> "Req":
        """A new sample ``rid`` of request ``msg`` (its ``parent``), waiting."""
        return cls(
            rid=rid,
            input_ids=list(msg.input_ids),
            sampling=msg.sampling,
            seed=seed,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            token_ids_logprob=msg.token_ids_logprob,
            namespace=msg.namespace,
            arrival=arrival,
            grammar_future=grammar_future,
            parent=msg.rid,
            group=msg.group or msg.rid,
            priority=msg.priority or 0,
            urgency=urgency,
            cache_info_mode=msg.cache_info,
            max_stop_bytes=max_stop_bytes,
            hidden_rows=[] if msg.return_hidden_states else None,
        )

    @property
    def report_due(self) -> bool:
        """Whether the unsent output goes to the front this step: the first token at once, then
        every ``stream_interval`` tokens (a step may add several: at least that many)."""
        n = self.unsent_ids
        return n > 0 and (n >= self.stream_interval or n == len(self.output_ids))

    @property
    def seq(self) -> list[int]:
        """The tokens to hold KV for: prompt, output and the draft."""
        return self.input_ids + self.output_ids + self.draft_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``seq[start:end]`` without building ``seq`` (the hot path asks for a
        decode step's one token, or a prefill chunk)."""
        n_in, n_out = len(self.input_ids), len(self.output_ids)
        if start >= n_in and end <= n_in + n_out:
            return self.output_ids[start - n_in : end - n_in]
        if end <= n_in:
            return self.input_ids[start:end]
        return self.seq[start:end]

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids) + len(self.draft_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def uncomputed(self) -> int:
        """Tokens still without KV, counting an in-flight sampled one and the draft."""
        return self.seq_len + self.inflight_tokens - len(self.slots) - self.kv_dropped

    @property
    def grammar_compiling(self) -> bool:
        """Waiting for its grammar to compile (not admissible yet)."""
        return self.grammar_future is not None and self.grammar is None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    @property
    def max_prefix_len(self) -> int:
        """The longest prefix that may come from the cache: at least one token is
        always computed (for logits), and prompt logprobs need their positions.
        A draft is verified from the logits of the position before it on, so
        that position and the draft are always computed. A request that returns
        its hidden states computes every position whose row it does not hold yet."""
        cap = self.seq_len - len(self.draft_ids) - 1
        if self.wants_prompt_logprobs and self.input_logprobs is None:
            cap = min(cap, self.logprob_start_len)  # its logits score the token after it
        if self.hidden_rows is not None:  # a cached prefix has no hidden rows kept: compute past its own
            cap = min(cap, len(self.hidden_rows))
        return cap if self.tree_limit is None else min(cap, self.tree_limit)

    @property
    def prefill_only(self) -> bool:
        return self.sampling.max_new_tokens == 0
