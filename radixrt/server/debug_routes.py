"""The live view of the cache: ``GET /debug/radix`` (a snapshot), ``GET /debug/stream``
(server-sent events of the pool and cache counters), ``GET /debug/events`` (the KV
events of ``--kv-events-config``, relayed from the scheduler's ZMQ publisher) and
``GET /dashboard`` (the page that shows the first two, radixrt/server/static/dashboard.html).

Access: with an admin key set (``--admin-api-key``) the data routes need it
(403 otherwise); without one they need what every route needs (the API key,
when set). The page itself is served to anyone (it holds no data): the
operator types the key into it, and it sends the key with every request.

Decoded text (``text=true``) is off by default and is given only to the
admin key's holder (a server with no key shows none: whoever reaches its port
is a client, as for ``return_cache_info: "full"``): a client never reads
another's text, and namespaces are shown by a digest of their salt, never the
salt (radixrt/memory/radix_snapshot.py).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from importlib import resources
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from starlette.responses import HTMLResponse, Response, StreamingResponse

from radixrt.config.kv_events import parse_kv_events_config
from radixrt.memory.kv_events import as_json, decode_batch
from radixrt.requests.messages import RadixSnapshotReq
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import ServerError, bad_request
from radixrt.server.http_utils import JSON, query_int, sse

router = APIRouter()

MAX_DEPTH = 64
MAX_NODES = 100_000
SNIPPET_TOKENS = 24  # tokens of each node decoded for its label
RATES = (1, 10)  # updates per second the stream allows
MAX_STREAM_SECONDS = 3600  # a stream ends after at most this long (the page reconnects)
DEFAULT_STREAM_SECONDS = 600
MAX_OPEN_STREAMS = 8  # debug streams open at once, all clients together (a 503 past it)
_open_streams = [0]


def _stream_bounds(request: Request) -> tuple[int, float]:
    """``limit`` (events before the end, 0: none) and ``seconds`` (how long at most) of a stream."""
    limit = query_int(request, "limit", 0, 0, 1_000_000)
    seconds = query_int(request, "seconds", DEFAULT_STREAM_SECONDS, 1, MAX_STREAM_SECONDS)
    return limit, time.monotonic() + seconds


def _reserve_stream() -> Callable[[], None]:
    """Take one of the MAX_OPEN_STREAMS slots now, in the route (a 503 when none is left), so
    that streams opened at the same moment cannot all pass the check; returns its release
    (idempotent)."""
    if _open_streams[0] >= MAX_OPEN_STREAMS:
        raise ServerError(503, f"{MAX_OPEN_STREAMS} debug streams are open already; close one first.")
    _open_streams[0] += 1
    held = [True]

    def release() -> None:
        if held[0]:
            held[0] = False
            _open_streams[0] -= 1

    return release


def _event_stream(body: AsyncIterator[bytes], release: Callable[[], None]) -> StreamingResponse:
    """An SSE response of ``body``, holding its slot (`_reserve_stream`) until it ends."""

    async def counted() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            release()

    stream = counted()
    weakref.finalize(stream, release)  # a stream whose body never started (its client left first)
    return StreamingResponse(
        stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _check_access(request: Request, ctx: ServerContext) -> None:
    if ctx.admin_api_key:
        ctx.require_admin(request, "the cache's debug view")


def _text_allowed(request: Request, ctx: ServerContext, name: str = "text") -> bool:
    """Whether ``name=true`` (decoded text, or token ids: text all the same) was asked for
    and may be given: to the admin key's holder only."""
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise bad_request(f"'{name}' must be true or false.", name)
    if raw in ("false", "0"):
        return False
    ctx.require_admin(request, f"'{name}'", name)
    return True


@router.get("/debug/radix")
async def debug_radix(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """A snapshot of the radix tree (``max_depth``, ``max_nodes``; ``text=true`` decodes
    each node's first tokens), the KV pool by state and the requests with their paths."""
    _check_access(request, ctx)
    text = _text_allowed(request, ctx)
    msg = RadixSnapshotReq(
        max_depth=query_int(request, "max_depth", 8, 1, MAX_DEPTH),
        max_nodes=query_int(request, "max_nodes", 500, 1, MAX_NODES),
        tokens_per_node=SNIPPET_TOKENS if text else 0,
    )
    view = await ctx.snapshot_gate.run(lambda: ctx.tm.radix_view(msg))
    if text:
        decode = ctx.tm.tokenizer.decode
        for node in view["nodes"]:
            node["text"] = decode(node.pop("token_ids"))
    return JSON(view)


def _stream_point(stats: dict[str, Any]) -> dict[str, Any]:
    cache = stats.get("cache", {})
    return {
        "t": time.time(),
        "kv": stats.get("kv", {}),
        "host_kv": stats.get("host_kv"),
        "hit_rate": cache.get("hit_rate", 0.0),
        "hit_tokens": cache.get("hit_tokens", 0),
        "queried_tokens": cache.get("queried_tokens", 0),
        "evicted_tokens": cache.get("evicted_tokens", 0),
        "running": stats.get("running", 0),
        "waiting": stats.get("waiting", 0),
        "retractions": stats.get("retractions", 0),
        "generated_tokens": stats.get("generated_tokens", 0),
        "steps": stats.get("steps", 0),
    }


@router.get("/debug/stream")
async def debug_stream(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """Server-sent events: the pool by state, hit and evicted tokens, running and
    waiting requests and retractions, ``rate`` times a second (1-10)."""
    _check_access(request, ctx)
    rate = query_int(request, "rate", 2, *RATES)
    limit, until = _stream_bounds(request)
    release = _reserve_stream()

    async def events() -> AsyncIterator[bytes]:
        sent = 0
        while not ctx.draining and (not limit or sent < limit) and time.monotonic() < until:
            started = time.monotonic()
            try:
                yield sse(_stream_point(await ctx.tm.get_stats(timeout=5.0)))
            except ServerError as e:
                yield sse({"error": e.message})
            sent += 1
            await asyncio.sleep(max(0.0, 1.0 / rate - (time.monotonic() - started)))

    return _event_stream(events(), release)


@router.get("/debug/events")
async def debug_events(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """Server-sent events: the KV events the scheduler publishes (``--kv-events-config``),
    one JSON batch per event, each event with its ``type`` (BlockStored, BlockRemoved,
    AllBlocksCleared); ``token_ids`` only with ``tokens=true`` (admin)."""
    _check_access(request, ctx)
    with_tokens = _text_allowed(request, ctx, "tokens")
    cfg = parse_kv_events_config(ctx.server_args.get("kv_events_config"))
    if cfg is None or not cfg.publishes:
        raise ServerError(404, "KV events are off: start the server with --kv-events-config (publisher zmq).")
    limit, until = _stream_bounds(request)
    import zmq
    import zmq.asyncio

    release = _reserve_stream()
    try:
        socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        socket.connect(cfg.connect_endpoint)
    except BaseException:
        release()
        raise

    async def events() -> AsyncIterator[bytes]:
        sent = 0
        try:
            yield b": subscribed\n\n"  # the stream is open: events that happen from now on follow
            while not ctx.draining and (not limit or sent < limit) and time.monotonic() < until:
                if not await socket.poll(timeout=1000):
                    continue
                _, seq, payload = await socket.recv_multipart()
                yield sse({"seq": int.from_bytes(seq, "big"), **as_json(decode_batch(payload), with_tokens)})
                sent += 1
        finally:
            socket.close(linger=0)

    return _event_stream(events(), release)


@router.get("/dashboard")
async def dashboard(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """The live view: one self-contained page (no CDN: it works offline); its data needs the key."""
    page = resources.files("radixrt.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    return HTMLResponse(page)
