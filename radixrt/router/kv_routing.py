"""Routing on the workers' KV cache events: the wiring of the index, its
subscriber and the tokenizer, and the flags that name the publishers.

``radixrt router`` takes the publishers with ``--kv-events-endpoint``
(repeatable): ``WORKER_URL=ENDPOINT`` for one worker
(``http://10.0.0.1:30000=tcp://10.0.0.1:5557``, with its replay socket
``...=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558``), or a bare ``ENDPOINT``,
taken by the ``--worker-url`` of the same position; or
``--kv-events-port PORT`` for every worker at once
(``tcp://<the worker's host>:PORT``, for workers that all publish on
``tcp://*:PORT``); ``--kv-events-replay-port PORT`` names their replay sockets
(``replay_endpoint`` in the workers' config) the same way. ``radixrt serve --dp N --kv-events-config ...`` wires its
replicas' endpoints (port + i) by itself. ``--tokenizer-path`` (the model's
folder; ``--dp``: the model's own) lets text prompts be followed too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional
from urllib.parse import urlsplit

from radixrt.router.kv_event_index import DEFAULT_MAX_BLOCKS, KVEventIndex, TokenKey
from radixrt.router.kv_event_subscriber import KVEventSubscriber
from radixrt.router.token_keys import token_key

logger = logging.getLogger("radixrt.router")


def replay_endpoints(worker_urls: list[str], port: Optional[int]) -> dict[str, str]:
    """``{worker url: its replay endpoint}`` for ``--kv-events-replay-port`` (empty when unset)."""
    from radixrt.router.workers import normalize_url

    if port is None:
        return {}
    return {normalize_url(u): f"tcp://{urlsplit(normalize_url(u)).hostname}:{port}" for u in worker_urls}


def parse_endpoints(worker_urls: list[str], specs: list[str], port: Optional[int] = None) -> dict[str, str]:
    """``{worker url: ZMQ endpoint}`` from ``--kv-events-endpoint`` values and
    ``--kv-events-port``; ValueError naming what is wrong."""
    from radixrt.router.workers import normalize_url

    urls = [normalize_url(u) for u in worker_urls]
    out: dict[str, str] = {}
    if port is not None:
        for u in urls:
            out[u] = f"tcp://{urlsplit(u).hostname}:{port}"
    bare = [s for s in specs if "=" not in s]
    if bare and len(bare) != len(specs):
        raise ValueError("--kv-events-endpoint: give every value as WORKER_URL=ENDPOINT, or every one bare")
    if bare and len(bare) > len(urls):
        raise ValueError(f"--kv-events-endpoint: {len(bare)} endpoints for {len(urls)} --worker-url")
    for i, spec in enumerate(specs):
        url, endpoint = (urls[i], spec) if "=" not in spec else spec.rsplit("=", 1)
        url = normalize_url(url)
        if url not in urls:
            raise ValueError(f"--kv-events-endpoint {spec!r}: {url} is not a --worker-url")
        if any("://" not in e for e in endpoint.split(",")) or endpoint.count(",") > 1:
            raise ValueError(
                f"--kv-events-endpoint {spec!r}: the endpoint must be a ZMQ one (tcp://host:port), "
                "optionally followed by ,REPLAY_ENDPOINT"
            )
        out[url] = endpoint
    return out


def split_replay(endpoints: dict[str, str], replay_port: Optional[int]) -> tuple[dict[str, str], dict[str, str]]:
    """The publishers and the replay sockets of `parse_endpoints`' values
    (``PUB[,REPLAY]``); ``--kv-events-replay-port`` names those not given."""
    replay = replay_endpoints(list(endpoints), replay_port)
    pub = {}
    for url, value in endpoints.items():
        pub[url], _, given = value.partition(",")
        if given:
            replay[url] = given
    return pub, replay


class KVEventRouting:
    """The index the cache-aware policy reads, the subscriber that fills it
    (`start`/`stop`, from the router's lifespan) and the keys of requests."""

    def __init__(
        self,
        endpoints: dict[str, str],
        topic: str = "",
        tokenizer_path: Optional[str] = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        replay_endpoints: Optional[dict[str, str]] = None,
        port: Optional[int] = None,
        replay_port: Optional[int] = None,
    ) -> None:
        """``port`` / ``replay_port``: the ports every worker's host publishes on
        (``--kv-events-port`` / ``--kv-events-replay-port``), which `add_worker`
        follows for workers added at run time."""
        self.index = KVEventIndex(max_blocks)
        self.subscriber = KVEventSubscriber(self.index, endpoints, topic, replay_endpoints)
        self.port, self.replay_port = port, replay_port
        self.tokenizer_path = tokenizer_path
        self.tokenizer: Any = None

    def start(self) -> None:
        """Load the tokenizer (when a path was given) and start the subscriber."""
        if self.tokenizer_path and self.tokenizer is None:
            from radixrt.requests.tokenizer_utils import load_tokenizer

            self.tokenizer = load_tokenizer(self.tokenizer_path)
        self.subscriber.start()
        logger.info("following KV events of %s", ", ".join(f"{u} at {e}" for u, e in self.subscriber.endpoints.items()))

    def stop(self) -> None:
        self.subscriber.stop()

    def add_worker(self, url: str) -> None:
        """Follow a worker added at run time, when the workers' ports are known."""
        if self.port is not None:
            pub, replay = split_replay(parse_endpoints([url], [], self.port), self.replay_port)
            for u, endpoint in pub.items():
                self.subscriber.add(u, endpoint, replay.get(u))

    def remove_worker(self, url: str) -> None:
        from radixrt.router.workers import normalize_url

        self.subscriber.remove(normalize_url(url))

    async def key(self, path: str, body: Any) -> Optional[TokenKey]:
        """The body's `TokenKey` (text is tokenized off the event loop), or None."""
        if self.tokenizer is not None and isinstance(body, dict) and ("text" in body or "prompt" in body):
            return await asyncio.to_thread(token_key, path, body, self.tokenizer)
        return token_key(path, body, None)
