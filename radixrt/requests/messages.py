"""Typed messages between the front (Engine or HTTP tokenizer manager) and the scheduler.

The scheduler consumes `GenerateReq`, `AbortReq`, the control requests
(`FlushCacheReq`, `StatsReq`, LoRA, weights, pause) and emits `TokenBatch` (one per scheduler step, holding a
`TokenOutput` for every request that produced something or finished) and
`ControlReply` (answers to flush/stats). The same dataclasses travel through
an in-process queue (Engine) or are pickled over ZMQ (server).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from radixrt.requests.finish import FinishReason
from radixrt.sampling.params import SamplingParams


@dataclass
class GenerateReq:
    """A tokenized, validated request (built by `radixrt.requests.intake`).
    ``rid`` is the request's internal id (never the client's rid, see
    intake's "Request ids"). ``n`` samples are expanded by the scheduler into
    ``n`` requests whose rids are ``intake.sample_rids(rid, n)`` and whose
    parent is ``rid``."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    stream: bool = False
    # SGLang's token_ids_logprob: the logprobs of these tokens at every scored position, prompt and output
    token_ids_logprob: tuple[int, ...] = ()
    namespace: Optional[str] = None  # the radix cache's namespace (cache_fields.cache_namespace); None: shared
    priority: Optional[int] = None  # queue order under enable_priority_scheduling (None: 0)
    # explain the prefix match (radixrt.memory.radix_explain): "" no, "own" from the request's own
    # text and match only, "full" with the cache's neighbouring content (the operator's view)
    cache_info: str = ""
    lora: Optional[str] = None  # the LoRA adapter's name (None: the base model)
    # the client call it came in: a batch's prompts share one, so that the queue takes turns between calls
    # (planner.interleave_calls); None: its own
    group: Optional[str] = None
    return_hidden_states: bool = False  # SGLang's: the last result carries them (hidden_states.py)


@dataclass
class LoRAControlReq:
    """Load (``path`` given) or unload (``path`` None) the LoRA adapter ``name``."""

    name: str
    path: Optional[str] = None


@dataclass
class UpdateWeightsReq:
    """Serve the weights of the checkpoint at ``model_path`` from now on (SGLang's
    ``update_weights_from_disk``; radixrt/scheduler/generation_control.py says when)."""

    model_path: str
    abort_all_requests: bool = False
    weight_version: Optional[str] = None  # the label the server reports from then on (None: the path)


@dataclass
class UpdateTensorsReq:
    """Serve the weights being served with ``named_tensors`` ((checkpoint name, tensor) pairs,
    some or all of the model's) in their place (SGLang's ``update_weights_from_tensor``; the
    same contract as `UpdateWeightsReq`). In-process only: the tensors are not serialized.
    ``named_tensors`` may be a function giving them (called on the update's thread)."""

    named_tensors: Any
    abort_all_requests: bool = False
    weight_version: Optional[str] = None  # the label from then on (None: unchanged)


@dataclass
class WeightsGroupReq:
    """Join (``join``) or leave the weight-update group ``group_name`` (SGLang's
    ``init_weights_update_group`` / ``destroy_weights_update_group``; executor/weight_groups.py)."""

    group_name: str
    join: bool = True
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 0
    world_size: int = 0
    backend: str = "gloo"


@dataclass
class UpdateDistributedReq:
    """Serve the tensors rank 0 of ``group_name`` broadcasts now (``names``, ``dtypes``, ``shapes``,
    in order) in place of those weights (SGLang's ``update_weights_from_distributed``; updated as
    `UpdateTensorsReq`)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


@dataclass
class GetWeightsReq:
    """The first ``truncate_size`` rows of the served weight ``name`` (SGLang's
    ``get_weights_by_name``; Hugging Face's parameter names). Answered with a float32
    CPU tensor (``payload["values"]``), which the caller turns into lists."""

    name: str
    truncate_size: int = 100


@dataclass
class PauseGenerationReq:
    """Stop stepping: ``mode`` "abort" (end every request first), "retract" (running
    requests give up their KV and wait) or "in_place" (they keep it)."""

    mode: str = "abort"


@dataclass
class ContinueGenerationReq:
    pass


@dataclass
class WeightVersionReq:
    """Label the weights being served ``new_version`` from now on (SGLang's
    ``update_weight_version``; the weights stay as they are), after ending every request when
    ``abort_all_requests`` (SGLang's default)."""

    new_version: str
    abort_all_requests: bool = True


@dataclass
class MemoryOccupationReq:
    """Release (``release``) or take back the memory of ``tags`` ("kv_cache", "weights",
    "cuda_graph"; None: all), SGLang's ``release_memory_occupation`` and
    ``resume_memory_occupation`` (radixrt/scheduler/memory_occupation.py)."""

    release: bool
    tags: Optional[list[str]] = None


@dataclass
class ProfileReq:
    """Start or stop the torch profiler over the scheduler's steps (SGLang's ``/start_profile``
    fields; radixrt/scheduler/profiler.py)."""

    action: str = "start"  # "start" | "stop"
    output_dir: Optional[str] = None
    num_steps: Optional[int] = None
    activities: Optional[list[str]] = None
    with_stack: Optional[bool] = None
    record_shapes: Optional[bool] = None
    profile_id: Optional[str] = None
    profile_prefix: Optional[str] = None
    dp_rank: Optional[int] = None  # a data-parallel replica's rank, in the trace's name (the router sets it)


@dataclass
class AbortReq:
    rids: tuple[str, ...]  # internal ids: requests with their samples, or single samples; "" aborts every request


@dataclass
class FlushCacheReq:
    pass


@dataclass
class StatsReq:
    pass


@dataclass
class RadixSnapshotReq:
    """Ask for the debug view of the radix tree and the requests (radixrt/scheduler/debug_view.py)."""

    max_depth: int = 8
    max_nodes: int = 500
    tokens_per_node: int = 0  # the first token ids of each node (0: none)


@dataclass
class ControlReply:
    kind: str  # a value of REPLY_KINDS
    ok: bool = True
    payload: dict[str, Any] = field(default_factory=dict)


# the kind of `ControlReply` each control message is answered with (the scheduler answers each
# call of a kind once, in the order of the calls)
REPLY_KINDS: dict[type, str] = {
    FlushCacheReq: "flush_cache",
    StatsReq: "stats",
    RadixSnapshotReq: "radix",
    LoRAControlReq: "lora",
    UpdateWeightsReq: "update_weights",
    UpdateTensorsReq: "update_weights",
    GetWeightsReq: "weights",
    PauseGenerationReq: "pause",
    ContinueGenerationReq: "continue",
    WeightVersionReq: "weight_version",
    ProfileReq: "profile",
    MemoryOccupationReq: "memory",
    WeightsGroupReq: "weights_group",
    UpdateDistributedReq: "update_weights",
}


@dataclass(slots=True)  # one per request per step: no instance dict
class TokenOutput:
    """What one request produced in one step.

    ``new_token_ids`` are the tokens appended since the previous TokenOutput of
    this rid (empty for a prefill-only request). Logprob lists are deltas in
    the same order: ``(logprob, token_id)`` pairs, and top-k lists of such pairs.
    Prompt logprobs (``input_token_logprobs``) arrive once, with the first output.
    ``finish_reason`` is None while running, else a `FinishReason` (a dict in
    SGLang's wire shape is accepted and converted on construction).
    """

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: Optional[FinishReason] = None
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: Optional[list[tuple[Optional[float], int]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    # The prefix match explained (token ids, no text; see radix_explain.CacheExplanation.to_wire),
    # once, with the first output after admission, when the request asked for it.
    cache_info: Optional[dict[str, Any]] = None
    # speculative decoding: the request's decode steps so far, each verifying a draft (None: it does not speculate)
    spec_verify_ct: Optional[int] = None
    # and its draft tokens verified and accepted so far (with spec_verify_ct)
    spec_drafts: Optional[tuple[int, int]] = None
    # a request under a KV budget: its figures (kv_budget.RequestBudget.describe), with its last output
    kv_budget: Optional[dict[str, Any]] = None
    # a beam search's output: its rank, score and search figures (beam.BeamGroup.describe)
    beam: Optional[dict[str, Any]] = None
    # a request with token_ids_logprob: per output token, and once per prompt position (as the top lists)
    output_token_ids_logprobs: Optional[list[list[tuple[float, int]]]] = None
    input_token_ids_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    # a request with return_hidden_states: all its rows, with its last output (hidden_states.PackedHidden)
    hidden_states: Optional[tuple[int, int, bytes]] = None
    # the label of the weights that computed this output (stamped per batch: scheduler.event_loop)
    weight_version: Optional[str] = None
    # how often the request was retracted (sent back to the queue without its KV) so far, once above 0
    num_retractions: Optional[int] = None
    # with the prompt's logprobs: each prompt token's rank, 1 + the tokens more likely (vLLM's prompt_logprobs)
    input_token_ranks: Optional[list[Optional[int]]] = None

    def __post_init__(self) -> None:
        if self.finish_reason is not None:  # the hot path builds it running (None) or with a FinishReason
            self.finish_reason = FinishReason.coerce(self.finish_reason)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def refusal(cls, rid: str, prompt_tokens: int, message: str, status_code: int = 400) -> "TokenOutput":
        """The one output of a request refused before it ran (``status_code``: the HTTP status it gets)."""
        return cls(rid, [], prompt_tokens, 0, 0, FinishReason.abort(message, status_code=status_code))


_TOKEN_OUTPUT_FIELDS = tuple(f.name for f in fields(TokenOutput))
token_output_row = operator.attrgetter(*_TOKEN_OUTPUT_FIELDS)  # a TokenOutput's field values, in order


def token_output_from_row(row: tuple) -> TokenOutput:
    return TokenOutput(*row)


def _token_batch_from_rows(rows: list[tuple]) -> "TokenBatch":
    return TokenBatch([TokenOutput(*row) for row in rows])


@dataclass
class TokenBatch:
    outputs: list[TokenOutput]

    def __reduce__(self) -> tuple[Any, tuple[list[tuple]]]:
        """Pickled as one tuple of field values per output (the server's scheduler
        pickles a batch every step: pickle's generic path for slotted dataclasses
        costs several times more; docs/benchmarks.md)."""
        return _token_batch_from_rows, ([token_output_row(o) for o in self.outputs],)
