"""Runtime configuration shared by the Engine, the server and the CLI."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineConfig:
    model_path: str = "default"
    device: str = "cpu"  # "cpu" | "cuda"
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on CUDA) | "float32" | "bfloat16" | "float16"
    attention_backend: str = "auto"  # "auto" (flashinfer on CUDA, torch on CPU) | "torch" | "flashinfer"
    disable_cuda_graph: bool = False  # CUDA: run decode steps eagerly instead of replaying captured graphs
    cuda_graph_max_bs: int = 128  # CUDA: largest decode batch captured in a graph (capped at max_running_requests)
    sampling_backend: str = "radixrt"  # "radixrt" (reproducible per request) | "flashinfer" (CUDA kernels, see flashinfer_sampler.py)
    page_size: int = 1
    max_total_tokens: Optional[int] = None  # KV pool capacity in tokens; None: from mem_fraction
    mem_fraction: float = 0.3  # share of free memory given to the KV pool when max_total_tokens is None
    context_length: Optional[int] = None  # default: the model's max_position_embeddings
    chunked_prefill_size: int = 2048  # max prompt tokens computed in one step
    max_running_requests: int = 128
    schedule_policy: str = "lpm"  # "lpm" | "dfs-weight" | "fcfs"
    disable_radix_cache: bool = False
    in_batch_prefix_threshold: int = 32  # defer a request sharing >= this many uncached tokens with one being computed
    random_seed: int = 0
    log_level: str = "warning"
    log_interval: int = 40  # steps between throughput log lines
    debug_check_invariants: bool = False  # assert free + tree + private == total after every step (tests)
    enable_jump_forward: bool = True  # append grammar-forced text as verified drafts (see grammar.py)
    grammar_cache_size: int = 128  # compiled grammars kept (LRU)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.schedule_policy not in ("lpm", "dfs-weight", "fcfs"):
            raise ValueError(f"unknown schedule_policy {self.schedule_policy!r}; choose lpm, dfs-weight or fcfs")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be at least page_size")
        if self.cuda_graph_max_bs < 0:
            raise ValueError("cuda_graph_max_bs must be >= 0")
        if self.sampling_backend not in ("radixrt", "flashinfer"):
            raise ValueError(f"unknown sampling_backend {self.sampling_backend!r}; choose radixrt or flashinfer")
        if self.grammar_cache_size < 1:
            raise ValueError("grammar_cache_size must be >= 1")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag-name`` per field (``--model`` for model_path)."""
        for f in dataclasses.fields(cls):
            flag = "--model" if f.name == "model_path" else "--" + f.name.replace("_", "-")
            default = f.default
            if isinstance(default, bool):
                # --flag / --no-flag for switches that default to on
                action = argparse.BooleanOptionalAction if default else "store_true"
                parser.add_argument(flag, dest=f.name, action=action, default=default)
                continue
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("max_total_tokens", "context_length"):
                kind = int
            parser.add_argument(flag, dest=f.name, type=kind, default=default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
