"""The replay socket of the KV event publisher (vLLM's ``replay_endpoint``).

A subscriber that missed batches (a gap in the sequence numbers, or a router
started after the worker) asks for them again: it sends the 8-byte big-endian
number of the first batch it wants to a ZMQ ROUTER socket bound at
``replay_endpoint``, and gets back every batch still buffered from that number
on, each as two frames (the 8-byte number, the msgpack payload, as published),
then the end marker: the number -1 (8 bytes, signed) and an empty payload.
A REQ client's empty delimiter frame is echoed before each reply (vLLM's
example subscriber uses REQ; a DEALER client, as radixrt's router, sends none).

The buffer holds the last ``buffer_steps`` published batches (vLLM's default
10,000), so its memory is bounded by that count. The socket is served on its
own daemon thread: a replay never runs on the step loop, which only appends
to the buffer (under a lock).
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import zmq

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 100
MAX_REQUEST_BYTES = 64


class ReplayServer:
    """Buffers published batches and answers replay requests at ``endpoint``."""

    def __init__(self, endpoint: str, buffer_steps: int) -> None:
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._socket: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # a request is one 8-byte sequence number: a peer announcing more is cut off, not buffered
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.bind(endpoint)  # on the caller's thread, so a taken port fails at start-up
        self._stop = threading.Event()
        self.replays = 0
        self._thread = threading.Thread(target=self._serve, name="radixrt-kv-replay", daemon=True)
        self._thread.start()
        logger.info("KV event replay on %s (last %d batches)", endpoint, buffer_steps)

    def add(self, seq: int, payload: bytes) -> None:
        """Keep published batch ``seq`` (called by the step loop after each send)."""
        with self._lock:
            self._buffer.append((seq, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered batches numbered ``start`` or later, in order."""
        with self._lock:
            return [(s, p) for s, p in self._buffer if s >= start]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._socket.close(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(POLL_MS):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                continue  # not a replay request: ignored
            envelope = frames[:-1]  # the client's identity, and REQ's empty delimiter
            start = int.from_bytes(frames[-1], "big")
            self.replays += 1
            for seq, payload in self.since(start):
                self._socket.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
            self._socket.send_multipart([*envelope, END_SEQ, b""])
