"""The scheduler's answers to the messages that are not requests: abort, flush, stats, the
tree's debug view, LoRA adapters, pausing generation, weight updates, the profiler and memory release
(radixrt/scheduler/generation_control.py states their contracts).

`SchedulerControl` is a part of `Scheduler` (its base class), kept apart so the step loop's
module holds the loop; the attributes it declares are the scheduler's.
"""

from __future__ import annotations

from typing import Any, Optional

from radixrt.executor.model_runner import ModelRunner
from radixrt.executor.models.compiled import warm_up as warm_up_compiled
from radixrt.executor.weight_groups import WeightGroups
from radixrt.memory.kv_manager import KVCacheManager
from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import Limits
from radixrt.requests.messages import (
    AbortReq,
    ContinueGenerationReq,
    ControlReply,
    FlushCacheReq,
    GenerateReq,
    GetWeightsReq,
    LoRAControlReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    ProfileReq,
    RadixSnapshotReq,
    StatsReq,
    TokenOutput,
    UpdateDistributedReq,
    UpdateTensorsReq,
    UpdateWeightsReq,
    WeightsGroupReq,
    WeightVersionReq,
)
from radixrt.requests.runtime_info import RuntimeInfo
from radixrt.scheduler.arrivals import Arrivals
from radixrt.scheduler.debug_view import radix_view
from radixrt.scheduler.generation_control import GenerationControl
from radixrt.scheduler.host_tier import HostTierRuntime
from radixrt.scheduler.launcher import InFlight
from radixrt.scheduler.memory_occupation import MemoryOccupation
from radixrt.scheduler.model_fit import rope_settings
from radixrt.scheduler.planner import BatchPlanner, Plan
from radixrt.scheduler.profiler import StepProfiler
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Phase, Req
from radixrt.scheduler.storage_tier import StorageTier

# while a weight update is read and nothing runs, the loop waits this long for it per step
UPDATE_POLL_S = 0.01


class SchedulerControl:
    runner: ModelRunner
    kv: KVCacheManager
    queues: RequestQueues
    planner: BatchPlanner
    arriving: Arrivals
    control: GenerationControl
    host: Optional[HostTierRuntime]
    storage: Optional[StorageTier]
    profiler: StepProfiler
    weight_groups: WeightGroups
    memory: MemoryOccupation
    inflight: Optional[InFlight]
    _queued_outputs: list[TokenOutput]
    limits: Limits
    eos_token_ids: set[int]

    def add_request(self, msg: GenerateReq) -> None:
        raise NotImplementedError

    def runtime_info(self) -> RuntimeInfo:
        """The loaded model, sizes and limits, as the Engine and the server's fronts read them."""
        return RuntimeInfo(
            model_path=str(self.runner.model_path),
            limits=self.limits,
            eos_token_ids=tuple(sorted(int(t) for t in self.eos_token_ids)),
            kv_cache=self.runner.kv_pool.footprint.describe(self.limits.kv_total_slots),
            settings=rope_settings(self.runner.model.rope.rope_type),
        )

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def _complete(self, step: InFlight) -> list[TokenOutput]:
        raise NotImplementedError

    def _finish(self, req: Req, reason: FinishReason) -> list[TokenOutput]:
        raise NotImplementedError

    def handle(self, msg: Any) -> Optional[ControlReply]:
        """Take one incoming message; the reply to send at once, if it has one (weight
        updates and LoRA loads are answered later, through `control_replies`)."""
        if isinstance(msg, GenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(*msg.rids)
        elif isinstance(msg, FlushCacheReq):
            return ControlReply("flush_cache", ok=self.flush_cache())
        elif isinstance(msg, StatsReq):
            return ControlReply("stats", payload=self.stats())
        elif isinstance(msg, RadixSnapshotReq):
            stored = self.storage.holds if self.storage is not None else None
            return ControlReply("radix", payload=radix_view(self.kv, self.queues, msg, stored))
        elif isinstance(msg, LoRAControlReq):
            return self.arriving.lora_control(msg)
        elif isinstance(msg, (UpdateWeightsReq, UpdateTensorsReq, UpdateDistributedReq)):
            if msg.abort_all_requests:
                self.abort("")
            self.control.request_update(self._received(msg) if isinstance(msg, UpdateDistributedReq) else msg)
        elif isinstance(msg, WeightsGroupReq):
            self.weight_groups.handle(msg)
        elif isinstance(msg, GetWeightsReq):
            return self._weights(msg)
        elif isinstance(msg, PauseGenerationReq):
            return self._pause(msg.mode)
        elif isinstance(msg, ContinueGenerationReq):
            self.control.resume()
            return ControlReply("continue")
        elif isinstance(msg, WeightVersionReq):
            if msg.abort_all_requests:
                self.abort("")
            self.control.weight_version = msg.new_version
            return ControlReply("weight_version", payload={"weight_version": msg.new_version})
        elif isinstance(msg, ProfileReq):
            return self.profiler.handle(msg)
        elif isinstance(msg, MemoryOccupationReq):
            self._settle_inflight()
            return self.memory.handle(msg)
        else:
            raise TypeError(f"unknown scheduler message {type(msg).__name__}")
        return None

    def control_replies(self) -> list[ControlReply]:
        return self.arriving.replies() + self.control.replies() + self.weight_groups.replies()

    def _received(self, msg: UpdateDistributedReq) -> UpdateTensorsReq:
        """The update of tensors a trainer broadcasts (received on the update's thread, now)."""
        groups, limit = self.weight_groups, sum(p.numel() for p in self.runner.model.parameters())

        def receive() -> list:
            return groups.receive(msg.group_name, msg.names, msg.dtypes, msg.shapes, limit)

        return UpdateTensorsReq(receive, False, msg.weight_version)

    def abort(self, *rids: str, reason: Optional[FinishReason] = None) -> None:
        """Abort requests with all their samples, or single samples (or all, for rid ""), at any
        stage; their KV is released. Ids match exactly; one pass over the queues for all of them.
        ``reason``: what they finish with (default: "aborted")."""
        wanted = set(rids)
        reason = reason or FinishReason.abort("aborted")

        def hit(r: Req) -> bool:
            return "" in wanted or r.rid in wanted or r.parent in wanted

        for r in self.queues.take(hit):
            if r.phase is Phase.FINISHED:  # a beam whose search an earlier one of these ended
                continue
            self._queued_outputs += self._finish(r, reason)
        for r in self.arriving.drop(hit):
            self._queued_outputs += self._finish(r, reason)

    def flush_cache(self) -> bool:
        """Drop every cached prefix. Only when nothing is running (like SGLang).
        The cache's counters (queried, hit, inserted, evicted tokens) and the
        rates from them keep counting from the start: they are history, which
        dropping the cache's content does not undo."""
        if self.has_work():
            return False
        self.kv.tree.reset()
        return True

    def _weights(self, msg: GetWeightsReq) -> ControlReply:
        try:
            values = self.runner.weights_by_name(msg.name, msg.truncate_size)
        except Exception as e:  # noqa: BLE001 - a read never ends the loop: the caller gets why
            return ControlReply("weights", ok=False, payload={"message": str(e) or type(e).__name__})
        return ControlReply("weights", payload={"values": values})

    def _pause(self, mode: str) -> ControlReply:
        try:
            self.control.pause(mode)
        except ValueError as e:
            return ControlReply("pause", ok=False, payload={"message": str(e)})
        self._settle_inflight()
        if mode == "abort":
            self.abort("")
        elif mode == "retract":
            self._retract_running()
        return ControlReply("pause", payload={"mode": mode})

    def _settle_inflight(self) -> None:
        """Process the step in flight (overlap scheduling) now, so that nothing runs."""
        if self.inflight is not None:
            self._queued_outputs += self._complete(self.inflight)
            self.inflight = None

    def _retract_running(self) -> int:
        plan = Plan()
        while self.queues.running:
            self.planner.retract(self.queues.running[-1], plan, pressure=False)
        return len(plan.retracted)

    def _update_weights(self) -> None:
        """Install the next weight update once its checkpoint is read and no request that started
        is left: none runs, and none retracted since it started waits to go on (while paused,
        the running requests are retracted for it instead: their KV has the old weights)."""
        control, queues = self.control, self.queues
        if not control.updates:
            return
        if control.paused is not None and queues.running:
            self._settle_inflight()
            self._retract_running()
        started = control.paused is None and any(r.admitted_once for r in queues.waiting)
        drained = not queues.running and self.inflight is None and not started
        ready = control.next_install(drained, UPDATE_POLL_S if drained else 0.0)
        if ready is None:
            return
        msg, loaded = ready
        self.install_weights(loaded)
        control.installed(msg, waiting=len(self.queues.waiting))

    def install_weights(self, loaded: Any) -> None:
        """Serve ``loaded`` (the runner's `LoadedWeights`) now, nothing running: the KV of the old
        weights is dropped from every tier (the host tier's queued copies run first)."""
        if self.host is not None:  # copies queued for the host tier run before its content is dropped
            transfers = self.kv.take_transfers()
            self.host.pool.run(transfers.before + transfers.after)
        self.runner.install_weights(loaded)
        self.kv.tree.reset()  # every tier: no KV of the old weights is served again
        warm_up_compiled(self.runner, self.kv.allocator)
