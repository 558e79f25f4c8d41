"""`KVEventSettings`: publishing KV cache events for routers (vLLM's ``--kv-events-config``).

The flag takes vLLM's JSON, e.g. ``{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}``;
`parse_kv_events_config` checks it into a `KVEventsConfig`. The events carry the
token ids of every cached prompt (every tenant's: a ``cache_salt`` changes only
the hashes), and ZMQ has no keys: the default endpoint is loopback
(``tcp://127.0.0.1:5557``, where vLLM's is every interface), and an endpoint
open beyond it is logged as a warning at start (`exposure_warning`). The events and
their wire format: radixrt/memory/kv_events.py; the publisher:
radixrt/scheduler/kv_event_publisher.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from radixrt.config.fields import setting

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://127.0.0.1:5557"
    topic: str = ""
    hwm: int = 100_000  # messages the PUB socket queues per subscriber before dropping
    replay_endpoint: Optional[str] = None  # a ROUTER socket answering replay requests (kv_event_replay.py)
    buffer_steps: int = 10_000  # batches kept for replay

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def connect_endpoint(self) -> str:
        """The endpoint a subscriber on this machine connects to (a wildcard host as 127.0.0.1)."""
        return _local(self.endpoint)

    @property
    def connect_replay_endpoint(self) -> Optional[str]:
        """`connect_endpoint` of the replay socket (None: no replay)."""
        return _local(self.replay_endpoint) if self.replay_endpoint else None


def exposure_warning(endpoint: str) -> Optional[str]:
    """The warning an endpoint that is open beyond this machine deserves, or None (loopback, ipc)."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return None
    return (
        f"KV events at {endpoint} can be read by anyone who reaches that port: they carry the token ids of "
        "every cached prompt, of every tenant (ZMQ has no keys). Keep the port on a private network."
    )


def _local(endpoint: str) -> str:
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://0.0.0.0:", "://127.0.0.1:")


def parse_kv_events_config(text: Optional[str]) -> Optional[KVEventsConfig]:
    """The flag's JSON as a `KVEventsConfig` (None when unset); ValueError naming what is wrong."""
    if text is None:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_events_config must be JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("kv_events_config must be a JSON object")
    known = {f for f in KVEventsConfig.__dataclass_fields__} | {"max_queue_size"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"kv_events_config has unknown keys {unknown}; known: {sorted(known)}")
    raw = {k: v for k, v in raw.items() if k in KVEventsConfig.__dataclass_fields__}  # vLLM's others: accepted
    cfg = KVEventsConfig(**raw)
    if not isinstance(cfg.enable_kv_cache_events, bool):
        raise ValueError("kv_events_config 'enable_kv_cache_events' must be true or false")
    if cfg.publisher not in PUBLISHERS:
        raise ValueError(f"kv_events_config 'publisher' must be one of {PUBLISHERS}, got {cfg.publisher!r}")
    if not isinstance(cfg.endpoint, str) or "://" not in cfg.endpoint:
        raise ValueError(f"kv_events_config 'endpoint' must be a ZMQ endpoint (tcp://*:5557), got {cfg.endpoint!r}")
    if not isinstance(cfg.topic, str) or not _positive_int(cfg.hwm) or not _positive_int(cfg.buffer_steps):
        raise ValueError("kv_events_config 'topic' must be a string, 'hwm' and 'buffer_steps' positive integers")
    replay = cfg.replay_endpoint
    if replay is not None and (not isinstance(replay, str) or "://" not in replay or replay == cfg.endpoint):
        raise ValueError(f"kv_events_config 'replay_endpoint' must be a ZMQ endpoint of its own, got {replay!r}")
    return cfg


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def shift_endpoint_port(text: Optional[str], offset: int) -> Optional[str]:
    """The flag's JSON with the endpoints' ports moved by ``offset`` (replica ``offset``
    of ``--dp``, as vLLM offsets its data-parallel ranks' endpoints)."""
    cfg = parse_kv_events_config(text)
    if cfg is None or not offset:
        return text
    raw = json.loads(text or "{}")
    for key in ("endpoint", "replay_endpoint"):
        if raw.get(key) is None:
            continue
        head, _, port = raw[key].rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_config '{key}' needs a port for --dp, got {raw[key]!r}")
        raw[key] = f"{head}:{int(port) + offset}"
    return json.dumps(raw)


def replica_kv_events_configs(text: Optional[str], replicas: int) -> list[Optional[str]]:
    """Each ``--dp`` replica's flag (`shift_endpoint_port` by its index); ValueError
    when two replicas' sockets would share a port."""
    texts = [shift_endpoint_port(text, i) for i in range(replicas)]
    cfgs = [c for c in map(parse_kv_events_config, texts) if c is not None]
    taken = [e for c in cfgs for e in (c.endpoint, c.replay_endpoint) if e is not None]
    if len(set(taken)) != len(taken):
        raise ValueError(
            f"--dp {replicas}: replica i publishes on the configured ports + i, so the replay_endpoint's port "
            f"must be at least {replicas} away from the endpoint's"
        )
    return texts


@dataclass(frozen=True)
class KVEventSettings:
    """KV cache events for routers."""

    kv_events_config: Optional[str] = setting(
        None,
        "publish KV cache events (BlockStored, BlockRemoved, AllBlocksCleared, vLLM's schema and msgpack "
        "format) on a ZMQ PUB socket, and stream them on GET /debug/events: vLLM's JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'; unset: off',
    )

    def __post_init__(self) -> None:
        parse_kv_events_config(self.kv_events_config)

    @property
    def events(self) -> Optional[KVEventsConfig]:
        """The parsed config when events are published, else None."""
        cfg = parse_kv_events_config(self.kv_events_config)
        return cfg if cfg is not None and cfg.publishes else None
