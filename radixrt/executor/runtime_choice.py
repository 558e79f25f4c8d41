"""What a runner's settings resolve to on its device, before any model is loaded: the
model and KV dtypes, the attention backend, CUDA graphs, the quantization spec."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from radixrt.config.weight_format import WeightQuantization
from radixrt.executor.cuda_graph import capture_sizes
from radixrt.executor.runner_settings import RunnerSettings
from radixrt.kernels.flashinfer_backend import FLASHINFER_HEAD_DIMS
from radixrt.kernels.kv_cache import kv_storage_dtype

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(name: str, device: str, quantized: bool = False) -> torch.dtype:
    """``quantized``: weight-only quantization is on, whose CPU kernels take float32
    activations (auto is float32 then: bf16 would be converted around every linear)."""
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        if quantized:
            return torch.float32
        from radixrt.executor.cpu_dtype import auto_cpu_dtype

        return DTYPES[auto_cpu_dtype().dtype]
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return DTYPES[name]


def quantization_spec(spec: Optional[WeightQuantization], dtype: str) -> Optional[WeightQuantization]:
    """``spec`` with its prefill dtype: with ``dtype`` auto, what auto means on this CPU (the
    model itself stays float32: `model_dtype`), else float32."""
    if spec is None or dtype != "auto":
        return spec
    from radixrt.executor.cpu_dtype import auto_cpu_dtype

    return replace(spec, prefill_dtype=auto_cpu_dtype().dtype)


@dataclass(frozen=True)
class RuntimeChoice:
    """What a config resolves to on its device (no model or CUDA needed to decide)."""

    attention_backend: str  # "torch" | "flashinfer"
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype  # what the KV pool stores (the model dtype, int8 or a float8)
    cuda_graph: bool  # decode steps replayed from captured CUDA graphs
    cuda_graph_max_bs: int
    cuda_graph_sizes: tuple[int, ...] = ()  # the batch sizes captured (None of them above cuda_graph_max_bs)
    cuda_graph_padding: bool = True  # a batch of another size runs in the next larger graph (else eagerly)


def check_device(device: str) -> None:
    """ValueError, before anything loads, for a CUDA device this torch cannot reach."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch sees no CUDA device ({torch.__version__}); use device 'cpu'")


def resolve_runtime(settings: RunnerSettings) -> RuntimeChoice:
    """``device="cuda"`` with the defaults: FlashInfer attention, bf16, decode CUDA
    graphs up to ``min(cuda_graph_max_bs, max_running_requests)``. CPU: the torch
    reference backend, fp32, no graphs. Graphs need the FlashInfer backend (the
    torch backend's per-batch shapes cannot be captured).

    ``kv_cache_dtype``: fp8 runs on either backend; FlashInfer cannot read an
    int8 cache (per-token scales), so int8 on CUDA takes the torch backend
    (and no graphs).

    ``enable_deterministic_inference``: the torch backend's batch-invariant
    path on every device (FlashInfer's kernels split work by batch shape) and
    no CUDA graphs.

    (``EngineConfig`` has already refused what cannot run as asked, e.g.
    flashinfer attention with an int8 cache or with deterministic inference:
    ``radixrt/config_deps.py``.)"""
    ex = settings.execution
    cuda = ex.device.startswith("cuda")
    dtype = model_dtype(settings.model.dtype, ex.device, settings.model.quantization is not None)
    kv_dtype = kv_storage_dtype(settings.cache.kv_cache_dtype, dtype)
    backend = ex.attention_backend
    if ex.enable_deterministic_inference:
        return RuntimeChoice("torch", dtype, kv_dtype, False, 0)
    if backend == "auto":  # FlashInfer's kernels take 16-bit q (and 16-bit or fp8 KV) only
        backend = (
            "flashinfer" if cuda and dtype in (torch.bfloat16, torch.float16) and kv_dtype != torch.int8 else "torch"
        )
    cap = settings.max_running_requests
    wanted = ex.cuda_graph_bs or capture_sizes(min(ex.cuda_graph_max_bs, cap))
    sizes = tuple(s for s in wanted if s <= cap)
    graphs = cuda and backend == "flashinfer" and not ex.disable_cuda_graph and bool(sizes)
    if not graphs:
        return RuntimeChoice(backend, dtype, kv_dtype, False, 0)
    return RuntimeChoice(backend, dtype, kv_dtype, True, sizes[-1], sizes, not ex.disable_cuda_graph_padding)


def fit_to_model(choice: RuntimeChoice, head_dim: int) -> RuntimeChoice:
    """FlashInfer's kernels exist for a few head dims only: for any other, run
    the torch backend (without CUDA graphs, which need FlashInfer) and say so."""
    if choice.attention_backend != "flashinfer" or head_dim in FLASHINFER_HEAD_DIMS:
        return choice
    logger.warning(
        "FlashInfer has no kernels for head_dim %d (it supports %s): using the torch attention "
        "backend, without CUDA graphs",
        head_dim,
        ", ".join(map(str, FLASHINFER_HEAD_DIMS)),
    )
    return replace(choice, attention_backend="torch", cuda_graph=False, cuda_graph_max_bs=0, cuda_graph_sizes=())
