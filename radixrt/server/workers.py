"""Entry points of the server's two child processes (started with the
multiprocessing "spawn" context, so everything here must be importable and
picklable)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.config import EngineConfig
from radixrt.log_format import log_format
from radixrt.requests.runtime_info import RuntimeInfo
from radixrt.server.ipc import DetokBatch, DetokItem, DetokRegister, IpcAddrs, make_socket, parent_alive

POLL_MS = 200  # how often an idle child looks at its parent and stop flag


@dataclass(frozen=True)
class ChildReady:
    """A child's first message on its ``ready`` pipe: started. The scheduler
    process sends its `RuntimeInfo` (the detokenizer none)."""

    pid: int
    info: Optional[RuntimeInfo] = None


@dataclass(frozen=True)
class ChildFailed:
    """A child's first message on its ``ready`` pipe: it could not start (``error``: the traceback)."""

    error: str


def _setup_child(name: str, log_level: str) -> None:
    # Ctrl-C in a terminal reaches the whole process group: the parent alone
    # handles it and then stops the children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.WARNING),
        format=log_format(name),
    )


def run_scheduler_process(
    config: EngineConfig, addrs: IpcAddrs, ready: Any, parent_pid: Optional[int], heartbeat: Any = None
) -> None:
    """Load the model, report readiness (`ChildReady` with the `RuntimeInfo`, or
    `ChildFailed`) on ``ready``, then serve
    the scheduler's event loop over ZMQ until the parent goes away. Every loop
    iteration (at least every POLL_MS while idle) stores time.monotonic() in
    ``heartbeat`` (a shared double) when given: the server's /health reads it."""
    _setup_child("scheduler", config.debug.log_level)
    log = logging.getLogger("radixrt.server.scheduler")
    failed = []
    # Everything that runs torch (the model load too) happens on one worker thread, never on
    # this main thread: see `radixrt.engine.Engine` on libgomp's thread pools.
    worker = threading.Thread(
        target=_build_and_serve,
        args=(config, addrs, ready, parent_pid, heartbeat, log, failed),
        name="radixrt-scheduler-loop",
        daemon=True,
    )
    worker.start()
    while worker.is_alive():
        worker.join(0.5)
    os._exit(1 if failed else 0)


def _build_and_serve(
    config: EngineConfig,
    addrs: IpcAddrs,
    ready: Any,
    parent_pid: Optional[int],
    heartbeat: Any,
    log: logging.Logger,
    failed: list,
) -> None:
    """The scheduler thread of `run_scheduler_process`: build, report, serve; appends to
    ``failed`` when the loop crashes (a failed start exits the process at once)."""
    try:
        import zmq

        from radixrt.scheduler.scheduler import Scheduler

        sched = Scheduler(config)
        ctx = zmq.Context()
        pull = make_socket(ctx, zmq.PULL, addrs.scheduler_in, bind=True)
        push = make_socket(ctx, zmq.PUSH, addrs.detokenizer_in, bind=False)
        ready.send(ChildReady(os.getpid(), sched.runtime_info()))
    except BaseException:  # noqa: BLE001 - reported to the parent, then exit non-zero
        err = traceback.format_exc()
        log.error("scheduler failed to start:\n%s", err)
        try:
            ready.send(ChildFailed(err))
        finally:
            os._exit(1)
    ready.close()

    def recv(block: bool) -> list[Any]:
        if heartbeat is not None:
            heartbeat.value = time.monotonic()
        msgs: list[Any] = []
        if block and not pull.poll(POLL_MS):
            return msgs
        while True:
            try:
                msgs.append(pull.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs

    def send(msg: Any) -> None:
        push.send_pyobj(msg)

    def should_stop() -> bool:
        return not parent_alive(parent_pid)

    try:
        sched.event_loop(recv, send, should_stop)
    except BaseException:  # noqa: BLE001
        log.error("scheduler loop crashed:\n%s", traceback.format_exc())
        failed.append(True)


class DetokenizerLoop:
    """Keeps one IncrementalDetokenizer per rid; turns TokenBatches into
    DetokBatches (cumulative text + the scheduler's delta) and forwards
    ControlReplies untouched."""

    MAX_ORPHANS = 10_000

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.detoks: dict[str, Any] = {}
        # The samples of each request with n > 1 (internal ids), and back.
        self.children: dict[str, set[str]] = {}
        self.parent_of: dict[str, str] = {}
        # Outputs that arrived before their registration (two sockets, no
        # global order): replayed when it comes.
        self.orphans: dict[str, list[Any]] = {}

    def handle(self, msg: Any) -> list[Any]:
        from radixrt.requests.detokenizer import IncrementalDetokenizer
        from radixrt.requests.messages import TokenBatch

        if isinstance(msg, DetokRegister):
            items = []
            if msg.parent and msg.rids != [msg.parent]:
                self.children[msg.parent] = set(msg.rids)
                for rid in msg.rids:
                    self.parent_of[rid] = msg.parent
            for rid in msg.rids:
                self.detoks[rid] = IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=msg.skip_special_tokens,
                    spaces_between_special_tokens=msg.spaces_between_special_tokens,
                    stop=list(msg.stop or []),
                    no_stop_trim=msg.no_stop_trim,
                    stop_regex=list(msg.stop_regex or []),
                    prompt_tail=msg.prompt_tail,
                )
                for out in self.orphans.pop(rid, []):
                    item = self._push(out)
                    if item is not None:
                        items.append(item)
            return [DetokBatch(items)] if items else []
        if isinstance(msg, TokenBatch):
            items = []
            for out in msg.outputs:
                item = self._push(out)
                if item is not None:
                    items.append(item)
            return [DetokBatch(items)] if items else []
        return [msg]  # ControlReply and anything else: pass through

    def _push(self, out: Any) -> Optional[DetokItem]:
        det = self.detoks.get(out.rid)
        if det is None:
            if out.finish_reason is not None and out.finish_reason.is_abort and not out.new_token_ids:
                # An abort of a request whose registration is not here (or is
                # already gone), e.g. the scheduler refusing a request before
                # expanding its n samples: forget those samples (its children,
                # never other rids that merely start alike) and pass the abort
                # on so the tokenizer manager hears of it.
                for rid in list(self.children.get(out.rid, ())):
                    self._forget(rid)
                return DetokItem(out.rid, "", out)
            if len(self.orphans) >= self.MAX_ORPHANS:
                self.orphans.pop(next(iter(self.orphans)))
            self.orphans.setdefault(out.rid, []).append(out)
            return None
        text = det.push(out.new_token_ids, out.finish_reason)
        if out.finish_reason is not None:
            self._forget(out.rid)
        return DetokItem(out.rid, text, out)

    def _forget(self, rid: str) -> None:
        """Drop the detokenizer of sample ``rid`` (and its request's entry with its last sample)."""
        self.detoks.pop(rid, None)
        parent = self.parent_of.pop(rid, None)
        if parent is not None:
            kids = self.children.get(parent)
            if kids is not None:
                kids.discard(rid)
                if not kids:
                    del self.children[parent]


def run_detokenizer_process(
    model_path: Optional[str], log_level: str, addrs: IpcAddrs, ready: Any, parent_pid: Optional[int]
) -> None:
    _setup_child("detokenizer", log_level)
    log = logging.getLogger("radixrt.server.detokenizer")
    try:
        import zmq

        from radixrt.requests.tokenizer_utils import load_decoder

        loop = DetokenizerLoop(load_decoder(model_path))
        ctx = zmq.Context()
        pull = make_socket(ctx, zmq.PULL, addrs.detokenizer_in, bind=True)
        push = make_socket(ctx, zmq.PUSH, addrs.tokenizer_in, bind=False)
        ready.send(ChildReady(os.getpid()))
    except BaseException:  # noqa: BLE001
        err = traceback.format_exc()
        log.error("detokenizer failed to start:\n%s", err)
        try:
            ready.send(ChildFailed(err))
        finally:
            os._exit(1)
    ready.close()
    try:
        while parent_alive(parent_pid):
            if not pull.poll(POLL_MS):
                continue
            while True:
                try:
                    msg = pull.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for out in loop.handle(msg):
                    push.send_pyobj(out)
    except BaseException:  # noqa: BLE001
        log.error("detokenizer crashed:\n%s", traceback.format_exc())
        os._exit(1)
    os._exit(0)
