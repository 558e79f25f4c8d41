"""`radixrt serve --dp N`: N replicas behind one HTTP front.

Each replica is a whole radixrt server (`radixrt.server.launch.launch_server`:
its own scheduler and detokenizer processes, KV pool and radix cache) in a
child process listening on a private port of 127.0.0.1. The front is the
router (`radixrt.router.app`) in this process, on the public ``--host`` and
``--port``, with ``--router-policy`` (cache_aware by default). Every flag of
`radixrt serve` applies to each replica as given (``--max-total-tokens`` is
per replica: N replicas hold N times the KV).

Health: the front's ``/health`` is 200 only while every replica is healthy.
A replica process that exits stops the whole server with a non-zero code (as
a dead scheduler does in a single server); a replica whose front is gone
(killed with SIGKILL) drains and exits by itself.

Shutdown (SIGTERM or Ctrl-C): the front refuses new requests (503) and sends
SIGTERM to each replica, which drains as a single server does (its requests
in flight get ``--shutdown-grace-s``); the front stops once its answers are
out, waits for the replicas, and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from radixrt.config import EngineConfig
from radixrt.config.kv_events import KVEventSettings, parse_kv_events_config, replica_kv_events_configs
from radixrt.log_format import REPLICA_ENV, log_format

logger = logging.getLogger("radixrt.router")

WATCH_INTERVAL_S = 0.5


def _watch_parent(parent: int) -> None:
    """In a replica: when the front is gone (killed without a chance to stop us), drain and exit."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _replica_main(config: EngineConfig, sargs: Any, index: int) -> None:
    import threading

    from radixrt.server.launch import launch_server

    os.environ[REPLICA_ENV] = str(index)  # its processes' log lines name it (radixrt/log_format.py)

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="watch-front").start()
    sys.exit(launch_server(config, sargs))


def _wait_healthy(procs: list[Any], urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(range(len(urls)))
    with httpx.Client(timeout=2.0) as client:  # one SSL context for all polls, not one per poll
        while pending:
            for i in list(pending):
                if not procs[i].is_alive():
                    raise RuntimeError(f"replica {i} exited during startup (exit code {procs[i].exitcode})")
                try:
                    if client.get(urls[i] + "/health").status_code == 200:
                        pending.discard(i)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"replicas {sorted(pending)} not ready after {timeout:.0f} s")
            if pending:
                time.sleep(0.25)


def _stop(procs: list[Any], timeout: float) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _replica_watch(urls: list[str], procs: list[Any], n: int, state: dict[str, int]) -> Any:
    """The front's lifespan: a task that, when a replica exits, records exit code 1
    and sends this process SIGTERM (the front drains and the other replicas stop)."""
    import asyncio

    @contextlib.asynccontextmanager
    async def watch(app: Any) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(WATCH_INTERVAL_S)
                dead = [(u, p) for u, p in zip(urls, procs) if not p.is_alive()]
                if dead and not app.state.router.draining:
                    reason = ", ".join(f"replica {u} (pid {p.pid}) exited with code {p.exitcode}" for u, p in dead)
                    print(f"radixrt serve --dp {n}: {reason}; shutting down", file=sys.stderr, flush=True)
                    state["exit_code"] = 1
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()

    return watch


def _replica_events(config: EngineConfig, urls: list[str]) -> Any:
    """The front's `KVEventRouting` over the replicas' publishers (replica i on
    the configured port + i) with the model's tokenizer (none under skip_tokenizer_init: token ids
    route, text is the replicas' to refuse); None without events."""
    from radixrt.executor.model_store import resolve_model_path
    from radixrt.router.kv_routing import KVEventRouting

    text = config.kv_events.kv_events_config
    events = config.kv_events.events
    if events is None:
        return None
    endpoints, replay = {}, {}
    for url, replica_text in zip(urls, replica_kv_events_configs(text, len(urls))):
        shifted = parse_kv_events_config(replica_text)
        assert shifted is not None
        endpoints[url] = shifted.connect_endpoint
        if shifted.connect_replay_endpoint is not None:
            replay[url] = shifted.connect_replay_endpoint
    tokenizer = config.model.tokenizer_source(str(resolve_model_path(config.model.model_path)))
    return KVEventRouting(endpoints, events.topic, tokenizer, replay_endpoints=replay)


def serve_dp(config: EngineConfig, sargs: Any, args: argparse.Namespace) -> int:
    """Run ``args.dp`` replicas and the router front until a signal; the exit code."""
    from radixrt.router.app import RouterConfig, build_router_app
    from radixrt.router.cli import pool_from_args, serve_router
    from radixrt.server.local import free_port

    logging.basicConfig(
        level=getattr(logging, config.debug.log_level.upper(), logging.WARNING),
        format=log_format("dp-front"),
        stream=sys.stderr,
    )
    n = int(args.dp)
    ports = [free_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    mp = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    state = {"exit_code": 0}
    try:  # each replica its own endpoints
        replica_events = replica_kv_events_configs(config.kv_events.kv_events_config, n)
    except ValueError as e:
        print(f"radixrt serve: {e}", file=sys.stderr, flush=True)
        return 2
    for index, (port, events) in enumerate(zip(ports, replica_events)):
        rargs = dataclasses.replace(sargs, host="127.0.0.1", port=port)
        replica_config = dataclasses.replace(config, kv_events=KVEventSettings(events))
        target, name = _replica_main, f"radixrt-replica-{port}"
        procs.append(mp.Process(target=target, args=(replica_config, rargs, index), name=name))
        procs[-1].start()

    def interrupt(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    prev = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            _wait_healthy(procs, urls, sargs.startup_timeout)
        except KeyboardInterrupt:
            return 0
        except RuntimeError as e:
            print(f"radixrt serve --dp {n}: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            for sig, h in prev.items():
                signal.signal(sig, h)
        kv_events = _replica_events(config, urls) if args.router_policy == "cache_aware" else None
        pool = pool_from_args(args, urls, kv_events)
        rconfig = RouterConfig(
            api_key=sargs.api_key,
            admin_api_key=sargs.admin_api_key,
            max_request_bytes=sargs.max_request_bytes,
            require_all_healthy=True,
            eviction_interval_s=args.eviction_interval_s if args.router_policy == "cache_aware" else None,
        )

        watch = _replica_watch(urls, procs, n, state)
        app = build_router_app(pool, rconfig, lifespan=watch, kv_events=kv_events)

        def on_drain() -> None:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)

        code = serve_router(
            app,
            sargs.host,
            sargs.port,
            sargs.shutdown_grace_s,
            config.debug.log_level,
            on_drain=on_drain,
            banner=f"radixrt server (--dp {n})",
            header_timeout_s=sargs.header_read_timeout_s,
            body_timeout_s=sargs.body_read_timeout_s,
        )
        return code or state["exit_code"]
    finally:
        _stop(procs, sargs.shutdown_grace_s + 10.0)
