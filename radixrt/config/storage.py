"""`StorageSettings`: the storage tier under the host tier (SGLang's
``--hicache-storage-backend``; the tier itself: radixrt/scheduler/storage_tier.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixrt.config.fields import check_choice, setting

STORAGE_BACKENDS = ("file", "redis")
# small enough that the tokens recomputed after a restart (at most a block less one) cost
# little beside the stored ones read back; each block is one file (or key) of the store
DEFAULT_BLOCK_TOKENS = 8


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
    hicache_storage_block_tokens: Optional[int] = setting(
        None,
        "tokens per stored block (a multiple of --page-size); only whole blocks are stored, so up to "
        "a block less one of a prefix's last tokens are recomputed after a restart; unset: "
        f"{DEFAULT_BLOCK_TOKENS}, or the page size when that is larger",
    )

    hicache_storage_restore_tokens: Optional[int] = setting(
        None,
        "at start, read up to this many tokens of the store's most recently used cached sequences back "
        "into the host tier (and the device while half its pool stays free), in the background, so the "
        "first requests after a restart hit memory; 0: off (blocks are read when a request needs them); "
        "unset: half the device KV pool, within the host tier",
    )

    hicache_storage_restore_wait: bool = setting(
        False,
        "finish the restore at start (--hicache-storage-restore-tokens) before the server reports ready, so "
        "that even its first request finds the restored sequences in memory; start-up takes that much longer",
    )

    def __post_init__(self) -> None:
        if self.hicache_storage_backend is not None:
            check_choice("hicache_storage_backend", self.hicache_storage_backend, STORAGE_BACKENDS)
        if self.hicache_storage_quota_gb <= 0:
            raise ValueError("hicache_storage_quota_gb must be > 0")
        if self.hicache_storage_block_tokens is not None and self.hicache_storage_block_tokens < 1:
            raise ValueError("hicache_storage_block_tokens must be >= 1")
        if self.hicache_storage_restore_tokens is not None and self.hicache_storage_restore_tokens < 0:
            raise ValueError("hicache_storage_restore_tokens must be >= 0")

    def block_tokens(self, page_size: int) -> int:
        """Tokens per stored block: the flag, or `DEFAULT_BLOCK_TOKENS` rounded up to whole pages."""
        if self.hicache_storage_block_tokens is not None:
            return self.hicache_storage_block_tokens
        return -(-DEFAULT_BLOCK_TOKENS // page_size) * page_size
