"""Copies between the device KV pool and the host tier, as queued work
(torch-free: the radix tree queues them; `host_pool.HostKVPool.run` runs them).
See host_pool.py for the ordering contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, Union


@dataclass
class TransferOp:
    """One batch of slot copies: ``dst_slots[i]`` gets ``src_slots[i]``'s K/V.

    to_host: device -> host (an offload or write-through) when True, host ->
        device (a load) when False."""

    to_host: bool
    src_slots: list[int]
    dst_slots: list[int]


@dataclass
class StoreOp:
    """Pack device slots ``src_slots`` (whole blocks of the storage tier) into
    host-page bytes and hand them to ``deliver`` (the storage tier's writer)."""

    src_slots: list[int]
    deliver: Callable[[Any], None]


QueuedOp = Union[TransferOp, StoreOp]


@dataclass
class KVTransfers:
    """The copies one launched step carries: ``before`` its forward, ``after`` it."""

    before: list[QueuedOp] = field(default_factory=list)
    after: list[QueuedOp] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.before or self.after)


class KVTransferQueue:
    """Copies queued by the scheduler thread, handed to the next launched step.

    ``offload``/``load`` queue copies of KV that is already computed (or is
    computed by a step already launched): they run before the next forward.
    ``write_through(..., after_forward=True)`` queues a copy of KV that the
    step about to be launched computes: it runs after that step's forward.
    Counters are in tokens."""

    def __init__(self) -> None:
        self._pending = KVTransfers()
        self.offloaded_tokens = 0
        self.loaded_tokens = 0

    def offload(self, device_slots: list[int], host_slots: list[int], after_forward: bool = False) -> None:
        op = TransferOp(True, list(device_slots), list(host_slots))
        (self._pending.after if after_forward else self._pending.before).append(op)
        self.offloaded_tokens += len(device_slots)

    def load(self, host_slots: list[int], device_slots: list[int]) -> None:
        # A load after a write-through queued for this step would read host
        # slots that step has not filled yet; loads only read nodes that were
        # on the host before this step's admissions, and an "after" copy only
        # targets newly inserted nodes, so the two never touch the same slots.
        self._pending.before.append(TransferOp(False, list(host_slots), list(device_slots)))
        self.loaded_tokens += len(host_slots)

    def store(self, device_slots: list[int], deliver: Callable[[Any], None], after_forward: bool = False) -> None:
        """Queue a copy of device KV to the storage tier (`StoreOp`), ordered like an offload."""
        op = StoreOp(list(device_slots), deliver)
        (self._pending.after if after_forward else self._pending.before).append(op)

    def take(self) -> KVTransfers:
        """Everything queued since the last take, for the step being launched."""
        out, self._pending = self._pending, KVTransfers()
        return out

    @property
    def pending(self) -> bool:
        return bool(self._pending)


WRITE_POLICIES = ("write_through", "write_back")


@dataclass
class HostTier:
    """What the radix tree needs of the host tier: the host pool's page
    allocator (anything with `PageAllocator`'s interface), the copy queue and
    the write policy.

    write_through: a node is copied to the host when it enters the tree, so a
        later device eviction costs no copy (SGLang's default);
    write_back: a node is copied only when the device evicts it.
    """

    allocator: "PageAllocatorLike"
    transfers: KVTransferQueue = field(default_factory=KVTransferQueue)
    write_policy: str = "write_through"

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"unknown hicache write policy {self.write_policy!r}; choose " + " or ".join(WRITE_POLICIES)
            )

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"


class PageAllocatorLike(Protocol):
    @property
    def page_size(self) -> int: ...

    @property
    def total_slots(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    def alloc_slots_for(self, num_tokens: int) -> Optional[list[int]]: ...

    def free_slots(self, slots: Sequence[int]) -> None: ...

    def is_page_free(self, page: int) -> bool: ...

    def first_free(self, pages: list[int]) -> Optional[int]: ...
