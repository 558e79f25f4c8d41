"""The scheduler's two queues of unfinished requests (`RequestQueues`) and the
order the running ones are scheduled in (`running_order`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from radixrt.scheduler.request import Phase, Req


def running_order(req: Req) -> tuple[bool, int, int]:
    """Running requests' scheduling order: decoders (one token, plus any draft)
    before prefill chunks, then most outputs first, then shortest prompt first;
    retraction takes from the end. (``uncomputed - len(draft_ids)``, inlined: it
    is computed for every running request every step.)"""
    n_out = len(req.output_ids)
    uncomputed = len(req.input_ids) + n_out + req.inflight_tokens - len(req.slots) - req.kv_dropped
    return uncomputed > 1, -n_out, len(req.input_ids)


@dataclass
class RequestQueues:
    """Every unfinished request is in exactly one of the two lists.

    ``running_ordered``: ``running`` is known to be in `running_order` (sorting
    it would change nothing), so the planner need not sort it. The planner sets
    it when it sorts and clears it when it appends an admitted request; the
    result processor clears it unless every running request just gained exactly
    one token as a one-token decoder (everyone's key moves alike). Removing
    requests keeps the order."""

    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    running_ordered: bool = False

    def remove(self, req: Req) -> None:
        (self.running if req.phase is Phase.RUNNING else self.waiting).remove(req)

    def take(self, hit: Callable[[Req], bool]) -> list[Req]:
        """Remove and return the requests ``hit`` selects, waiting ones first: one pass
        over each list however many are taken (an aborted batch of thousands)."""
        taken: list[Req] = []
        for queue in (self.waiting, self.running):
            kept: list[Req] = []
            for r in queue:
                (taken if hit(r) else kept).append(r)
            queue[:] = kept
        return taken
