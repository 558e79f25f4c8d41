"""Starting the follower ranks and sending them the leader's calls.

The leader (rank 0, in the scheduler's process) starts ranks 1..size-1 as
subprocesses (``python -m radixrt.executor.parallel.follower``), joins the
process group with them, and from then on sends each model call it makes
(``forward``, ``logits``) over a ZMQ socket per follower before making it
itself; the followers make the same call, so the collectives inside meet.
Commands travel outside the process group so that an idle follower waits on
a socket it can poll (and exits when its leader is gone) instead of blocking
in a collective.

Nothing of this listens on a network port: the command sockets are ``ipc://``
paths and the group meets through a ``file://`` store, both in a directory
only this user can enter (``mkdtemp``), and each command socket is a PAIR (one
peer). A PUSH socket on a loopback TCP port let any local process connect and
take a rank's commands (PUSH deals them round-robin to whoever connects): the
ranks' collectives then never met and the server hung. On the CPU, gloo's own
connections stay on the loopback interface (``GLOO_SOCKET_IFNAME``, unless set).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import zmq

from radixrt.executor.parallel.group import TPGroup, keep_gloo_on_loopback
from radixrt.executor.runner_settings import RunnerSettings

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0


class Followers:
    """The leader's handle on ranks 1..size-1: their processes and command sockets.

    ``send`` must be called with every model call, in the order the leader
    makes them (the step's thread sends most, the scheduler's thread some between
    steps: a lock keeps each command whole on the sockets); ``stop`` ends the
    followers (idempotent)."""

    def __init__(self, settings: RunnerSettings) -> None:
        self.size = settings.execution.tp_size
        self._ctx: zmq.Context = zmq.Context.instance()
        self._socks: list[Any] = []
        self._send_lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self._dir = Path(tempfile.mkdtemp(prefix="radixrt-tp-"))  # mode 0700: this user only
        init_method = (self._dir / "rendezvous").as_uri()
        payload = settings.to_json()
        log_level = logging.getLevelName(logging.getLogger("radixrt").getEffectiveLevel())
        keep_gloo_on_loopback(settings.execution.device)
        for rank in range(1, self.size):
            sock = self._ctx.socket(zmq.PAIR)
            sock.setsockopt(zmq.LINGER, 0)
            commands = f"ipc://{self._dir / f'rank{rank}'}"
            sock.bind(commands)
            self._socks.append(sock)
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "radixrt.executor.parallel.follower",
                        "--rank",
                        str(rank),
                        "--init-method",
                        init_method,
                        "--commands",
                        commands,
                        "--settings",
                        payload,
                        "--log-level",
                        log_level,
                    ],
                )
            )
        self.group = self._join(init_method, settings.execution.device, settings.execution.dist_timeout)
        self._stopped = False

    def _join(self, init_method: str, device: str, timeout_s: Optional[float]) -> TPGroup:
        """Join as rank 0, failing fast if a follower dies before everyone has joined."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = TPGroup.join(0, self.size, init_method, device, timeout_s)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        t = threading.Thread(target=join, name="radixrt-tp-join", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            dead = [(r + 1, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead and t.is_alive():
                self.stop()
                raise RuntimeError(
                    f"tensor-parallel rank(s) exited while starting: {dead} (rank, exit code); "
                    "their errors are in this process's stderr"
                )
        if "error" in box:
            self.stop()
            raise box["error"]
        return box["group"]

    def send(self, *command: Any) -> None:
        with self._send_lock:
            for sock in self._socks:
                sock.send_pyobj(command)

    def stop(self) -> None:
        if getattr(self, "_stopped", False):
            return
        self._stopped = True
        for sock in self._socks:
            try:
                sock.send_pyobj(("stop",), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel follower pid %d did not stop; killing it", p.pid)
                p.kill()
                p.wait()
        for sock in self._socks:
            sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)
