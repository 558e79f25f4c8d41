"""Builds a scheduler's prefix cache and, with ``--enable-hierarchical-cache``,
the host KV tier under it: the host pool shaped like the runner's device pool,
the tree's view of it, and the swap cost model (``--preemption-mode swap``);
with ``--hicache-storage-backend``, the storage tier under the host tier."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.config import CacheSettings, HostCacheSettings
from radixrt.config.host_cache import DEFAULT_HICACHE_RATIO
from radixrt.config.storage import StorageSettings
from radixrt.memory.host_pool import HostKVPool, host_pool_tokens
from radixrt.memory.host_radix_cache import HostRadixCache
from radixrt.memory.kv_manager import KVCacheManager
from radixrt.memory.kv_pool import PageAllocator
from radixrt.memory.kv_store import KVStore, StoreIdentity
from radixrt.memory.kv_store_file import FileKVStore
from radixrt.memory.kv_store_redis import RedisKVStore
from radixrt.memory.kv_transfer import HostTier, KVTransferQueue
from radixrt.memory.no_prefix_cache import NoPrefixCache
from radixrt.memory.prefix_cache import PrefixCache
from radixrt.memory.radix_cache import RadixCache
from radixrt.memory.swap_cost import SwapCostModel
from radixrt.scheduler.storage_tier import StorageTier, model_fingerprint

logger = logging.getLogger(__name__)


@dataclass
class HostTierRuntime:
    pool: HostKVPool
    tier: HostTier
    swap_cost: SwapCostModel

    def stats(self, kv: KVCacheManager) -> dict[str, Any]:
        """Host slots (free + tree == total), bytes, and the swap counters."""
        usage = kv.host_usage() or {}
        return {
            **usage,
            "bytes_per_token": self.pool.bytes_per_token,
            "total_bytes": self.pool.bytes_per_token * self.pool.total_slots,
            "kv_cache_dtype": self.pool.kv_cache_dtype,
            "write_policy": self.tier.write_policy,
            "swapped_out_requests": kv.swapped_out_requests,
            "swapped_out_tokens": kv.swapped_out_tokens,
            "swap_declined": kv.swap_declined,
            **self.swap_cost.describe(),
        }


def build_host_tier(config: HostCacheSettings, runner: Any, device_tokens: int) -> Optional[HostTierRuntime]:
    """The host tier for `runner`'s device pool, or None when it is off."""
    if not config.enable_hierarchical_cache:
        return None
    dev = runner.kv_pool
    ratio = DEFAULT_HICACHE_RATIO if config.hicache_ratio is None else config.hicache_ratio
    tokens = host_pool_tokens(device_tokens, dev.bytes_per_token, ratio, config.hicache_size, config.host_kv_size)
    pool = HostKVPool(dev, tokens, kv_cache_dtype=config.hicache_kv_cache_dtype or "auto")
    followers = getattr(runner, "followers", None)
    if followers is not None:  # every rank keeps its heads' host copy and runs the leader's copies, in order
        followers.send("host_pool", tokens, pool.kv_cache_dtype)
        pool.mirror = functools.partial(followers.send, "host_copies")
    tier = HostTier(pool.allocator, KVTransferQueue(), config.hicache_write_policy or "write_through")
    num_params = sum(p.numel() for p in runner.model.parameters())
    cost = SwapCostModel.for_device(str(runner.device), num_params, dev.bytes_per_token)
    logger.info(
        "host KV tier: %d tokens (%.2f GiB, %s), %s; swap %.2f us/token vs recompute %.2f us/token",
        pool.total_slots,
        pool.total_slots * pool.bytes_per_token / (1 << 30),
        pool.kv_cache_dtype,
        tier.write_policy,
        cost.swap_s(1) * 1e6,
        cost.recompute_s(1) * 1e6,
    )
    return HostTierRuntime(pool, tier, cost)


def build_prefix_cache(config: CacheSettings, allocator: PageAllocator, host: Optional[HostTierRuntime]) -> PrefixCache:
    """The prefix cache the flags ask for: none (``--disable-radix-cache``), the
    radix tree over the host tier (`host`), or the device radix tree."""
    if config.disable_radix_cache:
        return NoPrefixCache(config.page_size)
    if host is not None:
        return HostRadixCache(allocator, config.page_size, host.tier)
    return RadixCache(allocator, config.page_size)


def build_storage_tier(
    config: StorageSettings, runner: Any, host: Optional[HostTierRuntime], tree: PrefixCache
) -> Optional[StorageTier]:
    """The storage tier the flags ask for (under the host tier `host`), or None."""
    if config.hicache_storage_backend is None:
        return None
    assert host is not None and isinstance(tree, HostRadixCache), "the storage tier needs the host tier"
    if host.tier.write_policy == "write_through" and host.pool.total_slots <= runner.kv_pool.total_slots:
        # every host page then mirrors a device page: no read from storage ever finds room to land
        raise ValueError(
            f"the storage tier reads into free host pages, and a write-through host tier of "
            f"{host.pool.total_slots} tokens mirrors the device pool's {runner.kv_pool.total_slots}: give the "
            f"host tier more tokens than the device pool (--hicache-ratio above 1, or --host-kv-size)."
        )
    started = time.perf_counter()
    identity = StoreIdentity(
        model=model_fingerprint(runner.model, runner.model_config),
        kv_dtype=host.pool.kv_cache_dtype + "/" + str(host.pool.storage_dtype),
        page_size=tree.page_size,
        block_tokens=config.block_tokens(tree.page_size),
        page_bytes=host.pool.page_bytes,
        arithmetic="deterministic" if runner.deterministic else "default",
    )
    store: KVStore
    if config.hicache_storage_backend == "file":
        store = FileKVStore(config.hicache_storage_dir, identity, int(config.hicache_storage_quota_gb * (1 << 30)))
    else:
        store = RedisKVStore(config.hicache_storage_url, identity)
    logger.info(
        "KV storage tier: %s, blocks of %d tokens (%.1f MiB), model %s (identity in %.2f s)",
        store.name,
        identity.block_tokens,
        identity.block_bytes / 2**20,
        identity.model[:12],
        time.perf_counter() - started,
    )
    tier = StorageTier(store, host.pool, tree)
    tier.prefault_pools(runner.kv_pool)
    restore = config.hicache_storage_restore_tokens
    tier.start_restore(runner.kv_pool.total_slots // 2 if restore is None else restore)
    return tier
