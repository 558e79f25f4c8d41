"""`radixrt router`: the router alone, in front of radixrt (or SGLang)
servers anywhere::

    radixrt router --worker-url http://10.0.0.1:30000 --worker-url http://10.0.0.2:30000 \\
        --policy cache_aware --host 0.0.0.0 --port 30000

`serve_router` runs the app under uvicorn and drains on the first SIGTERM or
Ctrl-C: new requests get a 503, answers in flight may finish for
``--shutdown-grace-s``, then it stops (a second signal stops at once).
``radixrt serve --dp N`` uses the same function with its replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Any, Callable, Optional

from radixrt.router.kv_event_index import DEFAULT_MAX_BLOCKS
from radixrt.router.kv_routing import KVEventRouting, parse_endpoints, split_replay
from radixrt.router.policies import POLICIES, CacheAwareConfig, make_policy
from radixrt.router.state import RouterConfig
from radixrt.router.workers import HealthConfig, WorkerPool

logger = logging.getLogger("radixrt.router")


def add_policy_args(p: "argparse.ArgumentParser | argparse._ArgumentGroup", prefix: str = "") -> None:
    """The routing flags (``prefix`` 'router-' for `radixrt serve --dp`)."""
    d = CacheAwareConfig()
    h = HealthConfig()
    p.add_argument(
        f"--{prefix}policy",
        dest="router_policy",
        choices=POLICIES,
        default="cache_aware",
        help="how requests are spread over the workers",
    )
    p.add_argument(
        f"--{prefix}cache-threshold",
        dest="cache_threshold",
        type=float,
        default=d.cache_threshold,
        help="cache_aware: route by prefix when the best worker holds at least this fraction of "
        "the prompt; otherwise to the worker with the smallest tree",
    )
    p.add_argument(
        f"--{prefix}balance-abs-threshold",
        dest="balance_abs_threshold",
        type=int,
        default=d.balance_abs_threshold,
        help="cache_aware: loads are imbalanced (route to the least loaded) when max - min in-flight "
        "requests exceeds this and ...",
    )
    p.add_argument(
        f"--{prefix}balance-rel-threshold",
        dest="balance_rel_threshold",
        type=float,
        default=d.balance_rel_threshold,
        help="cache_aware: ... max exceeds this times min",
    )
    p.add_argument(
        f"--{prefix}eviction-interval",
        dest="eviction_interval_s",
        type=float,
        default=d.eviction_interval_s,
        help="cache_aware: seconds between cuts of the prefix trees",
    )
    p.add_argument(
        f"--{prefix}max-tree-size",
        dest="max_tree_size",
        type=int,
        default=d.max_tree_size,
        help="cache_aware: most characters/token ids kept per worker's prefix tree",
    )
    p.add_argument(
        f"--{prefix}health-check-interval",
        dest="health_check_interval_s",
        type=float,
        default=h.health_check_interval_s,
        help="seconds between /health checks of each worker",
    )
    p.add_argument(
        f"--{prefix}health-check-timeout",
        dest="health_check_timeout_s",
        type=float,
        default=h.health_check_timeout_s,
        help="seconds a worker's /health may take to answer",
    )
    p.add_argument(
        f"--{prefix}health-failure-threshold",
        dest="health_failure_threshold",
        type=int,
        default=h.health_failure_threshold,
        help="failed checks in a row that remove a worker from routing",
    )
    p.add_argument(
        f"--{prefix}health-success-threshold",
        dest="health_success_threshold",
        type=int,
        default=h.health_success_threshold,
        help="passed checks in a row that add it back",
    )


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--worker-url",
        dest="worker_urls",
        action="append",
        default=[],
        required=True,
        help="a worker's base url (repeat for each worker)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port")
    p.add_argument(
        "--api-key",
        dest="api_key",
        default=os.environ.get("RADIXRT_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /dashboard and (as SGLang) paths "
        "starting with /health, /ready or /metrics; the header is passed on to the workers "
        "(default: $RADIXRT_API_KEY)",
    )
    p.add_argument(
        "--admin-api-key",
        dest="admin_api_key",
        default=os.environ.get("RADIXRT_ADMIN_API_KEY"),
        help="the operator's key: accepted wherever --api-key is, and needed to add or remove workers "
        "(/add_worker, /remove_worker); unset: nobody may (default: $RADIXRT_ADMIN_API_KEY)",
    )
    p.add_argument(
        "--max-request-bytes",
        dest="max_request_bytes",
        type=int,
        default=RouterConfig.max_request_bytes,
        help="largest accepted request body in bytes (413 above), as a server's",
    )
    p.add_argument(
        "--request-timeout",
        dest="request_timeout_s",
        type=float,
        default=1800.0,
        help="seconds a proxied request may take",
    )
    p.add_argument(
        "--shutdown-grace-s",
        dest="shutdown_grace_s",
        type=float,
        default=10.0,
        help="on SIGTERM/Ctrl-C, seconds the answers in flight may take to finish",
    )
    p.add_argument("--log-level", dest="log_level", default="warning", help="log level")
    from radixrt.server.slow_clients import add_read_timeout_args

    add_read_timeout_args(p)
    add_policy_args(p)
    add_kv_events_args(p)


def add_kv_events_args(p: argparse.ArgumentParser) -> None:
    """cache_aware on the workers' KV cache events (radixrt/router/kv_routing.py, docs/scale_out.md)."""
    p.add_argument(
        "--kv-events-endpoint",
        dest="kv_events_endpoints",
        action="append",
        default=[],
        metavar="[WORKER_URL=]ENDPOINT[,REPLAY]",
        help="cache_aware: follow a worker's KV cache events (its --kv-events-config publisher), e.g. "
        "http://10.0.0.1:30000=tcp://10.0.0.1:5557 (,tcp://10.0.0.1:5558 adds its replay socket), or a bare "
        "tcp://... for the --worker-url in the same position (repeat per worker); workers whose events do "
        "not flow are routed by the approximate tree",
    )
    p.add_argument(
        "--kv-events-port",
        dest="kv_events_port",
        type=int,
        default=None,
        help="cache_aware: every worker publishes KV events on this port of its host (tcp://HOST:PORT)",
    )
    p.add_argument(
        "--kv-events-replay-port",
        dest="kv_events_replay_port",
        type=int,
        default=None,
        help="cache_aware: every worker answers KV event replay requests on this port of its host (the "
        "replay_endpoint of its --kv-events-config): missed batches are fetched again instead of waiting "
        "for a /flush_cache",
    )
    p.add_argument("--kv-events-topic", dest="kv_events_topic", default="", help="the publishers' topic")
    p.add_argument(
        "--kv-events-max-blocks",
        dest="kv_events_max_blocks",
        type=int,
        default=DEFAULT_MAX_BLOCKS,
        help="most block hashes kept per worker",
    )
    p.add_argument(
        "--tokenizer-path",
        dest="tokenizer_path",
        default=None,
        help="the workers' model folder: its tokenizer turns text prompts into the token ids the KV events "
        "describe (without it only input_ids prompts are routed on the events)",
    )


def kv_events_from_args(args: argparse.Namespace, urls: list[str]) -> Optional[KVEventRouting]:
    """The KV-event routing the flags ask for (None: none asked, or a policy other than cache_aware)."""
    if args.router_policy != "cache_aware" or not (args.kv_events_endpoints or args.kv_events_port):
        return None
    endpoints, replay = split_replay(
        parse_endpoints(urls, args.kv_events_endpoints, args.kv_events_port), args.kv_events_replay_port
    )
    return KVEventRouting(
        endpoints,
        args.kv_events_topic,
        args.tokenizer_path,
        args.kv_events_max_blocks,
        replay,
        port=args.kv_events_port,
        replay_port=args.kv_events_replay_port,
    )


def pool_from_args(args: argparse.Namespace, urls: list[str], kv_events: Optional[KVEventRouting] = None) -> WorkerPool:
    cache = CacheAwareConfig(
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        eviction_interval_s=args.eviction_interval_s,
        max_tree_size=args.max_tree_size,
    )
    health = HealthConfig(
        health_check_interval_s=args.health_check_interval_s,
        health_check_timeout_s=args.health_check_timeout_s,
        health_failure_threshold=args.health_failure_threshold,
        health_success_threshold=args.health_success_threshold,
    )
    index = kv_events.index if kv_events is not None else None
    return WorkerPool(urls, make_policy(args.router_policy, cache, index), health)


def serve_router(
    app: Any,
    host: str,
    port: int,
    grace_s: float,
    log_level: str = "warning",
    on_drain: Optional[Callable[[], None]] = None,
    banner: str = "radixrt router",
    header_timeout_s: float = 10.0,
    body_timeout_s: float = 30.0,
) -> int:
    """Run ``app`` (from `build_router_app`) until a signal; drain on the first.
    ``on_drain`` runs when draining starts (``--dp``: signal the replicas).
    A request's head and body must arrive within ``header_timeout_s`` and
    ``body_timeout_s`` (radixrt/server/slow_clients.py).
    Returns 0 after a clean stop, 1 when the port could not be bound."""
    import uvicorn

    from radixrt.server.slow_clients import timed_h11_protocol

    state = app.state.router
    loop_box: list[asyncio.AbstractEventLoop] = []

    async def drain() -> None:
        if on_drain is not None:
            on_drain()
        deadline = time.monotonic() + grace_s + 2.0
        while state.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        server.should_exit = True

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            loop_box.append(asyncio.get_running_loop())
            await super().startup(sockets)
            if self.started:
                print(
                    f"{banner} ready at http://{host}:{port} ({state.pool.policy.name}, "
                    f"{len(state.pool.workers)} workers)",
                    file=sys.stderr,
                    flush=True,
                )

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit or state.draining or not self.started or not loop_box:
                super().handle_exit(sig, frame)
                return
            state.draining = True
            loop_box[0].call_soon_threadsafe(lambda: tasks.append(asyncio.ensure_future(drain())))

    tasks: list[asyncio.Future] = []
    level = log_level.lower()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=level if level in ("debug", "info") else "warning",
        access_log=level in ("debug", "info"),
        lifespan="on",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
        http=timed_h11_protocol(header_timeout_s, body_timeout_s),
    )
    server = DrainingServer(config)
    server.run()
    return 0 if server.started else 1


def router_main(args: argparse.Namespace) -> int:
    """Entry point of `radixrt router`."""
    from radixrt.router.app import build_router_app

    logging.getLogger("radixrt.router").setLevel(args.log_level.upper())
    try:
        kv_events = kv_events_from_args(args, args.worker_urls)
    except ValueError as e:
        print(f"radixrt router: {e}", file=sys.stderr)
        return 2
    pool = pool_from_args(args, args.worker_urls, kv_events)
    config = RouterConfig(
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        max_request_bytes=args.max_request_bytes,
        request_timeout_s=args.request_timeout_s,
        eviction_interval_s=args.eviction_interval_s if args.router_policy == "cache_aware" else None,
    )
    app = build_router_app(pool, config, kv_events=kv_events)
    return serve_router(
        app,
        args.host,
        args.port,
        args.shutdown_grace_s,
        args.log_level,
        header_timeout_s=args.header_read_timeout_s,
        body_timeout_s=args.body_read_timeout_s,
    )
