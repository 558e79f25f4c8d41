"""`HostCacheSettings`: the host-memory KV tier under the radix cache (SGLang's flag names;
the tier itself: radixrt/scheduler/host_tier.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixrt.config.fields import check_choice, setting

DEFAULT_HICACHE_RATIO = 2.0  # SGLang's


@dataclass(frozen=True)
class HostCacheSettings:
    """The host-memory KV tier under the radix cache (SGLang's flag names).

    Its knobs are unset (None) until given, so that giving one, at its usual value too, turns
    the tier on."""

    enable_hierarchical_cache: bool = setting(
        False,
        "a host-memory KV tier under the radix cache: prefixes evicted from the device pool move to host "
        "memory and are loaded back when matched again",
    )
    hicache_ratio: Optional[float] = setting(
        None,
        f"host KV tier size as a multiple of the device KV pool (unset: {DEFAULT_HICACHE_RATIO}; giving it turns "
        "the tier on; give one of --hicache-ratio, --hicache-size, --host-kv-size)",
    )
    hicache_size: float = setting(0.0, "host KV tier size in GiB (0: use --hicache-ratio; giving it turns the tier on)")
    host_kv_size: Optional[int] = setting(None, "host KV tier size in tokens (giving it turns the tier on)")
    hicache_write_policy: Optional[str] = setting(
        None,
        "write_through (copy a prefix to the host when it is cached; evictions copy nothing; the default) or "
        "write_back (copy it only when the device evicts it); giving it turns the tier on",
    )
    hicache_kv_cache_dtype: Optional[str] = setting(
        None,
        "how the host tier stores K/V: auto (as the device pool: exact; the default) or int8 (about half the "
        "host bytes of bfloat16, lossy); giving it turns the tier on",
    )

    def __post_init__(self) -> None:
        for name, choices in (
            ("hicache_write_policy", ("write_through", "write_back")),
            ("hicache_kv_cache_dtype", ("auto", "int8")),
        ):
            if getattr(self, name) is not None:
                check_choice(name, getattr(self, name), choices)
        bad_tokens = self.host_kv_size is not None and self.host_kv_size < 1
        bad_ratio = self.hicache_ratio is not None and self.hicache_ratio <= 0
        if bad_ratio or self.hicache_size < 0 or bad_tokens:
            raise ValueError("hicache_ratio must be > 0, hicache_size >= 0 and host_kv_size >= 1")
