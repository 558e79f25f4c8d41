"""Runtime configuration shared by the Engine, the server and the CLI."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from radixrt.config_deps import ENGINE_NEEDS, apply_needs, field_defaults
from radixrt.memory.kv_format import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from radixrt.requests.intake import Limits

# One line of `--help` per EngineConfig field (argparse adds the default).
CLI_HELP = {
    "disable_overlap_schedule": "process each step's results before scheduling the next; --no-disable-overlap-"
                                "schedule schedules and launches the next step while the current one runs. Default: "
                                "overlap on CUDA, none on the CPU (where it measured slower: the forward's many small "
                                "ops and the scheduler's Python take turns on one interpreter lock)",
    "model_path": "'default' (the embedded SmolLM2-135M-Instruct) or a local Hugging Face model folder "
                  "(config.json + safetensors)",
    "device": "cpu or cuda",
    "tp_size": "tensor parallelism: split each layer over this many processes (GPUs 0..N-1 on CUDA with NCCL; "
               "processes on the CPU with gloo, for correctness rather than speed)",
    "dtype": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16",
    "kv_cache_dtype": "how the KV cache stores K/V: auto (the model dtype), int8 (per-token, per-head scales; "
                      "torch attention only), fp8_e4m3 or fp8_e5m2 (one scale per layer); int8/fp8 about double "
                      "the tokens per GB against bfloat16",
    "attention_backend": "auto (flashinfer on CUDA, torch on CPU), torch or flashinfer",
    "disable_cuda_graph": "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs",
    "cuda_graph_max_bs": "CUDA: largest decode batch captured in a graph (capped at --max-running-requests)",
    "sampling_backend": "radixrt (reproducible per request) or flashinfer (CUDA sampling kernels)",
    "page_size": "tokens per KV-cache page",
    "max_total_tokens": "KV pool capacity in tokens; unset: sized by --mem-fraction",
    "mem_fraction": "share of free memory given to the KV pool (give it or --max-total-tokens, not both)",
    "context_length": "longest prompt + output in tokens; unset: the model's max_position_embeddings",
    "chunked_prefill_size": "most prompt tokens computed in one step; longer prompts are prefilled in chunks",
    "max_running_requests": "most requests decoding at once",
    "schedule_policy": "order of the waiting queue: lpm (longest cached prefix first), dfs-weight "
                       "(depth-first over the radix tree, busiest branch first) or fcfs (arrival order)",
    "enable_priority_scheduling": "order the waiting queue by each request's 'priority' first (then by "
                                  "--schedule-policy); without it 'priority' is accepted and ignored",
    "schedule_low_priority_values_first": "with --enable-priority-scheduling: a lower 'priority' value runs "
                                          "first (default: a higher value runs first, as in SGLang)",
    "priority_scheduling_preemption_threshold": "with --enable-priority-scheduling and a full batch: a waiting "
                                                "request at least this much more urgent than a running one "
                                                "preempts it (the running one is retracted and re-queued)",
    "max_client_priority": "largest 'priority' a request may give, in absolute value: a value outside "
                           "[-N, N] is refused (400 naming 'priority'); the same bound holds for the Engine",
    "priority_aging_s": "with --enable-priority-scheduling: a request's effective priority rises by one every "
                        "this many seconds since it arrived, so no request waits forever behind more urgent "
                        "ones (0: no aging)",
    "disable_radix_cache": "no prefix reuse: every prompt is computed in full (a baseline)",
    "enable_hierarchical_cache": "a host-memory KV tier under the radix cache: prefixes evicted from the device "
                                 "pool move to host memory and are loaded back when matched again",
    "hicache_ratio": "host KV tier size as a multiple of the device KV pool (giving it turns the tier on; give one "
                     "of --hicache-ratio, --hicache-size, --host-kv-size)",
    "hicache_size": "host KV tier size in GiB (0: use --hicache-ratio; giving it turns the tier on)",
    "host_kv_size": "host KV tier size in tokens (giving it turns the tier on)",
    "hicache_write_policy": "write_through (copy a prefix to the host when it is cached; evictions copy "
                            "nothing) or write_back (copy it only when the device evicts it)",
    "hicache_kv_cache_dtype": "how the host tier stores K/V: auto (as the device pool: exact) or int8 "
                              "(about half the host bytes of bfloat16, lossy)",
    "preemption_mode": "what happens to a request retracted under KV pressure: recompute (its KV is freed and "
                       "recomputed when it resumes) or swap (with --enable-hierarchical-cache: its KV moves to "
                       "the host tier and back, when a cost model says copying is cheaper than recomputing)",
    "in_batch_prefix_threshold": "hold back a request that shares at least this many uncached prompt tokens "
                                 "with one being computed, so it reads them from the cache instead",
    "random_seed": "seeds the sampling of requests that give no seed of their own",
    "enable_deterministic_inference": "batch-invariant computation: a seeded request's output does not depend "
                                      "on batch composition, chunking, prefix-cache hits or retraction (slower; "
                                      "torch attention, no CUDA graphs)",
    "log_level": "debug, info (per-step batch size, throughput, cache hit rate, KV use), warning or error",
    "log_interval": "steps between two throughput log lines (needs --log-level info or debug)",
    "debug_check_invariants": "check free + tree + private == total KV slots after every step (slow; tests)",
    "enable_jump_forward": "constrained decoding: append grammar-forced text as verified drafts",
    "grammar_cache_size": "compiled grammars kept (least recently used dropped first)",
    "grammar_max_chars": "refuse (400) a regex, JSON schema or grammar whose shortest instance, or any part's, is "
                         "longer than this many characters, or that has no finite instance (a schema that "
                         "requires itself): bounds jump-forward searches",
    "grammar_max_repeat": "refuse (400) a grammar with a counted repetition ({m,n}, minLength, maxItems, ...) "
                          "above this: bounds grammar compilation",
    "incremental_streaming_output": "streamed /generate results (and Engine streams) send only what is new in "
                                    "each event: text, output_ids and output logprobs (SGLang's flag); default: "
                                    "each event is the cumulative result",
    "max_n": "most samples of one prompt (sampling param n) a request may ask for, on every route "
             "(/generate, the OpenAI routes, the Engine); more is refused (400)",
    "max_top_logprobs_num": "most top logprobs per position a request may ask for (top_logprobs_num on "
                            "/generate and the Engine, logprobs / top_logprobs on the OpenAI routes); more is "
                            "refused (400)",
}

# switches whose default (None) depends on the device
_UNSET_SWITCHES = ("disable_overlap_schedule",)


@dataclass
class EngineConfig:
    model_path: str = "default"
    device: str = "cpu"  # "cpu" | "cuda"
    tp_size: int = 1  # tensor-parallel ranks (radixrt/executor/parallel/)
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA) | "float32" | "bfloat16" | "float16"
    # "auto" (the model dtype) | "int8" | "fp8_e4m3" | "fp8_e5m2": see radixrt/memory/kv_format.py
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"  # "auto" (flashinfer on CUDA, torch on CPU) | "torch" | "flashinfer"
    disable_cuda_graph: bool = False  # CUDA: run decode steps eagerly instead of replaying captured graphs
    cuda_graph_max_bs: int = 128  # CUDA: largest decode batch captured in a graph (capped at max_running_requests)
    # "radixrt" (reproducible per request) | "flashinfer" (CUDA kernels, see flashinfer_sampler.py)
    sampling_backend: str = "radixrt"
    page_size: int = 1
    max_total_tokens: Optional[int] = None  # KV pool capacity in tokens; None: from mem_fraction
    mem_fraction: float = 0.3  # share of free memory given to the KV pool when max_total_tokens is None
    context_length: Optional[int] = None  # default: the model's max_position_embeddings
    chunked_prefill_size: int = 2048  # max prompt tokens computed in one step
    max_running_requests: int = 128
    # process each step's results before scheduling the next; None: overlap on CUDA only (see overlap_schedule)
    disable_overlap_schedule: Optional[bool] = None
    schedule_policy: str = "lpm"  # "lpm" | "dfs-weight" | "fcfs"
    enable_priority_scheduling: bool = False  # waiting queue ordered by request priority first
    schedule_low_priority_values_first: bool = False  # default: higher priority value runs first (SGLang's)
    priority_scheduling_preemption_threshold: int = 10  # urgency gap that lets a waiting request preempt
    max_client_priority: int = 100  # |priority| above this is refused at the front door (400)
    priority_aging_s: float = 0.1  # +1 effective priority per this many seconds since arrival; 0: no aging
    disable_radix_cache: bool = False
    # host-memory tier under the radix tree (radixrt/memory/host_pool.py); SGLang's flag names
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host tier = ratio x device pool, unless a size is given
    hicache_size: float = 0.0  # GiB of host KV; 0: use hicache_ratio
    host_kv_size: Optional[int] = None  # tokens of host KV; overrides both
    hicache_write_policy: str = "write_through"  # "write_through" | "write_back"
    hicache_kv_cache_dtype: str = "auto"  # "auto" (as the device pool) | "int8"
    preemption_mode: str = "recompute"  # "recompute" | "swap" (radixrt/memory/swap_cost.py decides per model)
    in_batch_prefix_threshold: int = 32  # defer a request sharing >= this many uncached tokens with one being computed
    random_seed: int = 0
    # batch-invariant kernels (executor/batch_invariant.py, kernels/fixed_split.py): bit-identical results
    # per request whatever the batch; forces the torch attention backend and no CUDA graphs
    enable_deterministic_inference: bool = False
    log_level: str = "warning"
    log_interval: int = 40  # steps between throughput log lines
    debug_check_invariants: bool = False  # assert free + tree + private == total after every step (tests)
    enable_jump_forward: bool = True  # append grammar-forced text as verified drafts (see grammar.py)
    grammar_cache_size: int = 128  # compiled grammars kept (LRU)
    # what one request's grammar may cost (radixrt/sampling/grammar_bounds.py); beyond: a 400
    grammar_max_chars: int = 65536  # shortest text of any grammar rule, in characters
    grammar_max_repeat: int = 65536  # largest counted repetition ({m,n}, minLength, minItems, ...)
    incremental_streaming_output: bool = False  # stream events carry only what is new (requests/results.py)
    # (the same defaults as intake.DEFAULT_MAX_N / DEFAULT_MAX_TOP_LOGPROBS_NUM)
    max_n: int = 128  # most samples per prompt (sampling param n), every route
    max_top_logprobs_num: int = 20  # most top logprobs per position, every route

    def __post_init__(self) -> None:
        # flags that need another: implied or refused (one table: radixrt/config_deps.py)
        apply_needs(self, ENGINE_NEEDS, field_defaults(EngineConfig))
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.schedule_policy not in ("lpm", "dfs-weight", "fcfs"):
            raise ValueError(f"unknown schedule_policy {self.schedule_policy!r}; choose lpm, dfs-weight or fcfs")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be at least page_size")
        if self.cuda_graph_max_bs < 0:
            raise ValueError("cuda_graph_max_bs must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose {', '.join(KV_CACHE_DTYPES)}")
        if self.sampling_backend not in ("radixrt", "flashinfer"):
            raise ValueError(f"unknown sampling_backend {self.sampling_backend!r}; choose radixrt or flashinfer")
        if self.grammar_cache_size < 1:
            raise ValueError("grammar_cache_size must be >= 1")
        if self.grammar_max_chars < 1 or self.grammar_max_repeat < 1:
            raise ValueError("grammar_max_chars and grammar_max_repeat must be >= 1")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if self.max_top_logprobs_num < 0:
            raise ValueError("max_top_logprobs_num must be >= 0")
        if not 0 <= self.max_client_priority < 2**62:
            raise ValueError("max_client_priority must be in [0, 2**62)")
        if not self.priority_aging_s >= 0:
            raise ValueError("priority_aging_s must be >= 0 (0: no aging)")
        self._check_hicache()

    def _check_hicache(self) -> None:
        if self.hicache_write_policy not in ("write_through", "write_back"):
            raise ValueError(f"unknown hicache_write_policy {self.hicache_write_policy!r}; "
                             "choose write_through or write_back")
        if self.hicache_kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"unknown hicache_kv_cache_dtype {self.hicache_kv_cache_dtype!r}; choose auto or int8")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}; choose recompute or swap")
        bad_tokens = self.host_kv_size is not None and self.host_kv_size < 1
        if self.hicache_ratio <= 0 or self.hicache_size < 0 or bad_tokens:
            raise ValueError("hicache_ratio must be > 0, hicache_size >= 0 and host_kv_size >= 1")

    @property
    def overlap_schedule(self) -> bool:
        """Whether the next step is scheduled while the current one runs (the
        scheduler's overlap). ``disable_overlap_schedule`` decides when set;
        unset, overlap runs on CUDA, where kernels run asynchronously, and not
        on the CPU: there the forward thread spends its time dispatching small
        ops that need the interpreter lock the scheduler's Python holds, so the
        two threads take turns and a step got slower with overlap
        (``python -m radixrt.bench.step_time``)."""
        if self.disable_overlap_schedule is None:
            return self.device.startswith("cuda")
        return not self.disable_overlap_schedule

    def limits(self, context_length: int, kv_total_slots: int, vocab_size: int) -> "Limits":
        """The front door's `Limits` for a runtime of these sizes under this config."""
        from radixrt.requests.intake import Limits
        from radixrt.sampling.grammar_bounds import GrammarLimits

        return Limits(context_length, kv_total_slots, vocab_size, max_n=self.max_n,
                      max_top_logprobs_num=self.max_top_logprobs_num, max_client_priority=self.max_client_priority,
                      grammar=GrammarLimits(self.grammar_max_chars, self.grammar_max_repeat))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag-name`` per field (``--model`` for model_path)."""
        for f in dataclasses.fields(cls):
            flag = "--model" if f.name == "model_path" else "--" + f.name.replace("_", "-")
            aliases = ("--tp",) if f.name == "tp_size" else ()  # SGLang's short form
            default = f.default
            if f.name in _UNSET_SWITCHES:  # --flag, --no-flag, or neither (None: decided by the device)
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                    help=CLI_HELP.get(f.name))
                continue
            if isinstance(default, bool):
                # --flag / --no-flag for switches that default to on
                action = argparse.BooleanOptionalAction if default else "store_true"
                parser.add_argument(flag, dest=f.name, action=action, default=default, help=CLI_HELP.get(f.name))
                continue
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("max_total_tokens", "context_length", "host_kv_size"):
                kind = int
            parser.add_argument(flag, *aliases, dest=f.name, type=kind, default=default, help=CLI_HELP.get(f.name))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
