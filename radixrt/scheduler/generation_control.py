"""Pausing generation and updating the weights in place: SGLang's routes for RL rollouts.

`GenerationControl` holds the scheduler's pause state and its queue of weight
updates; the scheduler asks it what to hold back each step. The contracts:

* **Paused** (`PauseGenerationReq`), the scheduler runs no step until
  `ContinueGenerationReq`. Mode "abort" ends every request first (SGLang's
  default); "retract" sends the running requests back to the queue without
  their KV (they recompute it when generation continues); "in_place" keeps
  them as they are. New requests queue meanwhile.
* **A weight update** (`UpdateWeightsReq`) starts reading the checkpoint on a
  thread at once. Until it is installed no waiting request starts, while
  the requests that started finish their generation with the old weights,
  those retracted for memory meanwhile included (with ``abort_all_requests``
  every request is ended first; while paused, running requests are retracted
  and go on after the update, since their KV was computed with the old
  weights). Once none is left, the new weights replace the old and the
  prefix cache (device and host tiers) is dropped: no KV computed with other
  weights is ever served. Then the queue starts again, with the new weights.
* Updates are answered in the order they came (one reply each, kind
  "update_weights"): ``success``, ``message`` and ``num_paused_requests``
  (the requests that waited for it), as SGLang's route answers. A checkpoint
  that cannot be read, or whose architecture differs, is refused and the old
  weights keep serving. The KV storage tier keys its blocks by the weights the
  server started with, so a server with one refuses every update.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.requests.messages import ControlReply, UpdateWeightsReq

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
STORAGE_KEYS_WEIGHTS = "the KV storage tier keys its blocks by the weights the server started with"


@dataclass
class _Update:
    msg: UpdateWeightsReq
    loading: Optional["Future[Any]"]  # the runner's LoadedWeights; None when refused at once
    error: str = ""


class GenerationControl:
    """Pause state and pending weight updates of one scheduler (see the module docstring)."""

    def __init__(self, load: Any, refusal: str = "", weight_version: str = "default") -> None:
        """``load(path)`` reads a checkpoint (`ModelRunner.load_weights`, run on a thread of its
        own); ``refusal``: why this server cannot update its weights ("": it can)."""
        self._load = load
        self.refusal = refusal
        self.paused: Optional[str] = None  # the pause mode, or None
        self.weight_version = weight_version
        self.updates: deque[_Update] = deque()
        self._replies: list[ControlReply] = []

    @property
    def holds_admission(self) -> bool:
        """No waiting request may start: generation is paused or an update waits."""
        return self.paused is not None or bool(self.updates)

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)} (got {mode!r})")
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def request_update(self, msg: UpdateWeightsReq) -> None:
        """Queue ``msg`` and start reading its checkpoint (unless this server refuses updates)."""
        if self.refusal:
            self.updates.append(_Update(msg, None, self.refusal))
            return
        self.updates.append(_Update(msg, self._read(msg.model_path)))

    def _read(self, path: str) -> "Future[Any]":
        """``load(path)`` on a thread of its own that ends with it: libgomp keeps an OpenMP
        thread pool for each thread that ran torch's parallel regions while that thread lives,
        and pools beyond the cores slow every later step (the Engine's docstring)."""
        future: "Future[Any]" = Future()

        def run() -> None:
            try:
                future.set_result(self._load(path))
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler through the future
                future.set_exception(e)

        threading.Thread(target=run, name="radixrt-weights", daemon=True).start()
        return future

    def next_install(self, drained: bool, wait_s: float = 0.0) -> Optional[tuple[UpdateWeightsReq, Any]]:
        """The first queued update whose checkpoint is read, with it, once ``drained`` (no request
        that started is left); updates that failed are answered on the way. Waits up to
        ``wait_s`` for a read."""
        while self.updates:
            head = self.updates[0]
            if head.loading is not None and not head.error:
                if not head.loading.done() and wait_s > 0:
                    wait_futures([head.loading], timeout=wait_s)
                if not head.loading.done():
                    return None
                try:
                    loaded = head.loading.result()
                except Exception as e:  # noqa: BLE001 - an unreadable or different checkpoint: refused
                    logger.warning("weight update from %s refused: %s", head.msg.model_path, e)
                    head.error = str(e) or type(e).__name__
            if head.error:
                self.updates.popleft()
                self._reply(False, head.error)
                continue
            if not drained:
                return None
            self.updates.popleft()
            return head.msg, loaded
        return None

    def installed(self, msg: UpdateWeightsReq, waiting: int) -> None:
        self.weight_version = msg.model_path if msg.weight_version is None else msg.weight_version
        self._reply(True, f"Succeeded to update model weights from {msg.model_path}.", waiting)

    def _reply(self, ok: bool, message: str, paused_requests: int = 0) -> None:
        payload = {"success": ok, "message": message, "num_paused_requests": paused_requests}
        self._replies.append(ControlReply("update_weights", ok=ok, payload=payload))

    def replies(self) -> list[ControlReply]:
        out, self._replies = self._replies, []
        return out
