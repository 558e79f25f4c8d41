"""`RuntimeInfo`: what a started runtime is, as its fronts need to know it.

The scheduler builds it once the model is loaded (`Scheduler.runtime_info`):
the Engine reads it in-process, and the server's scheduler process sends it
to the server's main process when it is ready (radixrt/server/workers.py), so
both fronts validate requests against the same `Limits` and report the same
sizes (``/get_server_info``, ``Engine.get_server_info``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixrt.requests.intake import Limits


@dataclass(frozen=True)
class RuntimeInfo:
    """A loaded runtime's model, sizes and request limits (picklable)."""

    model_path: str  # the model's folder, resolved ("default" becomes the embedded model's folder)
    limits: Limits  # context length, KV slots, vocabulary, and what one request may ask for
    eos_token_ids: tuple[int, ...]  # sorted
    # the KV pool's format, bytes per token and capacity: `KVFootprint.describe` (radixrt/memory/kv_format.py)
    kv_cache: dict[str, Any]
    # flat settings the scheduler serves with in place of the configured ones (`model_fit.rope_settings`)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        return self.limits.context_length

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def kv_total_slots(self) -> int:
        return self.limits.kv_total_slots


def internal_state(stats: dict[str, Any], token_capacity: int, max_running_requests: Any) -> dict[str, Any]:
    """The scheduler's stats with SGLang's names for the figures its tools read
    (``sglang/benchmark/one_batch_server.py``): ``internal_states[0]`` of ``/get_server_info``
    and of ``Engine.get_server_info``: the KV pool's capacity in tokens, the most requests
    running at once, and the generation throughput of the last --log-interval steps."""
    return {
        **stats,
        "memory_usage": {"token_capacity": token_capacity},
        "effective_max_running_requests_per_dp": max_running_requests,
        "last_gen_throughput": stats.get("last_gen_throughput", 0.0),
    }
