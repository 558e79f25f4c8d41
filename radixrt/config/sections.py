"""The sections of the runtime's configuration, one small frozen dataclass each.

Each field's default and ``--help`` text live here once (:func:`setting`);
the flags of `radixrt serve` and `radixrt generate` are generated from them.
A field's name is its flag's (``page_size`` is ``--page-size``) and an
``Engine(**flags)`` keyword. Each section checks its own values; what spans
sections (a flag that needs another) is `EngineConfig`'s, through
radixrt/config_deps.py. A component takes the sections it reads: the batch
planner `SchedulingSettings`, the model runner `ModelSettings` (model_settings.py),
`ExecutionSettings` and `CacheSettings`, the host tier `HostCacheSettings`
(the per-request limits: radixrt/config/limits.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from radixrt.config.fields import check_choice, setting
from radixrt.memory.kv_budget import KV_BUDGET_POLICIES, MIN_KV_BUDGET, resolve_budget
from radixrt.memory.kv_format import KV_CACHE_DTYPES

# long_prefill_token_threshold on the CPU: a 256-token step of a small model takes a fraction of a second there
CPU_LONG_PREFILL_TOKENS = 256
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # uvicorn's, less its "trace"
UNCHUNKED_PREFILL = 1 << 30  # chunked_prefill_size -1: more than any context holds
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
# SGLang's names for CUDA attention kernels radixrt does not ship: an SGLang command line (or an RL
# framework's Engine(...)) naming one runs as auto, FlashInfer's kernels on CUDA (the same attention)
SGLANG_CUDA_ATTENTION = ("fa3", "fa4", "triton", "trtllm_mha", "flex_attention")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExecutionSettings:
    """Where and how the model runs: device, tensor parallelism, kernels, CUDA graphs, overlap."""

    device: str = setting("cpu", "cpu or cuda")
    tp_size: int = setting(
        1,
        "tensor parallelism: split each layer over this many processes (GPUs 0..N-1 on CUDA with NCCL; "
        "processes on the CPU with gloo, for correctness rather than speed)",
        aliases=("--tp", "--tensor-parallel-size"),
    )
    dist_timeout: Optional[int] = setting(
        None,
        "SGLang's: seconds the tensor-parallel ranks wait for one another, to join at start-up and in each "
        "collective, before failing (unset: 7 days; a rank waits for its next step outside any collective, "
        "so an idle server meets no timeout)",
    )
    attention_backend: str = setting(
        "auto",
        "auto (flashinfer on CUDA, torch on CPU), torch or flashinfer; SGLang's torch_native is torch, and "
        f"its {', '.join(SGLANG_CUDA_ATTENTION)} (kernels radixrt does not ship) run as auto",
    )

    sampling_backend: str = setting(
        "radixrt", "radixrt (reproducible per request) or flashinfer (CUDA sampling kernels)"
    )
    disable_cuda_graph: bool = setting(
        False, "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs"
    )
    cuda_graph_max_bs: int = setting(
        128, "CUDA: largest decode batch captured in a graph (capped at --max-running-requests)"
    )
    cuda_graph_bs: Optional[list[int]] = setting(
        None,
        "SGLang's: CUDA: the decode batch sizes captured in graphs, in place of 1, 2, 4, 8, then every 8 to 64, "
        "every 16 to 256 and every 32 beyond, up to --cuda-graph-max-bs (sizes above --max-running-requests "
        "are left out); a batch runs in the smallest captured size that holds it (default: unset)",
    )
    disable_cuda_graph_padding: bool = setting(
        False,
        "SGLang's: CUDA: a decode batch whose size was not captured runs eagerly instead of in the next "
        "larger graph with padding rows",
    )
    disable_overlap_schedule: Optional[bool] = setting(
        None,
        "process each step's results before scheduling the next; --no-disable-overlap-schedule schedules "
        "and launches the next step while the current one runs. Default: overlap on CUDA, none on the CPU "
        "(where it measured slower: the forward's many small ops and the scheduler's Python take turns on "
        "one interpreter lock)",
    )
    enable_torch_compile: bool = setting(
        False,
        "CPU: compile the decoder layers with torch.compile (inductor), fusing the small ops between "
        "the matrix products; compiled when the engine starts (cached on disk under $RADIXRT_HOME/inductor)",
    )
    enable_deterministic_inference: bool = setting(
        False,
        "batch-invariant computation: a seeded request's output does not depend on batch composition, "
        "chunking, prefix-cache hits or retraction (slower; torch attention, no CUDA graphs)",
    )

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.dist_timeout is not None and self.dist_timeout < 1:
            raise ValueError("dist_timeout must be >= 1 (seconds)")
        if self.cuda_graph_max_bs < 0:
            raise ValueError("cuda_graph_max_bs must be >= 0")
        if self.cuda_graph_bs is not None:
            if not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1:
                raise ValueError("cuda_graph_bs must hold batch sizes >= 1")
            object.__setattr__(self, "cuda_graph_bs", sorted(set(self.cuda_graph_bs)))
        if self.sampling_backend == "pytorch":  # SGLang's name for torch sampling: radixrt's own
            object.__setattr__(self, "sampling_backend", "radixrt")
        check_choice("sampling_backend", self.sampling_backend, ("radixrt", "flashinfer"))
        if self.attention_backend == "torch_native":
            object.__setattr__(self, "attention_backend", "torch")
        elif self.attention_backend in SGLANG_CUDA_ATTENTION:
            logger.warning(
                "attention_backend %r names kernels radixrt does not ship: running as 'auto' "
                "(FlashInfer's kernels on CUDA, torch on the CPU)",
                self.attention_backend,
            )
            object.__setattr__(self, "attention_backend", "auto")
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)

    @property
    def overlap_schedule(self) -> bool:
        """Whether the next step is scheduled while the current one runs (the
        scheduler's overlap). ``disable_overlap_schedule`` decides when set;
        unset, overlap runs on CUDA, where kernels run asynchronously, and not
        on the CPU: there the forward thread spends its time dispatching small
        ops that need the interpreter lock the scheduler's Python holds, so the
        two threads take turns (``python -m radixrt.bench.step_time``)."""
        if self.disable_overlap_schedule is None:
            return self.device.startswith("cuda")
        return not self.disable_overlap_schedule


@dataclass(frozen=True)
class CacheSettings:
    """The device KV pool and the prefix cache over it."""

    page_size: int = setting(1, "tokens per KV-cache page")
    max_total_tokens: Optional[int] = setting(None, "KV pool capacity in tokens; unset: sized by --mem-fraction")
    mem_fraction: float = setting(
        0.3, "share of free memory for the KV pool (or --max-total-tokens); CPU pages are backed as first used"
    )
    mem_fraction_static: Optional[float] = setting(
        None,
        "SGLang's sizing (in place of --mem-fraction): this share of the device's total memory holds the "
        "weights and the KV pool together, so the pool gets what stays free of it once the weights are loaded "
        "(--max-total-tokens, where given, decides); unset: --mem-fraction",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "how the KV cache stores K/V: auto (the model dtype), int8 (per-token, per-head scales; torch "
        "attention only), fp8_e4m3 or fp8_e5m2 (one scale per layer); int8/fp8 about double the tokens "
        "per GB against bfloat16",
    )
    disable_radix_cache: bool = setting(False, "no prefix reuse: every prompt is computed in full (a baseline)")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype == "fp8":  # vLLM's name: e4m3 (SGLang's fp8_e4m3)
            object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must hold at least one page ({self.page_size} tokens)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError("mem_fraction_static must be in (0, 1]")
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)


@dataclass(frozen=True)
class SchedulingSettings:
    """How each step's batch is formed: its size, the queue's order, priorities, preemption, seeds."""

    chunked_prefill_size: int = setting(
        2048, "most prompt tokens computed in one step; longer prompts are prefilled in chunks (-1: no chunking)"
    )
    max_running_requests: int = setting(128, "most requests decoding at once")
    max_queued_requests: Optional[int] = setting(
        None, "most requests waiting to run (samples and beams each count); past it a request is refused with 503"
    )
    schedule_policy: str = setting(
        "lpm",
        "order of the waiting queue: lpm (longest cached prefix first), dfs-weight (depth-first over the "
        "radix tree, busiest branch first), fcfs (arrival order), lof (longest max_new_tokens first) or random",
    )
    enable_priority_scheduling: bool = setting(
        False,
        "order the waiting queue by each request's 'priority' first (then by --schedule-policy); without "
        "it 'priority' is accepted and ignored",
    )
    schedule_low_priority_values_first: bool = setting(
        False,
        "with --enable-priority-scheduling: a lower 'priority' value runs first (default: a higher value "
        "runs first, as in SGLang)",
    )
    priority_scheduling_preemption_threshold: int = setting(
        10,
        "with --enable-priority-scheduling and a full batch: a waiting request at least this much more urgent "
        "than a running one preempts it (the running one is retracted and re-queued)",
    )
    priority_aging_s: float = setting(
        0.1,
        "with --enable-priority-scheduling: a request's effective priority rises by one every this many "
        "seconds since it arrived, so no request waits forever behind more urgent ones (0: no aging)",
    )
    preemption_mode: str = setting(
        "recompute",
        "what happens to a request retracted under KV pressure: recompute (its KV is freed and "
        "recomputed when it resumes) or swap (with --enable-hierarchical-cache: its KV moves to the "
        "host tier and back, when a cost model says copying is cheaper than recomputing)",
    )
    in_batch_prefix_threshold: int = setting(
        32,
        "hold back a request whose prompt shares at least this many leading tokens with one being computed, "
        "while any of them is uncached, so it reads them from the cache instead",
    )
    long_prefill_token_threshold: Optional[int] = setting(
        None,
        "while other requests run or wait, one request's prompt takes at most this many tokens of a step, "
        "so a long prompt holds back the others' tokens for a short step at a time, not a whole chunk "
        "(vLLM's flag). Unset: 256 on the CPU, where a 2048-token chunk takes seconds; no cap on CUDA. "
        "0: no cap",
    )
    random_seed: int = setting(0, "seeds the sampling of requests that give no seed of their own")
    request_waiting_timeout_s: Optional[float] = setting(
        None,
        "abort (503) a request still waiting this many seconds after it arrived (unset: "
        "$SGLANG_REQ_WAITING_TIMEOUT where set, else none; 0 or less: none)",
    )
    request_running_timeout_s: Optional[float] = setting(
        None,
        "abort (503) a request still running this many seconds after it was first admitted (unset: "
        "$SGLANG_REQ_RUNNING_TIMEOUT where set, else none; 0 or less: none)",
    )

    def __post_init__(self) -> None:
        if self.chunked_prefill_size == -1:  # SGLang's "no chunking": a prompt is computed in one step
            object.__setattr__(self, "chunked_prefill_size", UNCHUNKED_PREFILL)
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1 (unset: no limit)")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap)")
        check_choice("schedule_policy", self.schedule_policy, ("lpm", "dfs-weight", "fcfs", "lof", "random"))
        check_choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        if not self.priority_aging_s >= 0:
            raise ValueError("priority_aging_s must be >= 0 (0: no aging)")

    def shared_step_prefill_cap(self, device: str) -> int:
        """Most prompt tokens one request computes in a step when other requests run
        or wait (`long_prefill_token_threshold` resolved for ``device``); at least 1,
        at most ``chunked_prefill_size``."""
        cap = self.long_prefill_token_threshold
        if cap is None:
            cap = 0 if device.startswith("cuda") else CPU_LONG_PREFILL_TOKENS
        return self.chunked_prefill_size if cap <= 0 else min(cap, self.chunked_prefill_size)


@dataclass(frozen=True)
class GrammarSettings:
    """Constrained decoding: grammar compilation and jump-forward."""

    enable_jump_forward: bool = setting(True, "constrained decoding: append grammar-forced text as verified drafts")
    grammar_cache_size: int = setting(128, "compiled grammars kept (least recently used dropped first)")

    def __post_init__(self) -> None:
        if self.grammar_cache_size < 1:
            raise ValueError("grammar_cache_size must be >= 1")


SPECULATIVE_ALGORITHMS = ("RADIX", "NGRAM")
# each knob's value while speculation is on and it is unset, and its range
SPECULATIVE_KNOBS = {
    "speculative_num_draft_tokens": (16, 1, 64),
    "speculative_ngram_order": (8, 1, 16),
    "speculative_tree_width": (2, 1, 8),
}


@dataclass(frozen=True)
class SpeculativeSettings:
    """Speculative decoding drafted from the radix tree (no draft model)."""

    speculative_algorithm: Optional[str] = setting(
        None,
        "RADIX: draft each decode step's next tokens from the radix tree (every prompt and output the server "
        "holds, in the request's own cache namespace) and the request's own tokens, and verify them in one "
        "forward (NGRAM: the same, SGLang's name); unset: off",
        choices=list(SPECULATIVE_ALGORITHMS),
        type=str.upper,
    )
    # the knobs' defaults are unset, so that giving one at its usual value asks for speculation too
    # (config_deps); with speculation on, an unset knob takes SPECULATIVE_KNOBS' value
    speculative_num_draft_tokens: Optional[int] = setting(
        None,
        "longest draft path verified per request per step (a draft tree holds at most --speculative-tree-width "
        "times as many tokens; the cost model sizes each draft below that); unset: 16",
    )
    speculative_ngram_order: Optional[int] = setting(
        None,
        "longest context (tokens) the draft index matches in the radix tree's token runs (2, 3, 5 and 8 up to "
        "it); unset: 8",
    )
    speculative_tree_width: Optional[int] = setting(
        None,
        "most continuations a draft token branches into where earlier runs diverged (a draft tree verified with "
        "a tree attention mask); 1: drafts are chains. Chains only with deterministic inference; unset: 2",
    )

    def __post_init__(self) -> None:
        if self.speculative_algorithm is not None:
            object.__setattr__(self, "speculative_algorithm", str(self.speculative_algorithm).upper())
            check_choice("speculative_algorithm", self.speculative_algorithm, SPECULATIVE_ALGORITHMS)
        for name, (default, lo, hi) in SPECULATIVE_KNOBS.items():
            value = getattr(self, name)
            if value is not None and not lo <= value <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}]")
            if value is None and self.speculative_algorithm is not None:
                object.__setattr__(self, name, default)

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None


@dataclass(frozen=True)
class KVBudgetSettings:
    """KV budgets: requests that attend at most a budget of their positions (H2O, InfiniGen, window)."""

    kv_budget: Optional[float] = setting(
        None,
        "the KV each request attends at most: tokens (>= 32), or a fraction in (0, 1) of its prompt plus "
        "max_new_tokens; the positions kept are chosen by --kv-budget-policy. Needs --page-size 1. Requests "
        "may set their own (sampling_params kv_budget); unset: off",
    )
    kv_budget_policy: str = setting(
        "h2o",
        "which positions a request under a KV budget keeps: h2o (attention sinks, a recent window and the "
        "heavy hitters by accumulated attention; the rest evicted), infinigen (the same with evicted KV offloaded "
        "to host memory and loaded back when an estimate says attention needs it again) or window (sinks and "
        "the most recent tokens, StreamingLLM)",
        choices=list(KV_BUDGET_POLICIES),
    )
    kv_budget_sink_tokens: int = setting(4, "first positions a request under a KV budget always keeps")
    kv_budget_recent_fraction: float = setting(
        0.5, "share of a KV budget kept for the most recent positions (h2o, infinigen; the rest: heavy hitters)"
    )

    def __post_init__(self) -> None:
        check_choice("kv_budget_policy", self.kv_budget_policy, KV_BUDGET_POLICIES)
        if self.kv_budget is not None:
            resolve_budget(self.kv_budget, MIN_KV_BUDGET)  # raises for a non-positive or non-finite value
            if self.kv_budget >= 1 and self.kv_budget < MIN_KV_BUDGET:
                raise ValueError(f"kv_budget must be at least {MIN_KV_BUDGET} tokens, got {self.kv_budget:g}")
        if not 0 <= self.kv_budget_sink_tokens <= 64:
            raise ValueError("kv_budget_sink_tokens must be in [0, 64]")
        if not 0.0 < self.kv_budget_recent_fraction < 1.0:
            raise ValueError("kv_budget_recent_fraction must be in (0, 1)")


@dataclass(frozen=True)
class OutputSettings:
    """How results are delivered."""

    incremental_streaming_output: bool = setting(
        False,
        "streamed /generate results (and Engine streams) send only what is new in each event: text, "
        "output_ids and output logprobs (SGLang's flag; --stream-output, its older spelling, too); default: each "
        "event is the cumulative result",
        aliases=("--stream-output",),
    )
    stream_interval: int = setting(
        1,
        "partial results reach the front (a stream's events) every this many tokens, the first at once and the "
        "last at the finish; fewer events cost less per token (SGLang's flag; a request's stream_interval "
        "sampling parameter overrides it)",
    )

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")


@dataclass(frozen=True)
class DebugSettings:
    """Logging and self-checks."""

    log_level: str = setting(
        "warning", "debug, info (per-step batch size, throughput, cache hit rate, KV use), warning or error"
    )
    log_interval: int = setting(
        40,
        "steps between two throughput log lines (needs --log-level info or debug)",
        aliases=("--decode-log-interval",),  # SGLang's name
    )
    debug_check_invariants: bool = setting(
        False, "check free + tree + private == total KV slots after every step (slow; tests)"
    )
    log_requests: bool = setting(
        False,
        "log each request when it is received and each answer when it ends, at any --log-level, naming the "
        "client's rid (SGLang's flag)",
    )
    log_requests_level: int = setting(
        2,
        "what --log-requests writes (SGLang's levels): 0 rids, token counts, finish reasons and latencies; "
        "1 also the sampling parameters set; 2 also the prompt and output, cut to 2,048 characters; 3 whole",
    )
    enable_request_time_stats_logging: bool = setting(
        False,
        "SGLang's: the scheduler logs one line per finished request (its internal id, as --log-requests names "
        "it): prompt, cached and output tokens, and its seconds waiting to be admitted, to its first token, "
        "decoding, in all, at any --log-level",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.log_requests_level <= 3:
            raise ValueError("log_requests_level must be 0 to 3")
        if str(self.log_level).lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {str(self.log_level)[:32]!r}")
