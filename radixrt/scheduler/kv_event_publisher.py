"""Publishing the radix tree's KV events on a ZMQ PUB socket, framed as vLLM's publisher frames them.

Each batch goes out as three frames: the topic, an 8-byte big-endian
sequence number, and the msgpack of a ``KVEventBatch``
(radixrt/memory/kv_events.py). Sending never blocks the step loop: past the
socket's high-water mark a batch is dropped and counted (``dropped``), and a
subscriber sees the gap in the sequence numbers.

`KVEvents.flush`, called once per scheduler step, drains the recorder the
tree tells of its nodes and sends what it holds. With ``replay_endpoint`` set,
the last ``buffer_steps`` batches can be asked for again
(radixrt/scheduler/kv_event_replay.py).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import zmq

from radixrt.config.kv_events import KVEventsConfig, exposure_warning
from radixrt.memory.kv_events import KVEventRecorder, encode_batch
from radixrt.scheduler.kv_event_replay import ReplayServer

logger = logging.getLogger(__name__)

MAX_SUBSCRIPTION_BYTES = 4096


class KVEvents:
    def __init__(self, cfg: KVEventsConfig, tree: Any, page_size: int, medium: Optional[str]) -> None:
        """Record ``tree``'s node changes (it must take node observers: the radix
        tree, with or without a host tier) and publish them at ``cfg.endpoint``."""
        self.recorder = KVEventRecorder(page_size, medium)
        tree.add_node_observer(self.recorder)
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, cfg.hwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        # a subscriber sends only subscriptions (a topic): a peer announcing a larger message
        # is cut off at once, where ZMQ would otherwise allocate whatever size it announces
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
        self.socket.bind(cfg.endpoint)
        for endpoint in (cfg.endpoint, cfg.replay_endpoint):
            warning = exposure_warning(endpoint) if endpoint else None
            if warning:
                logger.warning("%s", warning)
        self.topic = cfg.topic.encode()
        self.seq = 0
        self.sent = 0
        self.dropped = 0
        self.replay = ReplayServer(cfg.replay_endpoint, cfg.buffer_steps) if cfg.replay_endpoint else None
        logger.info("publishing KV events on %s (topic %r)", cfg.endpoint, cfg.topic)

    def flush(self) -> None:
        batch = self.recorder.drain()
        if batch is None:
            return
        payload = encode_batch(batch)
        frames = [self.topic, self.seq.to_bytes(8, "big"), payload]
        if self.replay is not None:  # kept even when the send below drops it: that is what replay is for
            self.replay.add(self.seq, payload)
        self.seq += 1
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1

    def stats(self) -> dict[str, int]:
        return {"kv_event_batches_sent": self.sent, "kv_event_batches_dropped": self.dropped}

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        self.socket.close(linger=0)


def build_kv_events(
    events: Optional[KVEventsConfig], tree: Any, page_size: int, device: str, storage: Any = None
) -> Optional[KVEvents]:
    """The publisher when events are configured and the cache keeps prefixes, else
    None. A ``storage`` tier (storage_tier.py) announces its blocks through it too."""
    if events is None:
        return None
    if not hasattr(tree, "add_node_observer"):
        logger.warning("KV events are configured but the radix cache is off: nothing to publish")
        return None
    published = KVEvents(events, tree, page_size, "GPU" if device.startswith("cuda") else "CPU")
    if storage is not None:
        storage.events = published.recorder
    return published
