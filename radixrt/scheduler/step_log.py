"""What the scheduler reports: its periodic progress line (``--log-interval``
steps apart, at INFO) and its stats (`scheduler_stats`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixrt.scheduler.planner import Batch

logger = logging.getLogger("radixrt.scheduler.scheduler")


class StepLog:
    """Logs one line every ``interval`` steps: batch, queues, tokens/s since the last line, cache, KV.
    The tokens/s is measured whatever the log level (``last_gen_throughput``, SGLang's figure
    in the stats)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._window = (time.perf_counter(), 0)
        self.last_gen_throughput = 0.0  # generated tokens/s over the last ``interval`` steps

    def step(self, sched: Any, batch: "Batch") -> None:
        """After a step of the `Scheduler` ``sched`` (read only) that ran ``batch``."""
        if sched.counters["steps"] % self.interval:
            return
        t0, gen0 = self._window
        now, gen = time.perf_counter(), sched.results.generated_tokens
        self._window = (now, gen)
        self.last_gen_throughput = (gen - gen0) / max(now - t0, 1e-9)
        if not logger.isEnabledFor(logging.INFO):
            return
        u = sched.kv_usage()
        used = u["total_slots"] - u["free_slots"]
        logger.info(
            "step %d: batch %d (prefill %d tok), running %d, waiting %d, gen %.1f tok/s, "
            "cache hit %.1f%%, KV used %d/%d (tree %d)%s",
            sched.counters["steps"],
            len(batch),
            sum(q for _, q in batch if q > 1),
            len(sched.queues.running),
            len(sched.queues.waiting),
            self.last_gen_throughput,
            100 * sched.kv.tree.stats()["hit_rate"],
            used,
            u["total_slots"],
            u["tree_slots"],
            sched.speculator.log_text() if sched.speculator is not None else "",
        )


def scheduler_stats(sched: Any) -> dict[str, Any]:
    """The `Scheduler` ``sched``'s counters since its start and its state now (read only)."""
    return {
        **sched.counters,
        "generated_tokens": sched.results.generated_tokens,
        "last_gen_throughput": round(sched.step_log.last_gen_throughput, 3),
        "jump_forward_proposed": sched.constrained.proposed,
        "jump_forward_tokens": sched.constrained.kept,
        **(sched.speculator.stats_dict() if sched.speculator is not None else {}),
        **sched.budgets.stats(),
        **sched.beams.stats(),
        **(sched.kv_events.stats() if sched.kv_events is not None else {}),
        "running": len(sched.queues.running),
        "waiting": len(sched.queues.waiting),
        "waiting_tokens": sum(len(r.input_ids) for r in sched.queues.waiting),
        "weight_version": sched.control.weight_version,
        "generation_paused": sched.control.paused,  # the pause mode, or None
        "weight_updates_pending": len(sched.control.updates),
        "kv": sched.kv_usage(),
        "cache": sched.kv.tree.stats(),
        **({"host_kv": sched.host.stats(sched.kv)} if sched.host is not None else {}),
        **({"storage_kv": sched.storage.stats()} if sched.storage is not None else {}),
        **({"lora": sched.runner.lora.pool.stats()} if sched.runner.lora is not None else {}),
    }
