"""Llama-family models over the paged KV pool, loaded from Hugging Face folders."""

from radixrt.executor.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from radixrt.executor.models.loader import load_model

__all__ = ["load_model", "ModelConfig", "SUPPORTED_ARCHITECTURES"]
