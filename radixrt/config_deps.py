"""Flags that only act together with another setting: one table, applied in one place.

A row of :data:`ENGINE_NEEDS` says: when the flag ``flag`` (a field of one
of ``EngineConfig``'s sections, by its flat name) is set, the flag ``needs``
(of any section) must satisfy the row; if it does not, the row
either sets it (``imply``: the flag leaves no doubt what is wanted) or the
config is refused with a ``ValueError`` naming the flag and the missing
setting. A flag counts as set when its value differs from the field's
default (``when`` narrows that for flags where only some values need
something, e.g. ``preemption_mode="swap"``), so passing a flag at its
default is never refused: it changes nothing. ``EngineConfig``'s constructor
calls :func:`apply_needs` on the flat flags before it builds the sections, so
the Engine, ``radixrt generate`` and ``radixrt serve`` all get the same answer; ``serve_router_needs`` in
radixrt/cli.py makes rows of the same kind for the flags only
`radixrt serve --dp N` reads.

Decisions, per group (SGLang's behaviour where it has one):

* host KV tier sizes and knobs (``host_kv_size``, ``hicache_size``,
  ``hicache_ratio``, ``hicache_write_policy``, ``hicache_kv_cache_dtype``)
  imply ``enable_hierarchical_cache``: sizing a tier asks for one (SGLang
  ignores them without the switch, which is what this table exists to stop).
  Their defaults are unset (None), so that giving one at its usual value asks too.
  At most one of the three sizes may be given (the larger one used to win
  silently).
* ``preemption_mode="swap"`` is refused without the tier (it would bring a
  tier nobody sized).
* the speculative-decoding knobs (``speculative_num_draft_tokens``,
  ``speculative_ngram_order``, ``speculative_tree_width``) imply
  ``speculative_algorithm="RADIX"`` (SGLang ignores them while speculation is
  off); unset by default, as the tier's, so that their usual values ask too.
* the priority knobs are refused without ``enable_priority_scheduling``
  (SGLang warns that they "have no effect"; turning it on would reorder
  every request by its ``priority``).
* everything that cannot run as asked on the device or with another switch
  (FlashInfer on the CPU, CUDA-graph sizes where no graph is captured,
  deterministic inference with FlashInfer, the storage tier under tensor parallelism, the tier
  without the radix cache) is refused: there is nothing to imply.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Need:
    """``flag`` (when set) needs field ``needs`` to satisfy ``ok``.

    ``example`` is a value of ``flag`` that counts as set; ``met`` and
    ``unmet`` are values of ``needs`` that do and do not satisfy the row
    (``met`` is what an ``imply`` row sets). The test of this table walks
    every row both ways with them."""

    flag: str
    example: Any
    needs: str
    met: Any
    unmet: Any
    wants: str  # the missing setting, as a user of the CLI writes it
    ok: Callable[[Any], bool]
    imply: bool = False
    when: Optional[Callable[[Any], bool]] = None  # None: set when it differs from its default
    cli: Optional[str] = None  # the flag's CLI spelling when it is not --<flag with dashes>

    def is_set(self, value: Any, default: Any) -> bool:
        return self.when(value) if self.when is not None else value != default

    def flag_text(self, value: Any) -> str:
        cli = self.cli or "--" + self.flag.replace("_", "-")
        return f"{self.flag}={value!r} ({cli if value is True else f'{cli} {value}'})"


def _equals(value: Any) -> Callable[[Any], bool]:
    return lambda v: v == value


def _is_not(value: Any) -> Callable[[Any], bool]:
    return lambda v: v != value


def _on(flag: str, example: Any, switch: str, imply: bool = False, **kw: Any) -> Need:
    """``flag`` needs the boolean field ``switch`` on."""
    wants = f"{switch}=True (--{switch.replace('_', '-')})"
    return Need(flag, example, switch, True, False, wants, _equals(True), imply=imply, **kw)


def _off(flag: str, example: Any, switch: str, **kw: Any) -> Need:
    """``flag`` cannot act with the boolean field ``switch`` on."""
    wants = f"{switch}=False (no --{switch.replace('_', '-')})"
    return Need(flag, example, switch, False, True, wants, _equals(False), **kw)


def _cuda(flag: str, example: Any, **kw: Any) -> Need:
    return Need(flag, example, "device", "cuda", "cpu", "device='cuda' (--device cuda)", _runs_flashinfer, **kw)


def _runs_flashinfer(device: Any) -> bool:
    """FlashInfer's kernels run on CUDA only; a loaded stand-in module that
    declares ``RUNS_ON_CPU`` (the CPU emulation of scripts/device/gpu_check.py
    --dry-run) runs on the CPU. Never imports flashinfer."""
    return str(device).startswith("cuda") or bool(getattr(sys.modules.get("flashinfer"), "RUNS_ON_CPU", False))


def _graph_needs(flag: str, example: Any) -> list[Need]:
    """What a flag sizing the decode CUDA graphs needs: graphs are captured on CUDA only, with
    FlashInfer attention (so a 16-bit model and a cache it reads), on one process."""
    return [
        _cuda(flag, example),
        _off(flag, example, "disable_cuda_graph"),
        _off(flag, example, "enable_deterministic_inference"),
        _tp1(flag, example),
        Need(
            flag,
            example,
            "attention_backend",
            "auto",
            "torch",
            "attention_backend='auto' or 'flashinfer' (graphs need FlashInfer attention)",
            _is_not("torch"),
        ),
        Need(
            flag,
            example,
            "kv_cache_dtype",
            "auto",
            "int8",
            "a kv_cache_dtype other than 'int8' (an int8 cache runs the torch backend, without graphs)",
            _is_not("int8"),
        ),
        Need(
            flag,
            example,
            "dtype",
            "auto",
            "float32",
            "dtype='auto', 'bfloat16' or 'float16' (FlashInfer, and so the graphs, take 16-bit models only)",
            _is_not("float32"),
        ),
    ]


_GRAPH_FLAGS = (("cuda_graph_max_bs", 32), ("cuda_graph_bs", [8, 16]), ("disable_cuda_graph_padding", True))


def _tp1(flag: str, example: Any) -> Need:
    return Need(
        flag, example, "tp_size", 1, 2, "tp_size=1 (--tp-size 1: it does not run tensor parallel yet)", _equals(1)
    )


def _unset(flag: str, example: Any, other: str, other_example: Any, what: str) -> Need:
    """``flag`` and ``other`` size the same thing: give one."""
    wants = f"{other} unset (no --{other.replace('_', '-')}: give one {what})"
    return Need(flag, example, other, None, other_example, wants, _equals(None))


def _is_int4(name: Any) -> bool:
    """Whether ``name`` spells int4 weight quantization (radixrt/config/weight_format.py's names)."""
    key = str(name).lower().replace("-", "_")
    return key in ("int4", "int4wo", "int4_weight_only", "w4a16") or key.startswith("int4wo_")


_TIER = "enable_hierarchical_cache"
_PRIORITY = "enable_priority_scheduling"
_STORAGE = "hicache_storage_backend"
_LORA = "enable_lora"
_INT8 = _equals("int8")
_FLASHINFER = _equals("flashinfer")
_TORCH_OR_AUTO = "attention_backend='torch' or 'auto' (--attention-backend torch"

ENGINE_NEEDS: tuple[Need, ...] = (
    # the host KV tier: its sizes and knobs turn it on; one size at most
    _on("host_kv_size", 20000, _TIER, imply=True),
    _on("hicache_size", 4.0, _TIER, imply=True),
    _on("hicache_ratio", 3.0, _TIER, imply=True),
    _on("hicache_write_policy", "write_back", _TIER, imply=True),
    _on("hicache_kv_cache_dtype", "int8", _TIER, imply=True),
    Need(
        "hicache_ratio",
        3.0,
        "hicache_size",
        0.0,
        4.0,
        "hicache_size=0 (no --hicache-size: give one tier size)",
        _equals(0.0),
    ),
    _unset("hicache_ratio", 3.0, "host_kv_size", 20000, "tier size"),
    _unset("hicache_size", 4.0, "host_kv_size", 20000, "tier size"),
    _on("preemption_mode", "swap", _TIER, when=_equals("swap")),
    # the storage tier sits under the host tier; its knobs need a backend
    _on("hicache_storage_backend", "file", _TIER, imply=True),
    *(
        Need(
            flag,
            example,
            _STORAGE,
            "file",
            None,
            "hicache_storage_backend (--hicache-storage-backend file or redis)",
            lambda v: v is not None,
        )
        for flag, example in (
            ("hicache_storage_dir", "/tmp/kv"),
            ("hicache_storage_url", "redis://127.0.0.1:6390/0"),
            ("hicache_storage_quota_gb", 2.0),
            ("hicache_storage_block_tokens", 128),
            ("hicache_storage_restore_tokens", 0),
            ("hicache_storage_restore_wait", True),
        )
    ),
    Need(
        _TIER,
        True,
        "disable_radix_cache",
        False,
        True,
        "disable_radix_cache=False (no --disable-radix-cache: the tier sits under the radix cache)",
        _equals(False),
    ),
    _tp1(_STORAGE, "file"),  # a stored block holds every head's K/V: one process's pool
    # LoRA adapters: giving some turns serving them on; the knobs need it; one process, no CUDA graphs
    _on("lora_paths", ["a=/tmp/a"], _LORA, imply=True),
    _on("max_loras_per_batch", 2, _LORA),
    _on("max_loaded_loras", 8, _LORA),
    _on("max_lora_rank", 16, _LORA),
    _on("lora_target_modules", ["q_proj"], _LORA),
    _tp1(_LORA, True),
    Need(
        _LORA,
        True,
        "disable_cuda_graph",
        True,
        False,
        "disable_cuda_graph=True (--disable-cuda-graph: a graph cannot hold each step's adapters)",
        _equals(True),
        imply=True,
    ),
    # priority scheduling's knobs
    _on("schedule_low_priority_values_first", True, _PRIORITY),
    _on("priority_scheduling_preemption_threshold", 5, _PRIORITY),
    _on("priority_aging_s", 1.0, _PRIORITY),
    # the KV pool's size: a token count, or a share of memory
    _unset("mem_fraction", 0.5, "max_total_tokens", 4096, "pool size"),
    # prefix reuse
    _off("in_batch_prefix_threshold", 64, "disable_radix_cache"),
    # device and backends
    _cuda("attention_backend", "flashinfer", when=_FLASHINFER),
    _cuda("sampling_backend", "flashinfer", when=_FLASHINFER),
    Need(
        "kv_cache_dtype",
        "int8",
        "attention_backend",
        "torch",
        "flashinfer",
        _TORCH_OR_AUTO + ": FlashInfer cannot read an int8 cache)",
        _is_not("flashinfer"),
        when=_INT8,
    ),
    # batch-invariant inference runs the torch backend and the radixrt sampler
    Need(
        "enable_deterministic_inference",
        True,
        "attention_backend",
        "torch",
        "flashinfer",
        _TORCH_OR_AUTO + ")",
        lambda v: v in ("auto", "torch"),
    ),
    Need(
        "enable_deterministic_inference",
        True,
        "sampling_backend",
        "radixrt",
        "flashinfer",
        "sampling_backend='radixrt' (--sampling-backend radixrt)",
        _equals("radixrt"),
    ),
    # CUDA graphs are captured only on CUDA, with FlashInfer attention, on one process
    *(row for flag, example in _GRAPH_FLAGS for row in _graph_needs(flag, example)),
    # speculative decoding: sizing the drafts asks for it
    *(
        Need(
            flag,
            example,
            "speculative_algorithm",
            "RADIX",
            None,
            "speculative_algorithm='RADIX' (--speculative-algorithm RADIX)",
            _is_not(None),
            imply=True,
        )
        for flag, example in (
            ("speculative_num_draft_tokens", 4),
            ("speculative_ngram_order", 6),
            ("speculative_tree_width", 1),
        )
    ),
    # weight-only quantization: the CPU kernels (deterministic mode keeps every product in integers:
    # batch-invariant); under tensor parallelism each rank quantizes its shards
    Need(
        "quantization",
        "int8",
        "device",
        "cpu",
        "cuda",
        "device='cpu' (--device cpu: weight-only quantization has CPU kernels only)",
        lambda d: not str(d).startswith("cuda"),
    ),
    Need(
        "quantization_group_size",
        64,
        "quantization",
        "int4",
        "int8",
        "quantization='int4' (--quantization int4: only int4 has groups)",
        _is_int4,
    ),
    Need(
        "quantize_lm_head",
        True,
        "quantization",
        "int8",
        None,
        "quantization='int8' or 'int4' (--quantization int8|int4)",
        _is_not(None),
    ),
    # torch.compile of the layers: CPU kernels as custom ops, one process, no per-row adapters
    Need(
        "enable_torch_compile",
        True,
        "device",
        "cpu",
        "cuda",
        "device='cpu' (--device cpu: the compiled layers run on the CPU only in this version)",
        lambda d: not str(d).startswith("cuda"),
    ),
    _tp1("enable_torch_compile", True),
    _off("enable_torch_compile", True, "enable_deterministic_inference"),
    _off("enable_torch_compile", True, _LORA),
    # KV budgets drop single positions from a request's slot list, and score attention over all heads
    Need(
        "kv_budget",
        0.25,
        "page_size",
        1,
        4,
        "page_size=1 (--page-size 1: a KV budget drops single positions)",
        _equals(1),
    ),
    _tp1("kv_budget", 0.25),
    # logging
    Need(
        "log_interval",
        10,
        "log_level",
        "info",
        "warning",
        "log_level='info' or 'debug' (--log-level info: it paces the info lines)",
        lambda v: str(v).lower() in ("info", "debug"),
    ),
)

# The EngineConfig flags that need nothing and that nothing else needs in a
# way the table could check (each was reviewed; a new field must be added to
# the table or here, tests/unit/test_config.py checks it).
ENGINE_INDEPENDENT = frozenset(
    {
        # SGLang's flags that change nothing here (each says why: radixrt/config/sglang_flags.py)
        *(
            "trust_remote_code enable_metrics enable_cache_report enable_mixed_chunk max_prefill_tokens port "
            "grammar_backend skip_server_warmup log_requests log_requests_level watchdog_timeout "
            "schedule_conservativeness revision download_dir tokenizer_mode nnodes node_rank disable_custom_all_reduce "
            "enable_p2p_check nccl_port enable_memory_saver base_gpu_id gpu_id_step dist_init_addr "
            "mm_attention_backend hicache_io_backend hicache_mem_layout hicache_storage_prefetch_policy sleep_on_idle "
            "enable_tokenizer_batch_encode disable_outlines_disk_cache show_time_cost model_impl "
            "ep_size cpu_offload_gb collect_tokens_histogram"
        ).split(),
        *"model_path tokenizer_path chat_template json_model_override_args".split(),
        "skip_tokenizer_init",  # text in is refused per request (no_tokenizer.py)
        "load_format",  # dummy weights serve as any others until replaced
        "mem_fraction_static",  # max_total_tokens, where given, decides (SGLang takes both)
        *(
            "device tp_size dtype page_size max_total_tokens context_length chunked_prefill_size "
            "long_prefill_token_threshold max_running_requests max_queued_requests disable_overlap_schedule "
            "schedule_policy enable_priority_scheduling max_client_priority disable_radix_cache disable_cuda_graph "
            "random_seed log_level debug_check_invariants allow_auto_truncate preferred_sampling_params "
            "enable_jump_forward grammar_cache_size grammar_max_chars grammar_max_repeat grammar_max_source_chars "
            "grammar_max_compile_s max_n max_request_sequences max_top_logprobs_num enable_return_hidden_states "
            "request_waiting_timeout_s request_running_timeout_s incremental_streaming_output stream_interval "
            "speculative_algorithm enable_request_time_stats_logging dist_timeout"
        ).split(),
        "kv_events_config",  # with --dp, each replica publishes on the endpoint port + its index (router/dp.py)
        "kv_budget_policy",  # these three shape per-request budgets too (sampling_params kv_budget)
        "kv_budget_sink_tokens",
        "kv_budget_recent_fraction",
    }
)


@functools.cache
def field_defaults(cls: Any) -> dict[str, Any]:
    """Each dataclass field's default (``default_factory`` fields called once;
    the dict is shared: read it, do not change it)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def apply_needs(obj: Any, needs: tuple[Need, ...], defaults: dict[str, Any]) -> None:
    """Apply ``needs`` to ``obj`` (a config, or parsed CLI arguments): set what
    the set flags imply, then raise one ``ValueError`` naming every set flag
    whose need is still unmet. Rows whose fields ``obj`` lacks are skipped."""
    rows = [n for n in needs if hasattr(obj, n.flag) and hasattr(obj, n.needs)]
    implied_by: dict[str, str] = {}
    for n in rows:
        if n.imply and n.is_set(getattr(obj, n.flag), defaults.get(n.flag)) and not n.ok(getattr(obj, n.needs)):
            setattr(obj, n.needs, n.met)
            implied_by.setdefault(n.needs, n.flag)
    problems = []
    for n in rows:
        value = getattr(obj, n.flag)
        if n.imply or not n.is_set(value, defaults.get(n.flag)) or n.ok(getattr(obj, n.needs)):
            continue
        src = implied_by.get(n.flag)
        source = f" (implied by {src}, --{src.replace('_', '-')})" if src else ""
        problems.append(f"{n.flag_text(value)}{source} needs {n.wants}")
    if problems:
        raise ValueError("; ".join(problems))
