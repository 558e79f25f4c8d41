"""Loads the model, owns the KV pool and the attention backend, runs forwards.

The runner sees batches as slot lists and token ids; it knows nothing of the
radix tree or of scheduling.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from radixrt.kernels import AttentionMetadata, create_backend
from .config import EngineConfig
from .memory import KVPool
from .model_store import resolve_model_path
from .models import load_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def _available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    pages = os.sysconf("SC_AVPHYS_PAGES")
    return int(pages * os.sysconf("SC_PAGE_SIZE"))


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.device = config.device
        self.dtype = _resolve_dtype(config.dtype, config.device)
        self.model_path = resolve_model_path(config.model_path)
        self.model, self.model_config = load_model(self.model_path, self.dtype, self.device)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.model_path)
        mc = self.model_config
        self.context_length = config.context_length or mc.max_position_embeddings
        self.page_size = config.page_size
        self.num_pages = self._num_pages()
        self.kv_pool = KVPool(
            mc.num_layers, self.num_pages, self.page_size, mc.num_kv_heads, mc.head_dim, self.dtype, self.device
        )
        backend = config.attention_backend
        if backend == "auto":
            backend = "flashinfer" if self.device.startswith("cuda") else "torch"
        self.backend = create_backend(backend, self.device)
        logger.info(
            "loaded %s (%s, %s): KV pool %d slots (page_size %d), context %d",
            self.model_path, mc.architecture, self.dtype, self.num_pages * self.page_size,
            self.page_size, self.context_length,
        )

    def _num_pages(self) -> int:
        mc = self.model_config
        if self.config.max_total_tokens is not None:
            tokens = self.config.max_total_tokens
        else:
            per_token = KVPool.bytes_per_token_for(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
            tokens = int(_available_memory_bytes(self.device) * self.config.mem_fraction // per_token)
            tokens = min(tokens, 1 << 20)
        pages = tokens // self.page_size
        if pages < 1:
            raise ValueError(f"KV pool of {tokens} tokens holds no page of {self.page_size}")
        return pages

    @torch.inference_mode()
    def forward(self, input_ids: list[int], seq_slots: list[list[int]], q_lens: list[int]) -> torch.Tensor:
        """Compute ``q_lens[i]`` new tokens of each sequence (whose whole slot list
        is ``seq_slots[i]``); writes their K/V into the pool; returns hidden states
        [sum(q_lens), hidden]."""
        meta = AttentionMetadata.build(seq_slots, q_lens, self.page_size, self.device)
        self.backend.plan(meta)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        return self.model(ids, meta.positions, meta, self.kv_pool, self.backend)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the given hidden rows."""
        return self.model.compute_logits(hidden)
