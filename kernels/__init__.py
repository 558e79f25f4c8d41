"""Attention backends behind one interface (see `base.AttentionBackend`)."""

from .base import AttentionBackend, AttentionMetadata
from .kv_cache import LayerKVCache

__all__ = ["AttentionBackend", "AttentionMetadata", "LayerKVCache", "create_backend"]


def create_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """`torch` (reference, runs everywhere) or `flashinfer` (CUDA only)."""
    if name == "torch":
        from .torch_ref import TorchReferenceBackend

        return TorchReferenceBackend()
    if name == "flashinfer":
        from .flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device=device)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'flashinfer'")
