"""`StorageSettings`: the storage tier under the host tier (SGLang's
``--hicache-storage-backend``; the tier itself: radixrt/scheduler/storage_tier.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixrt.config.fields import check_choice, setting

STORAGE_BACKENDS = ("file", "redis")


@dataclass(frozen=True)
class StorageSettings:
    """The storage tier: KV blocks that survive restarts and are shared between servers."""

    hicache_storage_backend: Optional[str] = setting(
        None,
        "a storage tier under the host KV tier: file (a directory, --hicache-storage-dir) or redis "
        "(--hicache-storage-url, shared by servers); cached prefixes are written through to it and "
        "read back after a restart or by another server; implies --enable-hierarchical-cache",
    )
    hicache_storage_dir: str = setting(
        "~/.cache/radixrt/kv-store", "the file backend's directory (one per model, KV dtype and page size)"
    )
    hicache_storage_url: str = setting("redis://127.0.0.1:6379/0", "the redis backend's server")
    hicache_storage_quota_gb: float = setting(
        16.0, "the file backend's size limit in GiB; past it the least recently used blocks are deleted"
    )
    hicache_storage_block_tokens: int = setting(
        64, "tokens per stored block (a multiple of --page-size); only whole blocks are stored"
    )

    def __post_init__(self) -> None:
        if self.hicache_storage_backend is not None:
            check_choice("hicache_storage_backend", self.hicache_storage_backend, STORAGE_BACKENDS)
        if self.hicache_storage_quota_gb <= 0 or self.hicache_storage_block_tokens < 1:
            raise ValueError("hicache_storage_quota_gb must be > 0 and hicache_storage_block_tokens >= 1")
