"""The router's subscriber to its workers' KV cache events.

One thread, one ZMQ SUB socket per worker, connected to that worker's
publisher (``--kv-events-config`` of ``radixrt serve``, e.g.
``tcp://10.0.0.1:5557``). Each message is vLLM's three frames (topic, 8-byte
big-endian sequence number, the msgpack of a ``KVEventBatch``:
radixrt/scheduler/kv_event_publisher.py); the batches go into the
`KVEventIndex`.

A publisher that is not there (a worker without events, or not started yet)
costs nothing: ZMQ keeps trying to connect in the background, and the worker
is simply not live in the index (the policy uses its approximate tree). A
connection that drops (the worker stopped or restarted) clears the worker's
blocks (`KVEventIndex.disconnected`); ZMQ reconnects by itself, and a restarted
worker's stream begins again at batch 0. A message that cannot be decoded is
counted and skipped; the thread never dies of one. What a worker may send is
bounded (`MAX_MESSAGE_BYTES` a message; a replay answer `MAX_REPLAY_BATCHES`,
`MAX_REPLAY_BYTES` and `MAX_REPLAY_SECONDS`), so a broken or hostile publisher
costs the router bounded memory and time.

Replay. For a worker whose publisher has a replay socket (vLLM's
``replay_endpoint``: radixrt/scheduler/kv_event_replay.py), a batch that does
not follow the last one seen (the router joined late, ZMQ's slow-joiner loss,
a batch dropped past the high-water mark, a reconnection) first fetches the
missing batches from the replay socket, so the worker stays (or becomes) live
without waiting for a ``/flush_cache``. Batches the publisher no longer
buffers stay missing: the index then treats the worker as out of sync. On
connecting, the subscriber also asks for everything buffered, so a worker
that was serving before the router started is live at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Optional

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from radixrt.memory.kv_events import decode_batch
from radixrt.router.kv_event_index import KVEventIndex

logger = logging.getLogger("radixrt.router")

POLL_MS = 100
RECONNECT_MS = 200  # how often ZMQ retries a publisher that is not there
REPLAY_TIMEOUT_MS = 1000  # how long a replay answer may pause before the rest is given up
# What one worker may send: a batch (a step's events) is far below this; a replay answer is cut off
# past its count, bytes or seconds (a publisher that streams without end is treated as out of sync)
MAX_MESSAGE_BYTES = 64 << 20
MAX_REPLAY_BATCHES = 100_000
MAX_REPLAY_BYTES = 256 << 20
MAX_REPLAY_SECONDS = 30.0
END_SEQ = -1
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class KVEventSubscriber:
    """Feeds ``index`` from ``endpoints`` (worker url -> ZMQ endpoint), on a
    daemon thread between `start` and `stop`. ``topic``: the publishers'
    topic ('' takes every message)."""

    def __init__(
        self,
        index: KVEventIndex,
        endpoints: dict[str, str],
        topic: str = "",
        replay_endpoints: Optional[dict[str, str]] = None,
    ) -> None:
        self.index = index
        self.endpoints = dict(endpoints)
        self.replay_endpoints = dict(replay_endpoints or {})
        self.replayed = 0  # batches fetched from replay sockets
        # the thread's own: its sockets per worker (sub, monitor, replay), and the poller over them
        self._replay: dict[str, zmq.Socket] = {}
        self._replayed_to: dict[str, int] = {}  # the last batch applied from replay on connecting
        self._sockets: dict[str, list[zmq.Socket]] = {}
        self._owners: dict[Any, tuple[str, bool]] = {}  # socket -> (worker, is its monitor)
        self._poller = zmq.Poller()
        self._ctx: Any = None
        self._changes: "queue.SimpleQueue[tuple[str, Optional[str], Optional[str]]]" = queue.SimpleQueue()
        self.topic = topic.encode()
        self.bad_messages = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()

    def start(self) -> None:
        """Start the thread; returns once every socket is connecting."""
        if self._thread is not None or not self.endpoints:
            return
        self._thread = threading.Thread(target=self._run, name="radixrt-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def add(self, worker: str, endpoint: str, replay: Optional[str] = None) -> None:
        """Follow one more worker (``/add_worker``), from the next poll on."""
        self.endpoints[worker] = endpoint
        if replay is not None:
            self.replay_endpoints[worker] = replay
        if self._thread is None:
            self.start()
        else:
            self._changes.put((worker, endpoint, replay))

    def remove(self, worker: str) -> None:
        """Stop following ``worker`` (``/remove_worker``); its sockets are closed."""
        if self.endpoints.pop(worker, None) is not None and self._thread is not None:
            self._changes.put((worker, None, None))
        self.replay_endpoints.pop(worker, None)

    # ------------------------------------------------------------------ the thread
    def _connect(self, worker: str, endpoint: str, replay: Optional[str]) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5 * RECONNECT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # larger: the connection is dropped, not buffered
        monitor = sub.get_monitor_socket(_MONITORED)
        sub.connect(endpoint)
        self._sockets[worker] = [sub, monitor]
        for sock, is_monitor in ((sub, False), (monitor, True)):
            self._poller.register(sock, zmq.POLLIN)
            self._owners[sock] = (worker, is_monitor)
        if replay is not None:
            dealer = self._replay[worker] = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            dealer.connect(replay)
            self._sockets[worker].append(dealer)

    def _disconnect(self, worker: str) -> None:
        for sock in self._sockets.pop(worker, []):
            if sock in self._owners:
                self._poller.unregister(sock)
                del self._owners[sock]
            sock.close(linger=0)
        self._replay.pop(worker, None)
        self._replayed_to.pop(worker, None)
        self.index.disconnected(worker)

    def _apply_changes(self) -> None:
        while not self._changes.empty():
            worker, endpoint, replay = self._changes.get()
            self._disconnect(worker)
            if endpoint is not None:
                self._connect(worker, endpoint, replay)

    def _run(self) -> None:
        self._ctx = zmq.Context()
        for worker, endpoint in list(self.endpoints.items()):
            self._connect(worker, endpoint, self.replay_endpoints.get(worker))
        self._ready.set()
        try:
            while not self._stop.is_set():
                self._apply_changes()
                for sock, _ in self._poller.poll(POLL_MS):
                    worker, is_monitor = self._owners[sock]
                    try:
                        if is_monitor:
                            self._on_monitor(worker, sock)
                        else:
                            self._on_message(worker, sock)
                    except Exception:  # the thread must outlive any one message
                        self.bad_messages += 1
                        logger.exception("KV events from %s: message skipped", worker)
        finally:
            for sockets in self._sockets.values():
                for sock in sockets:
                    sock.close(linger=0)
            self._ctx.term()

    def _on_monitor(self, worker: str, sock: zmq.Socket) -> None:
        event = recv_monitor_message(sock)["event"]
        if event == zmq.EVENT_CONNECTED:
            logger.info("KV events: connected to %s's publisher", worker)
            self.index.connected(worker)
            if worker in self._replay:
                self._catch_up(worker)
        elif event == zmq.EVENT_DISCONNECTED:
            logger.warning("KV events: %s's publisher went away; routing to it by the approximate tree", worker)
            self._replayed_to.pop(worker, None)
            self.index.disconnected(worker)

    def _catch_up(self, worker: str) -> None:
        """On connecting: everything the publisher still buffers past what was
        seen. An empty, complete answer from batch 0 means it never published:
        its cache is empty, so the worker is live at once."""
        start = self.index.next_seq(worker)
        batches, complete = self._fetch_replay(worker, start, 2**63)
        if not batches and complete and start == 0:
            self.index.empty(worker)
        for seq, batch in batches:
            self.index.apply(worker, seq, batch)
        if batches:
            self._replayed_to[worker] = batches[-1][0]

    def _on_message(self, worker: str, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=True)
        if len(frames) != 3 or len(frames[1]) != 8:
            self.bad_messages += 1
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = decode_batch(frames[2])
        except msgspec.DecodeError:
            self.bad_messages += 1
            return
        if seq <= self._replayed_to.get(worker, -1):
            return  # already applied from the replay socket when connecting
        expected = self.index.next_seq(worker)
        start = 0 if seq < expected else expected  # a publisher that restarted: its stream from 0
        if start < seq and worker in self._replay:
            for missed, missed_batch in self._fetch_replay(worker, start, seq)[0]:
                self.index.apply(worker, missed, missed_batch)
        self.index.apply(worker, seq, batch)

    def _fetch_replay(self, worker: str, start: int, until: int) -> tuple[list[tuple[int, Any]], bool]:
        """Batches ``start`` .. ``until - 1`` of ``worker``'s replay buffer, as
        many as it still holds, and whether the answer ended with its marker
        (False too when it passed a bound: the rest is not waited for)."""
        sock = self._replay[worker]
        while sock.poll(0):  # the tail of an earlier answer that timed out
            sock.recv_multipart()
        sock.send(start.to_bytes(8, "big"))
        out = []
        complete = False
        received = 0
        deadline = time.monotonic() + MAX_REPLAY_SECONDS
        while sock.poll(REPLAY_TIMEOUT_MS):
            frames = sock.recv_multipart()
            received += sum(len(f) for f in frames)
            if len(frames) != 2 or len(frames[0]) != 8:
                self.bad_messages += 1
            else:
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_SEQ:
                    complete = True
                    break
                if start <= seq < until:
                    try:
                        out.append((seq, decode_batch(frames[1])))
                    except msgspec.DecodeError:
                        self.bad_messages += 1
            if len(out) >= MAX_REPLAY_BATCHES or received > MAX_REPLAY_BYTES or time.monotonic() > deadline:
                logger.warning(
                    "KV events: %s's replay answer passed its bounds (%d batches, %d bytes); the rest is ignored",
                    worker,
                    len(out),
                    received,
                )
                self.bad_messages += 1
                break
        self.replayed += len(out)
        logger.info("KV events: %d batches of %s replayed (from %d)", len(out), worker, start)
        return out, complete
