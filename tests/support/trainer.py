"""A trainer's side of a weight-update group, as RL trainers make theirs (rank 0 of a group of
its own, over a tcp:// rendezvous): ``python -m tests.support.trainer PORT WORLD NAME VALUE
SHAPE...`` joins group NAME as rank 0 of WORLD, then broadcasts one float32 tensor per SHAPE
(``64`` or ``8x64``) filled with VALUE, and prints "sent"."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous


def main() -> None:
    port, world, name, value = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    timeout = datetime.timedelta(seconds=120)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world, 0, [], Backend("gloo"), PrefixStore(name, store), group_name=name, timeout=timeout
    )
    print("joined", flush=True)
    for shape in sys.argv[5:]:
        t = torch.full([int(n) for n in shape.split("x")], value)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        group.broadcast([t], options).wait()
    print("sent", flush=True)
    # Out without the C++ teardown: this rank hosts the rendezvous store, whose server thread, destroyed at
    # interpreter exit while the engine's side still holds its connection, aborted the process now and then
    # ("terminate called without an active exception", exit -6) after everything had been sent.
    os._exit(0)


if __name__ == "__main__":
    main()
