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
* **Tensors** (`UpdateTensorsReq`, in-process callers) update the same way: the
  tensors are written into a copy of the weights the update before them leaves
  (the served ones when none waits), so updates sent one part at a time add up.
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
from typing import Any, Optional, Union

from radixrt.requests.messages import ControlReply, UpdateTensorsReq, UpdateWeightsReq

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
STORAGE_KEYS_WEIGHTS = "the KV storage tier keys its blocks by the weights the server started with"


Update = Union[UpdateWeightsReq, UpdateTensorsReq]


@dataclass
class _Update:
    msg: Update
    loading: Optional["Future[Any]"]  # the runner's LoadedWeights; None when refused at once
    error: str = ""


def _source(msg: Update) -> str:
    return msg.model_path if isinstance(msg, UpdateWeightsReq) else "tensors"


class GenerationControl:
    """Pause state and pending weight updates of one scheduler (see the module docstring)."""

    def __init__(self, load: Any, apply: Any, refusal: str = "", weight_version: str = "default") -> None:
        """``load(path)`` reads a checkpoint (`ModelRunner.load_weights`); ``apply(named_tensors,
        base)`` writes tensors into a copy of ``base`` (an update's loaded weights, or None: the
        served ones; `ModelRunner.weights_with`). Both run on a thread of their own. ``refusal``:
        why this server cannot update its weights ("": it can)."""
        self._load = load
        self._apply = apply
        self.refusal = refusal
        self.paused: Optional[str] = None  # the pause mode, or None
        self.released: set[str] = set()  # memory given back (memory_occupation.py): no step runs
        self.weight_version = weight_version
        self.updates: deque[_Update] = deque()
        self._replies: list[ControlReply] = []

    @property
    def halted(self) -> bool:
        """No step runs: generation is paused or memory is released."""
        return self.paused is not None or bool(self.released)

    @property
    def holds_admission(self) -> bool:
        """No waiting request may start: no step runs or an update waits."""
        return self.halted or bool(self.updates)

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)} (got {mode!r})")
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def request_update(self, msg: Update) -> None:
        """Queue ``msg`` and start reading its weights (unless this server refuses updates)."""
        refusal = self.refusal or ("the weights are released: resume them first" if "weights" in self.released else "")
        if refusal:
            self.updates.append(_Update(msg, None, refusal))
            return
        if isinstance(msg, UpdateTensorsReq):
            before = self.updates[-1].loading if self.updates else None
            source = msg.named_tensors

            def apply() -> Any:
                pairs = source() if callable(source) else source  # received on this thread, in order
                return self._apply(pairs, _loaded(before))

            self.updates.append(_Update(msg, self._run(apply)))
        else:
            self.updates.append(_Update(msg, self._run(lambda: self._load(msg.model_path))))

    @staticmethod
    def _run(job: Any) -> "Future[Any]":
        """``job()`` on a thread of its own that ends with it: libgomp keeps an OpenMP thread
        pool for each thread that ran torch's parallel regions while that thread lives, and
        pools beyond the cores slow every later step (the Engine's docstring)."""
        future: "Future[Any]" = Future()

        def run() -> None:
            try:
                future.set_result(job())
            except BaseException as e:  # noqa: BLE001 - handed to the scheduler through the future
                future.set_exception(e)

        threading.Thread(target=run, name="radixrt-weights", daemon=True).start()
        return future

    def next_install(self, drained: bool, wait_s: float = 0.0) -> Optional[tuple[Update, Any]]:
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
                    logger.warning("weight update from %s refused: %s", _source(head.msg), e)
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

    def installed(self, msg: Update, waiting: int) -> None:
        if isinstance(msg, UpdateWeightsReq):
            self.weight_version = msg.model_path if msg.weight_version is None else msg.weight_version
            self._reply(True, f"Succeeded to update model weights from {msg.model_path}.", waiting)
            return
        self.weight_version = self.weight_version if msg.weight_version is None else msg.weight_version
        self._reply(True, "Succeeded to update model weights.", waiting)

    def _reply(self, ok: bool, message: str, paused_requests: int = 0) -> None:
        payload = {"success": ok, "message": message, "num_paused_requests": paused_requests}
        self._replies.append(ControlReply("update_weights", ok=ok, payload=payload))

    def replies(self) -> list[ControlReply]:
        out, self._replies = self._replies, []
        return out


def _loaded(before: Optional["Future[Any]"]) -> Any:
    """What the update ``before`` this one loads (waiting for it), or None when there is none or
    it failed (this one then starts from the weights served)."""
    if before is None:
        return None
    try:
        return before.result()
    except Exception:  # noqa: BLE001 - refused: its own reply says why
        return None
