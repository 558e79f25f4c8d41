"""`radixrt serve`: start the scheduler and detokenizer processes, wait until
the model is loaded, then serve HTTP with uvicorn in this (main) process.

Supervision: a watchdog task polls the children; if one dies, every pending
request fails, /health answers 503 and the server exits non-zero within
seconds. The scheduler's loop stamps a heartbeat (shared memory) on every
iteration, at least every `workers.POLL_MS` when idle; while the last stamp is
older than ``--scheduler-stall-timeout-s`` (the process is stopped or stuck),
/health answers 503, and 200 again once it moves.

Shutdown (Ctrl-C or SIGTERM): the server drains. New requests get a 503
(JSON) and /health a 503; requests in flight may finish for
``--shutdown-grace-s``; those still running then end with an error (an
error event and ``[DONE]`` on streams, a 503 JSON answer otherwise); then
uvicorn stops and the children with it, and the process exits 0. A second
signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, AsyncIterator, Optional

from radixrt.config import EngineConfig
from radixrt.config.lora import parse_lora_paths
from radixrt.log_format import log_format
from radixrt.memory.kv_store_redis import without_password
from radixrt.requests.runtime_info import RuntimeInfo
from radixrt.server.args import ServerArgs, server_args_from_cli
from radixrt.server.workers import ChildFailed, ChildReady

logger = logging.getLogger("radixrt.server")

WATCHDOG_INTERVAL_S = 0.5
HARD_EXIT_AFTER_S = 8.0  # after a child died: give uvicorn this long to stop, then os._exit


def serve_main(args: argparse.Namespace) -> int:
    """Run one server from the flags of `radixrt.server.args.add_serve_args`; the process
    exit code. (`radixrt serve`, radixrt/cli.py, adds ``--dp``: with N > 1
    it runs radixrt/router/dp.py instead, whose replicas are
    :func:`launch_server` calls.)"""
    return launch_server(EngineConfig.from_cli_args(args), server_args_from_cli(args))


class _Child:
    def __init__(self, name: str, proc: Any, conn: Any) -> None:
        self.name = name
        self.proc = proc
        self.conn = conn
        self.info: Optional[RuntimeInfo] = None


def _wait_ready(children: list[_Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for: " + ", ".join(c.name for c in pending))
        for c in list(pending):
            if c.conn.poll(0.1):
                try:
                    msg = c.conn.recv()
                except EOFError:
                    raise RuntimeError(
                        f"the {c.name} process exited during startup (exit code {c.proc.exitcode})"
                    ) from None
                if isinstance(msg, ChildFailed):  # its log has the whole traceback; the error's last line here
                    cause = msg.error.strip().splitlines()[-1] if msg.error.strip() else "no error text"
                    raise RuntimeError(f"the {c.name} process failed to start: {cause}")
                assert isinstance(msg, ChildReady), msg
                c.info = msg.info
                pending.remove(c)
            elif not c.proc.is_alive():
                raise RuntimeError(f"the {c.name} process exited during startup (exit code {c.proc.exitcode})")


def _stop_children(children: list[_Child], timeout: float = 5.0) -> None:
    for c in children:
        if c.proc.is_alive():
            c.proc.terminate()
    deadline = time.monotonic() + timeout
    for c in children:
        c.proc.join(max(deadline - time.monotonic(), 0.1))
        if c.proc.is_alive():
            c.proc.kill()
            c.proc.join(1.0)


def launch_server(config: EngineConfig, sargs: ServerArgs) -> int:
    logging.basicConfig(
        level=getattr(logging, config.debug.log_level.upper(), logging.WARNING),
        format=log_format("server"),
        stream=sys.stderr,
    )
    from radixrt.executor.model_store import resolve_model_path
    from radixrt.server.ipc import IpcAddrs
    from radixrt.server.workers import run_detokenizer_process, run_scheduler_process

    resolved = str(resolve_model_path(config.model.model_path))
    try:
        listener = _claim_port(sargs.host, sargs.port)
    except OSError as e:
        print(f"radixrt serve: cannot listen on {sargs.host}:{sargs.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    addrs = IpcAddrs.create()
    mp = multiprocessing.get_context("spawn")
    children: list[_Child] = []
    stop_signal: list[int] = []
    prev_handlers = {}
    # time.monotonic() of the scheduler loop's last iteration (CLOCK_MONOTONIC: one clock for all processes)
    heartbeat = mp.RawValue("d", time.monotonic())

    def on_signal(sig: int, _frame: Any) -> None:
        stop_signal.append(sig)
        if len(stop_signal) == 1 and threading.current_thread() is threading.main_thread():
            # Before uvicorn runs (still loading): stop right away.
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        prev_handlers[sig] = signal.signal(sig, on_signal)
    exit_code = 0
    try:
        detokenizer_args = (config.model.tokenizer_source(resolved), config.debug.log_level, addrs)
        for name, target, args, kwargs in (
            ("scheduler", run_scheduler_process, (config, addrs), {"heartbeat": heartbeat}),
            ("detokenizer", run_detokenizer_process, detokenizer_args, {}),
        ):
            r, w = mp.Pipe(duplex=False)  # the child's ChildReady (or its failure) comes back on it
            proc = mp.Process(
                target=target, name=f"radixrt-{name}", daemon=True, args=(*args, w, os.getpid()), kwargs=kwargs
            )
            proc.start()
            w.close()
            children.append(_Child(name, proc, r))

        from radixrt.requests.tokenizer_utils import load_tokenizer

        tokenizer = load_tokenizer(config.model.tokenizer_source(resolved), config.model.chat_template)
        if not config.sglang.skip_server_warmup:
            from radixrt.sampling.grammar import warm_grammar_checker

            warm_grammar_checker()  # while the scheduler loads the model, not on the first request
        try:
            _wait_ready(children, sargs.startup_timeout)
        except RuntimeError as e:
            logger.error("%s", e)
            print(f"radixrt serve: {e}", file=sys.stderr)
            return 1
        exit_code = _serve(config, sargs, resolved, tokenizer, addrs, children, stop_signal, heartbeat, listener)
        return exit_code
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, h in prev_handlers.items():
            signal.signal(sig, h)
        _stop_children(children)
        addrs.cleanup()
        listener.close()


def _claim_port(host: str, port: int) -> socket.socket:
    """The HTTP socket, listening before the model loads: a port in use ends the start at once (uvicorn
    found it after the load); connections made meanwhile wait in its backlog until uvicorn serves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only then (Nagle cost 40 ms an answer of two sends)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own
        sock.bind((host, port))
        sock.listen()  # listening, the claim is exclusive: a second server's bind fails too (SO_REUSEADDR)
    except OSError:
        sock.close()
        raise
    return sock


def _chat_template_info(tokenizer: Any) -> dict:
    """Role markers (and the template's default system prompt) for the frontend, as JSON."""
    from radixrt.requests.chat_roles import chat_template_info

    info = chat_template_info(tokenizer)
    return {**info, "chat_role_markers": {k: list(v) for k, v in info["chat_role_markers"].items()}}


class _Serving:
    """One running server's lifecycle: its health, the watchdog over the
    children, the drain on the first signal, and the app's lifespan. ``ctx``
    (the routes' `ServerContext`, which takes `healthy` and `health_problem`)
    and ``server`` (uvicorn) are set once built."""

    def __init__(self, sargs: ServerArgs, resolved: str, children: list[_Child], heartbeat: Any, tm: Any) -> None:
        self.sargs = sargs
        self.crash_dump: Any = None  # the CrashDump of --crash-dump-folder: written when a child dies
        self.resolved = resolved
        self.children = children
        self.heartbeat = heartbeat
        self.tm = tm
        self.ctx: Any = None
        self.server: Any = None
        self.exit_code = 0
        self.stopping = False
        self.stalled = False  # the scheduler showed no progress for --scheduler-stall-timeout-s (logged once)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.drain_tasks: list[asyncio.Future] = []

    def healthy(self) -> bool:
        return not self.stopping and all(c.proc.is_alive() for c in self.children)

    def health_problem(self) -> Optional[str]:
        if self.ctx.draining or self.stopping:
            return "the server is shutting down"
        late = time.monotonic() - self.heartbeat.value
        limit = self.sargs.scheduler_stall_timeout_s
        if late > limit:
            return (
                f"the scheduler process has shown no progress for {late:.1f} s (--scheduler-stall-timeout-s {limit:g})"
            )
        return None

    def note_stall(self) -> None:
        """Log when the scheduler stops making progress (and /health turns 503) and when it resumes."""
        late = time.monotonic() - self.heartbeat.value
        stalled = late > self.sargs.scheduler_stall_timeout_s and not self.stopping
        if stalled != self.stalled:
            self.stalled = stalled
            if stalled:
                logger.warning("the scheduler process has shown no progress for %.1f s: /health answers 503", late)
            else:
                logger.warning("the scheduler process makes progress again: /health answers 200")

    async def watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            self.note_stall()
            dead = [c for c in self.children if not c.proc.is_alive()]
            if dead and not self.stopping:
                reason = ", ".join(
                    f"the {c.name} process (pid {c.proc.pid}) exited with code {c.proc.exitcode}" for c in dead
                )
                print(f"radixrt serve: {reason}; shutting down", file=sys.stderr, flush=True)
                if self.crash_dump is not None and (path := self.crash_dump.write(reason)) is not None:
                    print(f"radixrt serve: the requests of the last minutes are in {path}", file=sys.stderr, flush=True)
                self.stopping = True
                self.exit_code = 1
                self.tm.fail_all(reason)
                timer = threading.Timer(HARD_EXIT_AFTER_S, lambda: os._exit(1))
                timer.daemon = True
                timer.start()
                if self.server is not None:
                    self.server.should_exit = True
                return

    async def announce_ready(self) -> None:
        while self.server is not None and not self.server.started:
            await asyncio.sleep(0.05)
        print(
            f"radixrt server ready at http://{self.sargs.host}:{self.sargs.port} (model {self.resolved})",
            file=sys.stderr,
            flush=True,
        )

    async def drain(self, sig: int) -> None:
        """Refuse new requests, give those in flight the grace period, end the rest, then stop uvicorn."""
        ctx, tm = self.ctx, self.tm
        ctx.draining = True
        grace = self.sargs.shutdown_grace_s
        in_flight = len(tm.states)
        if in_flight or ctx.active_requests:
            print(
                f"radixrt serve: signal {sig}: draining {in_flight} request(s) in flight (up to {grace:g} s)",
                file=sys.stderr,
                flush=True,
            )
        deadline = time.monotonic() + grace
        while (tm.states or ctx.active_requests) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if tm.states:
            logger.warning(
                "%d request(s) still running after the %g s shutdown grace period: ending them", len(tm.states), grace
            )
            tm.fail_all(f"the server is shutting down (the {grace:g} s shutdown grace period ran out)")
        deadline = time.monotonic() + 2.0  # let the answers and the streams' last events go out
        while ctx.active_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.server.should_exit = True

    def stop_now(self) -> None:
        """A second signal: every request ends now, each with its error (a stream with its error
        event and ``[DONE]``), so that uvicorn stops without cancelling them mid-answer."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.tm.fail_all, "the server is stopping (a second signal)")

    def start_drain(self, sig: int) -> bool:
        """From uvicorn's signal handler: start `drain` on the server's loop;
        False when there is nothing to drain from (not serving yet, or already draining)."""
        if self.ctx.draining or self.loop is None:
            return False
        self.ctx.draining = True
        loop = self.loop
        loop.call_soon_threadsafe(lambda: self.drain_tasks.append(asyncio.ensure_future(self.drain(sig))))
        return True

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        self.loop = asyncio.get_running_loop()
        await self.tm.start()
        tasks = [asyncio.create_task(self.watchdog()), asyncio.create_task(self.announce_ready())]
        try:
            yield
        finally:
            self.stopping = True
            for t in tasks + self.drain_tasks:
                t.cancel()
            self.tm.fail_all("the server is stopping")
            self.tm.close()


def _draining_server(uconfig: Any, run: _Serving) -> Any:
    """uvicorn, whose first SIGTERM/SIGINT starts `_Serving.drain` instead of stopping at once."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.started:
                super().handle_exit(sig, frame)  # not serving yet: stop now
            elif not run.start_drain(sig):  # a second signal (or one after the drain): stop now
                run.stop_now()
                self.should_exit = True

    return DrainingServer(uconfig)


def _server_context(
    config: EngineConfig,
    sargs: ServerArgs,
    resolved: str,
    tokenizer: Any,
    addrs: Any,
    children: list[_Child],
    heartbeat: Any,
) -> _Serving:
    """A server whose children are ready, with its tokenizer manager and its routes' context."""
    from radixrt.requests.crash_dump import CrashDump
    from radixrt.requests.generation_defaults import generation_defaults
    from radixrt.requests.request_log import RequestLog
    from radixrt.server.http_server import ServerContext
    from radixrt.server.metrics import ServerMetrics
    from radixrt.server.tokenizer_manager import TokenizerManager

    info = children[0].info
    assert info is not None, "the scheduler process sends its RuntimeInfo when ready"
    model_path = config.model.model_path
    names = sargs.served_model_name or [os.path.basename(os.path.normpath(resolved))]
    served = names[0]
    # "default": SGLang's name for whatever it serves (its clients and examples send it)
    aliases = {*names, model_path, resolved, os.path.basename(os.path.normpath(resolved)), "default"}
    taken = aliases & set(parse_lora_paths(config.lora.lora_paths))
    if taken:  # `model: "<name>"` would mean the base model
        raise ValueError(f"--lora-paths names an adapter {sorted(taken)[0]!r}, a name of the served model")
    metrics = ServerMetrics(served)
    dump = CrashDump(sargs.crash_dump_folder) if sargs.crash_dump_folder else None
    log = RequestLog(tokenizer, config.debug.log_requests_level) if config.debug.log_requests else None
    tm = TokenizerManager(tokenizer, addrs, info, metrics, [o for o in (log, dump) if o], sargs.tokenizer_worker_num)
    run = _Serving(sargs, resolved, children, heartbeat, tm)
    run.crash_dump = dump
    model_defaults = generation_defaults(resolved) if sargs.sampling_defaults == "model" else {}
    run.tm.sampling_defaults = {**model_defaults, **(info.limits.preferred_sampling or {})}  # the flag's win
    public_args = {**config.to_flat(), **dataclasses.asdict(sargs)}
    public_args["api_key"] = "***" if sargs.api_key else None
    public_args["admin_api_key"] = "***" if sargs.admin_api_key else None
    if public_args.get("hicache_storage_url"):  # redis://user:password@host: the password is not for clients
        public_args["hicache_storage_url"] = without_password(public_args["hicache_storage_url"])
    run.ctx = ServerContext(
        tm=run.tm,
        metrics=metrics,
        model_path=model_path,
        resolved_model_path=resolved,
        served_model_name=served,
        other_served_names=[name for name in dict.fromkeys(names[1:]) if name != served],
        api_key=sargs.api_key,
        admin_api_key=sargs.admin_api_key,
        max_request_bytes=sargs.max_request_bytes,
        server_args=public_args,
        model_aliases=aliases,
        lora_adapters=set(parse_lora_paths(config.lora.lora_paths)),
        chat_info=_chat_template_info(tokenizer),
        healthy=run.healthy,
        health_problem=run.health_problem,
        process_ids={"server": os.getpid(), **{c.name: c.proc.pid for c in children}},
    )
    return run


def _serve(
    config: EngineConfig,
    sargs: ServerArgs,
    resolved: str,
    tokenizer: Any,
    addrs: Any,
    children: list[_Child],
    stop_signal: list[int],
    heartbeat: Any,
    listener: socket.socket,
) -> int:
    import uvicorn

    from radixrt.server.access_log import exclude_access_log_paths
    from radixrt.server.http_server import build_app
    from radixrt.server.slow_clients import timed_h11_protocol

    run = _server_context(config, sargs, resolved, tokenizer, addrs, children, heartbeat)
    heartbeat.value = time.monotonic()  # the scheduler is ready; its loop beats from now on
    app = build_app(run.ctx, lifespan=run.lifespan)
    level = (sargs.log_level_http or config.debug.log_level).lower()
    uconfig = uvicorn.Config(
        app,
        host=sargs.host,
        port=sargs.port,
        log_level=level if level in ("debug", "info") else "warning",
        access_log=level in ("debug", "info"),
        timeout_graceful_shutdown=sargs.timeout_graceful_shutdown,
        lifespan="on",
        timeout_keep_alive=30,
        http=timed_h11_protocol(sargs.header_read_timeout_s, sargs.body_read_timeout_s),
    )
    exclude_access_log_paths(sargs.uvicorn_access_log_exclude_prefixes)
    run.server = _draining_server(uconfig, run)
    # What start-up loaded (torch, transformers, the tokenizer) lives as long as the process:
    # out of the cyclic GC's sight, a full collection (which allocation-heavy requests, e.g.
    # parsing a large JSON body in a worker thread, trigger while holding the GIL) costs a
    # fraction of what it would otherwise (figures: docs/benchmarks.md, "Server process").
    gc.collect()
    gc.freeze()
    run.server.run(sockets=[listener])
    if not run.server.started and run.exit_code == 0 and not stop_signal:
        return 1  # could not bind the port, or startup failed
    return run.exit_code
