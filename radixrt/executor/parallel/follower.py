"""A follower rank: ``python -m radixrt.executor.parallel.follower --rank R ...``.

Loads its shard of the model (a `ModelRunner` for rank R), then repeats each
model call its leader announces, until told to stop or until the leader's
process is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import zmq

from radixrt.executor.parallel.group import TPGroup, keep_gloo_on_loopback
from radixrt.executor.runner_settings import RunnerSettings
from radixrt.log_format import log_format
from radixrt.memory.host_pool import HostKVPool

if TYPE_CHECKING:
    from radixrt.executor.model_runner import ModelRunner

_POLL_MS = 500


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--commands", required=True, help="the leader's ZMQ PAIR address (ipc://)")
    p.add_argument("--settings", required=True, help="the leader's RunnerSettings as JSON")
    p.add_argument("--log-level", default="WARNING", help="the leader's log level")
    args = p.parse_args(argv)
    settings = RunnerSettings.from_json(args.settings)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.WARNING),
        format=log_format(f"tp{args.rank}"),
    )
    leader = os.getppid()
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(args.commands)
    from radixrt.executor.model_runner import ModelRunner

    ex = settings.execution
    keep_gloo_on_loopback(ex.device)
    group = TPGroup.join(args.rank, ex.tp_size, args.init_method, ex.device, ex.dist_timeout)
    rank = _Rank(ModelRunner(settings, tp=group))
    with torch.inference_mode():
        while True:
            if not sock.poll(_POLL_MS):
                if os.getppid() != leader:  # the leader died without saying stop
                    return 1
                continue
            command = sock.recv_pyobj()
            if command[0] == "stop":
                break
            try:
                _run(rank, command)
            except RuntimeError:
                if not _leader_gone(leader):
                    raise
                # the leader was stopped inside a step (a shutdown's grace ran out): not a fault here
                logging.getLogger(__name__).info("the leader stopped during a step; this rank stops too")
                return 1
    group.close()
    return 0


@dataclass
class _Rank:
    """A follower's runner, and the host tier's pool once the leader made one (``host_pool``)."""

    runner: "ModelRunner"
    host_pool: Optional[HostKVPool] = None


def _run(rank: _Rank, command: tuple) -> None:
    runner = rank.runner
    if command[0] == "forward":
        runner.forward_batch(*command[1:])
    elif command[0] == "logits":
        runner.logits(command[1])
    elif command[0] == "copy_slots":  # a copy on write between steps (ModelRunner.copy_slots)
        runner.copy_slots(command[1], command[2])
    elif command[0] == "host_pool":  # this rank's heads' share of the host tier (scheduler/host_tier.py)
        rank.host_pool = HostKVPool(runner.kv_pool, command[1], kv_cache_dtype=command[2])
    elif command[0] == "host_copies":  # the leader's copies to and from the host tier, in its order
        assert rank.host_pool is not None, "host-tier copies before the host pool"
        rank.host_pool.run(command[1])
    elif command[0] == "reload":  # the leader read and checked this checkpoint: its tensors follow
        runner.install_weights(runner.receive_weights(command[1]))
    else:
        raise ValueError(f"unknown tensor-parallel command {command[0]!r}")


def _leader_gone(leader: int, wait_s: float = 3.0) -> bool:
    """Whether the leader's process ends within ``wait_s`` (a collective fails as it goes)."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == leader:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


if __name__ == "__main__":
    sys.exit(main())
