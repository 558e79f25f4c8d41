"""SGLang's launch flags that need nothing of radixrt, or ask for what it always does, taken so
that an SGLang command line (``python -m sglang.launch_server ...``) or ``sglang.Engine(**kwargs)``
works unchanged. Each says why it changes nothing here; a value radixrt cannot honour is refused.
SGLang's flags that do change something are fields of the sections they belong to
(``--model-path``, ``--tokenizer-path``, ``--chat-template``, ``--mem-fraction-static``...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixrt.config.fields import check_choice, setting

GRAMMAR_BACKENDS = ("xgrammar",)
TOKENIZER_MODES = ("auto",)  # the tokenizers' fast tokenizer, as SGLang's auto picks
HICACHE_IO_BACKENDS = ("direct", "kernel")
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class SGLangFlagSettings:
    """SGLang's flags accepted for its command lines (each says why it changes nothing here)."""

    trust_remote_code: bool = setting(
        False, "SGLang's: accepted; radixrt runs Llama-family folders with its own code, never a folder's"
    )
    enable_metrics: bool = setting(False, "SGLang's: accepted; /metrics is always served")
    enable_cache_report: bool = setting(
        False, "SGLang's: accepted; usage.prompt_tokens_details.cached_tokens is always reported"
    )
    enable_mixed_chunk: bool = setting(
        False, "SGLang's: accepted; a step always runs prompt chunks beside the decoding requests"
    )
    max_prefill_tokens: Optional[int] = setting(
        None, "SGLang's: accepted; the prompt tokens of a step are bounded by --chunked-prefill-size"
    )
    grammar_backend: Optional[str] = setting(
        None, "SGLang's: the constrained-decoding backend; xgrammar is the only one; unset: xgrammar"
    )
    skip_server_warmup: bool = setting(
        False,
        "SGLang's: start without warming up; here a server's front skips parsing one grammar at start-up "
        "(loading xgrammar and torch, about 1.4 s of CPU), so the first request with a grammar pays for it",
    )
    watchdog_timeout: Optional[float] = setting(
        None,
        "SGLang's: accepted; a scheduler that stops making progress turns /health to 503 after "
        "--scheduler-stall-timeout-s instead of ending the server",
    )
    schedule_conservativeness: Optional[float] = setting(
        None,
        "SGLang's: accepted; radixrt admits a request when the KV its prompt and output may take is free "
        "(retraction covers decoding that outgrows it)",
    )
    revision: Optional[str] = setting(
        None, "SGLang's: accepted; models are local folders (no hub is reached), so no revision is fetched"
    )
    download_dir: Optional[str] = setting(None, "SGLang's: accepted; nothing is downloaded from a hub")
    tokenizer_mode: Optional[str] = setting(None, "SGLang's: auto (the fast tokenizer) is the only mode")
    nnodes: Optional[int] = setting(None, "SGLang's: 1; radixrt serves from one machine")
    node_rank: Optional[int] = setting(None, "SGLang's: 0; radixrt serves from one machine")
    disable_custom_all_reduce: bool = setting(
        False, "SGLang's: accepted; tensor parallelism's all-reduce is torch.distributed's"
    )
    enable_p2p_check: bool = setting(False, "SGLang's: accepted; nothing here needs it")
    base_gpu_id: Optional[int] = setting(
        None,
        "SGLang's (RL frameworks pass it): the GPU of the first rank; radixrt's ranks take GPUs 0..tp-1 of "
        "those visible, so 0 only (choose the GPUs with CUDA_VISIBLE_DEVICES)",
    )
    gpu_id_step: Optional[int] = setting(None, "SGLang's: the step between the ranks' GPUs; 1 only (see --base-gpu-id)")
    dist_init_addr: Optional[str] = setting(
        None,
        "SGLang's: the address where the ranks of several machines meet; accepted: radixrt's ranks run "
        "on one machine and meet through a file",
    )
    nccl_port: Optional[int] = setting(
        None, "SGLang's: the port where the ranks' NCCL group meets; accepted: radixrt's ranks meet through a file"
    )
    port: Optional[int] = setting(
        None, "SGLang's Engine takes the port its server would use; accepted: an Engine serves no HTTP", cli=False
    )
    mm_attention_backend: Optional[str] = setting(
        None, "SGLang's: the attention of a multimodal model's vision encoder; accepted: radixrt serves text models"
    )
    hicache_io_backend: Optional[str] = setting(
        None,
        "SGLang's: how the host KV tier's copies run (direct or kernel); accepted: radixrt's tier copies pages "
        "with its own batched copies",
    )
    hicache_mem_layout: Optional[str] = setting(
        None,
        f"SGLang's: the host KV tier's memory layout ({', '.join(HICACHE_MEM_LAYOUTS)}); accepted: radixrt's "
        "tier is page first (a host page holds its tokens' K and V of every layer)",
    )
    hicache_storage_prefetch_policy: Optional[str] = setting(
        None,
        "SGLang's: when a request stops waiting for the storage tier's blocks; wait_complete only: radixrt "
        "holds a request until every stored block of its prompt it found is read",
    )
    sleep_on_idle: bool = setting(False, "SGLang's: accepted; an idle scheduler always sleeps until a request comes")
    enable_tokenizer_batch_encode: bool = setting(
        False, "SGLang's: accepted; a batch's prompts are tokenized in the front's tokenizer threads"
    )
    disable_outlines_disk_cache: bool = setting(
        False, "SGLang's: accepted; grammars are xgrammar's, compiled grammars are cached in memory only"
    )
    show_time_cost: bool = setting(
        False, "SGLang's: accepted; radixrt times no marked regions (/start_profile profiles the steps)"
    )
    collect_tokens_histogram: bool = setting(
        False,
        "SGLang's: accepted; /metrics always has the prompt and generation token histograms "
        "(radixrt_request_prompt_tokens, radixrt_request_generation_tokens; SGLang's names too)",
    )
    model_impl: Optional[str] = setting(
        None, "SGLang's: auto or sglang (radixrt's own implementation of the model); not transformers"
    )
    ep_size: Optional[int] = setting(None, "SGLang's: 1; radixrt serves dense models, without expert parallelism")
    cpu_offload_gb: Optional[float] = setting(None, "SGLang's: 0; radixrt keeps every weight on its device")
    enable_memory_saver: bool = setting(
        False,
        "SGLang's (RL frameworks pass it): accepted; release_memory_occupation and resume_memory_occupation "
        "work without it",
    )

    def __post_init__(self) -> None:
        if self.grammar_backend is not None:
            check_choice("grammar_backend", self.grammar_backend, GRAMMAR_BACKENDS)
        for name, choices in (
            ("tokenizer_mode", TOKENIZER_MODES),
            ("hicache_io_backend", HICACHE_IO_BACKENDS),
            ("hicache_mem_layout", HICACHE_MEM_LAYOUTS),
        ):
            if getattr(self, name) is not None:
                check_choice(name, getattr(self, name), choices)
        if self.hicache_storage_prefetch_policy not in (None, "wait_complete"):
            raise ValueError(
                "hicache_storage_prefetch_policy must be wait_complete: radixrt holds a request until every "
                "stored block of its prompt it found is read"
            )
        for name, only in (("nnodes", 1), ("node_rank", 0)):
            if getattr(self, name) not in (None, only):
                raise ValueError(f"{name} must be {only}: radixrt serves from one machine")
        if self.ep_size not in (None, 1):
            raise ValueError("ep_size must be 1: radixrt serves dense models, without expert parallelism")
        if self.cpu_offload_gb not in (None, 0):
            raise ValueError("cpu_offload_gb must be 0: radixrt keeps every weight on its device")
        if self.model_impl not in (None, "auto", "sglang"):
            raise ValueError(f"model_impl {self.model_impl!r}: radixrt runs its own implementation (auto or sglang)")
        for name, only in (("base_gpu_id", 0), ("gpu_id_step", 1)):
            if getattr(self, name) not in (None, only):
                raise ValueError(
                    f"{name} must be {only}: radixrt's ranks take GPUs 0..tp-1 of those visible "
                    "(choose the GPUs with CUDA_VISIBLE_DEVICES)"
                )
        for name in ("nccl_port", "port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be 0 to 65535")
        for name in ("watchdog_timeout", "schedule_conservativeness"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
