"""SGLang's weight-update groups: a trainer broadcasts new weights to the server over torch.distributed.

RL trainers (slime, OpenRLHF, verl's server mode) call ``/init_weights_update_group`` with the
address of a rendezvous they host, then, for each update, ``/update_weights_from_distributed`` with
the tensors' names, dtypes and shapes while they broadcast those tensors from rank 0 of the group,
in that order. `WeightGroups` holds this server's side: its groups by name, joined as rank
``rank_offset`` of ``world_size`` (a process group of its own, made the way the trainers' helpers
make theirs: a ``tcp://`` rendezvous, a store prefixed with the group's name), and the receiving
of one update's tensors. Gloo runs on a CPU, NCCL on CUDA. Joining and receiving block until the
trainer takes part (or `TIMEOUT_S`): joins and leaves run on this object's thread, an update's
receiving on the update's own (`GenerationControl`).
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
from typing import Any, Sequence

import torch

from radixrt.requests.messages import ControlReply, WeightsGroupReq

logger = logging.getLogger(__name__)

TIMEOUT_S = 600.0
MAX_GROUPS = 8
BACKENDS = ("gloo", "nccl")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> torch.bfloat16 (ValueError for anything else)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class WeightGroups:
    def __init__(self, device: str) -> None:
        self.device = device
        self._groups: dict[str, Any] = {}  # name -> the backend process group
        self._lock = threading.Lock()
        self._replies: list[ControlReply] = []  # answered on the worker, in the calls' order
        # a daemon: a join left waiting for its trainer must not hold the process's exit
        self._calls: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name="radixrt-weights-group", daemon=True).start()

    def handle(self, msg: WeightsGroupReq) -> None:
        """Join or leave on this object's thread, one call after another, so that the replies
        (`replies`) come in the order of the calls, as the fronts match them."""
        self._calls.put(msg)

    def _serve(self) -> None:
        while (msg := self._calls.get()) is not None:
            self._answer(msg)

    def _answer(self, msg: WeightsGroupReq) -> None:
        try:
            if msg.join:
                rank = msg.rank_offset  # (a tensor-parallel server refuses updates from tensors)
                self.join(msg.master_address, msg.master_port, rank, msg.world_size, msg.group_name, msg.backend)
                reply = _reply(True, f"Joined the weight-update group {msg.group_name!r} as rank {rank}.")
            else:
                self.destroy(msg.group_name)
                reply = _reply(True, f"Destroyed the weight-update group {msg.group_name!r}.")
        except Exception as e:  # noqa: BLE001 - a failed rendezvous is the caller's answer
            logger.warning("weight-update group %r: %s", msg.group_name, e)
            reply = _reply(False, str(e) if not msg.join else f"could not join {msg.group_name!r}: {e}")
        with self._lock:
            self._replies.append(reply)

    def replies(self) -> list[ControlReply]:
        with self._lock:
            out, self._replies = self._replies, []
        return out

    def join(self, address: str, port: int, rank: int, world_size: int, name: str, backend: str) -> None:
        """Join group ``name`` as ``rank`` of ``world_size`` (blocks until every rank joined)."""
        from torch.distributed.distributed_c10d import (
            Backend,
            GroupName,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        if backend not in BACKENDS or (backend == "nccl") != self.device.startswith("cuda"):
            raise ValueError(
                f"backend {backend!r} does not serve this {self.device} server (gloo on a CPU, nccl on CUDA)"
            )
        with self._lock:
            if name in self._groups:
                raise ValueError(f"a weight-update group {name!r} exists; destroy it first")
            if len(self._groups) >= MAX_GROUPS:
                raise ValueError(f"{MAX_GROUPS} weight-update groups exist; destroy one first")
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            PrefixStore(name, store),
            group_name=GroupName(name),
            timeout=timeout,
        )
        _world.pg_group_ranks[group] = {r: r for r in range(world_size)}  # its ranks are its own
        with self._lock:
            self._groups[name] = group

    def receive(
        self, name: str, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], max_values: int
    ) -> list:
        """The (name, tensor) pairs rank 0 of group ``name`` broadcasts now, one tensor each, in order;
        ValueError before anything is received when they would hold more than ``max_values`` values
        (the model's: an update replaces weights, it adds none)."""
        import torch.distributed as dist

        asked = sum(math.prod(int(n) for n in shape) for shape in shapes)
        if asked > max_values:
            raise ValueError(f"the update's tensors hold {asked} values, more than the model's {max_values}")

        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise ValueError(f"no weight-update group {name!r}; call init_weights_update_group first")
        pairs = []
        for tensor_name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(tuple(int(n) for n in shape), dtype=parse_dtype(dtype), device=self.device)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([t], options).wait()
            pairs.append((tensor_name, t))
        return pairs

    def destroy(self, name: str) -> None:
        import torch.distributed as dist

        with self._lock:
            group = self._groups.pop(name, None)
        if group is None:
            raise ValueError(f"no weight-update group {name!r}")
        try:
            dist.destroy_process_group(group)
        except Exception:
            logger.debug("weight-update group %r: destroy_process_group failed", name, exc_info=True)

    def close(self) -> None:
        self._calls.put(None)
        for name in list(self._groups):
            self.destroy(name)


def _reply(ok: bool, message: str) -> ControlReply:
    return ControlReply("weights_group", ok=ok, payload={"success": ok, "message": message})
