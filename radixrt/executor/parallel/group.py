"""The tensor-parallel process group and the leader -> follower command channel."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

# A follower waits for the leader's next command outside any collective (on its command
# socket), so the timeout only bounds joining and a hung collective.
DEFAULT_TIMEOUT = datetime.timedelta(days=7)


def _loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def keep_gloo_on_loopback(device: str) -> None:
    """On the CPU, gloo's connections on the loopback interface (unless the operator chose one)."""
    lo = _loopback_interface()
    if not device.startswith("cuda") and lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group of ``size`` ranks.

    Collectives must be called by every rank in the same order; rank 0 (the
    leader) decides that order and announces each step with ``command``.
    """

    rank: int
    size: int
    device: str
    group: Optional[Any] = None
    # deterministic inference: `all_reduce` adds the ranks' parts in rank order. A ring all-reduce
    # splits the tensor by its size, so with three or more ranks each element's order of additions
    # (and its last bits) would follow the number of rows in the step.
    ordered_sum: bool = False

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: str, timeout_s: Optional[float] = None) -> "TPGroup":
        """Blocks until all ``size`` ranks have joined (gloo on CPU, NCCL on CUDA); raises when
        they have not within ``timeout_s`` seconds (``--dist-timeout``; None: `DEFAULT_TIMEOUT`),
        which then bounds each collective too."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(rank)
        timeout = DEFAULT_TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        return cls(rank, size, f"cuda:{rank}" if device.startswith("cuda") else device, dist.group.WORLD)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``x``."""
        if not self.ordered_sum:
            dist.all_reduce(x, group=self.group)
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)
        return x

    def gather_columns(self, local: torch.Tensor, widths: list[int]) -> Optional[torch.Tensor]:
        """Rank ``r`` holds columns of width ``widths[r]``; the leader gets them
        concatenated in rank order ([N, sum(widths)]), the others None."""
        width = max(widths)
        if local.shape[1] < width:  # gather needs one shape: pad, then cut
            local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_leader else None
        dist.gather(local, parts, dst=0, group=self.group)
        if parts is None:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)

    def broadcast_(self, t: torch.Tensor) -> None:
        """The leader's ``t`` (a host tensor) into every other rank's ``t``, in place."""
        if self.device.startswith("cuda"):  # NCCL moves device memory only
            buf = t.to(self.device)
            dist.broadcast(buf, src=0, group=self.group)
            t.copy_(buf)
        else:
            dist.broadcast(t, src=0, group=self.group)

    def command(self, message: Any = None) -> Any:
        """The leader sends ``message`` (any picklable object, tensors included);
        every other rank receives and returns it."""
        box = [message if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
