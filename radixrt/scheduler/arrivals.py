"""New requests on their way to the waiting queue.

A request may be *held* before it waits: first while its LoRA adapter loads
(lora_admission.py), then while the storage tier reads its stored prefix into
host memory (storage_tier.py). Held requests have no KV and are in neither
queue; `ready` moves those whose wait is over on, `drop` takes aborted ones
out. Nothing here blocks the step loop.
"""

from __future__ import annotations

from typing import Callable, Optional

from radixrt.requests.messages import ControlReply, LoRAControlReq
from radixrt.scheduler.lora_admission import LoRAAdmission
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Req
from radixrt.scheduler.storage_tier import StorageTier


class Arrivals:
    def __init__(self, queues: RequestQueues, lora: Optional[LoRAAdmission], storage: Optional[StorageTier]) -> None:
        self.queues = queues
        self.lora = lora
        self.storage = storage

    def check_lora(self, name: Optional[str]) -> None:
        """ValueError (a 400) for an adapter this server cannot serve."""
        if name is None:
            return
        if self.lora is None:
            raise ValueError("this server serves no LoRA adapters (start it with --enable-lora or --lora-paths)")
        self.lora.check(name)

    def arrive(self, req: Req, lora_name: Optional[str]) -> None:
        """Queue ``req`` or hold it."""
        if lora_name is not None:
            assert self.lora is not None
            if not self.lora.start(req, lora_name):
                return
        self._to_storage(req)

    def lora_control(self, msg: LoRAControlReq) -> Optional[ControlReply]:
        """Start loading or unloading an adapter (`replies` answers it), or refuse it now."""
        if self.lora is None:
            return ControlReply(
                "lora", ok=False, payload={"error": "this server serves no LoRA adapters (--enable-lora)"}
            )
        self.lora.control(msg)
        return None

    def replies(self) -> list[ControlReply]:
        """The answers to adapter loads and unloads that have ended, in the order they came."""
        if self.lora is None or not self.lora.controls:
            return []
        return self.lora.control_replies(self.lora_in_use)

    def _to_storage(self, req: Req) -> None:
        if self.storage is None or not self.storage.hold(req):
            self.queues.waiting.append(req)

    def ready(self) -> list[tuple[Req, str]]:
        """Move on the held requests whose wait is over; those that cannot be
        served, with why (a 400)."""
        failed: list[tuple[Req, str]] = []
        if self.lora is not None and self.lora.pool.over_limit:
            self.lora.pool.trim(self.lora_in_use())
        if self.lora is not None and self.lora.held:
            for req, error in self.lora.ready(self.lora_in_use):
                if error is None:
                    self._to_storage(req)
                else:
                    failed.append((req, error))
        if self.storage is not None and self.storage.busy:
            busy = bool(self.queues.waiting or self.queues.running)
            self.queues.waiting.extend(self.storage.ready(busy))
        return failed

    def drop(self, hit: Callable[[Req], bool]) -> list[Req]:
        out = self.lora.drop(hit) if self.lora is not None else []
        return out + (self.storage.drop(hit) if self.storage is not None else [])

    @property
    def busy(self) -> bool:
        """Whether requests are held, adapters load, or the storage tier is restoring (each needs
        `ready` or `replies` calls)."""
        return bool((self.lora is not None and self.lora.busy) or (self.storage is not None and self.storage.busy))

    def wait(self, timeout_s: float) -> None:
        """Block briefly for a held request, an adapter load or the storage tier's restore (nothing
        else to do)."""
        if self.lora is not None and self.lora.busy:
            self.lora.wait(timeout_s)
        elif self.storage is not None and self.storage.busy:
            self.storage.wait(timeout_s)

    def lora_in_use(self) -> set[str]:
        """Adapters a queued or held request needs (the pool never unloads them)."""
        reqs = [*self.queues.waiting, *self.queues.running]
        if self.storage is not None:
            reqs += [h.req for h in self.storage.held]
        if self.lora is not None:
            reqs += [h.req for h in self.lora.held]
        return {r.lora_name for r in reqs if r.lora_name is not None}
