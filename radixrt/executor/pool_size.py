"""How many tokens the KV pool holds: ``--max-total-tokens``, or the memory the settings give it."""

from __future__ import annotations

import os
from typing import Any

# the pool's most tokens when sized from memory (a CPU host can have far more memory than a pool needs)
MAX_POOL_TOKENS = 1 << 20


def available_memory_bytes(device: str) -> int:
    """Memory free now on ``device`` (the CPU's: the host's available pages)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def total_memory_bytes(device: str) -> int:
    """All of ``device``'s memory (the CPU's: the host's)."""
    if device.startswith("cuda"):
        import torch

        _, total = torch.cuda.mem_get_info()
        return int(total)
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def kv_pool_tokens(cache: Any, footprint: Any, device: str) -> int:
    """The pool's capacity for ``cache`` (CacheSettings) with ``footprint`` (its bytes per token),
    measured once the weights are loaded. ``mem_fraction_static`` (SGLang's sizing): that share of
    the device's total memory holds weights and pool, so the pool gets what stays free of it;
    else ``mem_fraction`` of the free memory. ValueError when the share leaves the pool nothing."""
    if cache.max_total_tokens is not None:
        return int(cache.max_total_tokens)
    free = available_memory_bytes(device)
    if cache.mem_fraction_static is not None:
        reserved = total_memory_bytes(device) * (1 - cache.mem_fraction_static)
        budget = free - reserved
        if budget <= 0:
            raise ValueError(
                f"mem_fraction_static {cache.mem_fraction_static} leaves no memory for the KV pool: "
                f"{free / 2**30:.1f} GiB are free with the weights loaded and {reserved / 2**30:.1f} GiB "
                "must stay free; raise it, or set max_total_tokens"
            )
    else:
        budget = free * cache.mem_fraction
    return min(footprint.tokens_in(budget), MAX_POOL_TOKENS)
