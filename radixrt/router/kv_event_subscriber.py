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
counted and skipped; the thread never dies of one.

Replay. For a worker whose publisher has a replay socket (vLLM's
``replay_endpoint``: radixrt/scheduler/kv_event_replay.py), a batch that does
not follow the last one seen (the router joined late, ZMQ's slow-joiner loss,
a batch dropped past the high-water mark, a reconnection) first fetches the
missing batches from the replay socket, so the worker stays (or becomes) live
without waiting for a ``/flush_cache``. Batches the publisher no longer
buffers stay missing: the index then treats the worker as out of sync.
"""

from __future__ import annotations

import logging
import threading
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
        self._replay: dict[str, zmq.Socket] = {}
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

    # ------------------------------------------------------------------ the thread
    def _open(self, ctx: zmq.Context) -> tuple[zmq.Poller, dict[Any, tuple[str, bool]], list[zmq.Socket]]:
        poller = zmq.Poller()
        owners: dict[Any, tuple[str, bool]] = {}  # socket -> (worker, is its monitor)
        sockets = []
        for worker, endpoint in self.endpoints.items():
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5 * RECONNECT_MS)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            monitor = sub.get_monitor_socket(_MONITORED)
            sub.connect(endpoint)
            for s, is_monitor in ((sub, False), (monitor, True)):
                poller.register(s, zmq.POLLIN)
                owners[s] = (worker, is_monitor)
            sockets += [monitor, sub]
        for worker, endpoint in self.replay_endpoints.items():
            dealer = self._replay[worker] = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            sockets.append(dealer)
        return poller, owners, sockets

    def _run(self) -> None:
        ctx = zmq.Context()
        poller, owners, sockets = self._open(ctx)
        self._ready.set()
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    worker, is_monitor = owners[sock]
                    try:
                        if is_monitor:
                            self._on_monitor(worker, sock)
                        else:
                            self._on_message(worker, sock)
                    except Exception:  # the thread must outlive any one message
                        self.bad_messages += 1
                        logger.exception("KV events from %s: message skipped", worker)
        finally:
            for s in sockets:
                s.close(linger=0)
            ctx.term()

    def _on_monitor(self, worker: str, sock: zmq.Socket) -> None:
        event = recv_monitor_message(sock)["event"]
        if event == zmq.EVENT_CONNECTED:
            logger.info("KV events: connected to %s's publisher", worker)
            self.index.connected(worker)
        elif event == zmq.EVENT_DISCONNECTED:
            logger.warning("KV events: %s's publisher went away; routing to it by the approximate tree", worker)
            self.index.disconnected(worker)

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
        expected = self.index.next_seq(worker)
        start = 0 if seq < expected else expected  # a publisher that restarted: its stream from 0
        if start < seq and worker in self._replay:
            for missed, missed_batch in self._fetch_replay(worker, start, seq):
                self.index.apply(worker, missed, missed_batch)
        self.index.apply(worker, seq, batch)

    def _fetch_replay(self, worker: str, start: int, until: int) -> list[tuple[int, Any]]:
        """Batches ``start`` .. ``until - 1`` of ``worker``'s replay buffer, as many as it still holds."""
        sock = self._replay[worker]
        while sock.poll(0):  # the tail of an earlier answer that timed out
            sock.recv_multipart()
        sock.send(start.to_bytes(8, "big"))
        out = []
        while sock.poll(REPLAY_TIMEOUT_MS):
            frames = sock.recv_multipart()
            if len(frames) != 2 or len(frames[0]) != 8:
                self.bad_messages += 1
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == END_SEQ:
                break
            if start <= seq < until:
                try:
                    out.append((seq, decode_batch(frames[1])))
                except msgspec.DecodeError:
                    self.bad_messages += 1
        self.replayed += len(out)
        logger.info("KV events: %d batches of %s replayed (%d..%d asked)", len(out), worker, start, until - 1)
        return out
