"""Admin routes: health, model and server info, cache flush, abort,
Prometheus metrics, the KV debug view and the profiler."""

from __future__ import annotations

import asyncio
import math
import time

from fastapi import APIRouter, Depends, Request
from starlette.responses import PlainTextResponse, Response

from radixrt.requests.intake import RequestSpec
from radixrt.requests.messages import ProfileReq
from radixrt.requests.profile_fields import profile_request
from radixrt.requests.runtime_info import internal_state
from radixrt.sampling.params import SamplingParams
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import ServerError, as_bad_request, bad_request
from radixrt.server.http_utils import JSON, error_response, raise_state_errors, read_json, wait_group
from radixrt.server.metrics import CONTENT_TYPE_LATEST
from radixrt.version import __version__

router = APIRouter()

HEALTH_GENERATE_TIMEOUT_S = 30
FLUSH_TIMEOUT_MAX_S = 600  # the longest /flush_cache?timeout= waits for the server to be idle
FLUSH_RETRY_S = 0.05  # how often it tries again meanwhile


@router.get("/health")
@router.get("/ping")
async def health(ctx: ServerContext = Depends(server_context)) -> Response:
    """200 (empty) while every server process is up, the scheduler's heartbeat
    is on time and the server is not shutting down; else 503 with the reason.
    ``/ping`` is SageMaker's name for it (a paused server is healthy)."""
    reason = ctx.tm.dead_reason or ctx.health_problem()
    if reason is None and not ctx.healthy():
        reason = "a server process is down"
    if reason is None:
        return Response(status_code=200)
    return error_response(503, f"unhealthy: {reason}")


@router.get("/health_generate")
async def health_generate(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """200 (empty) once a one-token generation finished, 503 if it did not in 30 s. The probe is
    not counted in the request, token and latency metrics (as in SGLang)."""
    tm = ctx.tm
    tm.check_alive()
    spec = RequestSpec(
        input_ids=[tm.tokenizer.eos_token_id or 0],
        sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        log_metrics=False,
    )
    group = tm.submit([spec])
    try:
        await asyncio.wait_for(wait_group(request, tm, group), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        tm.abort_group(group, "health check timed out")
        return error_response(503, "unhealthy: a one-token generation did not finish in 30 s")
    raise_state_errors(group)
    return Response(status_code=200)


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(ctx: ServerContext = Depends(server_context)) -> Response:
    return JSON(ctx.model_info())


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(ctx: ServerContext = Depends(server_context)) -> Response:
    """Server arguments (resolved, as SGLang's ``resolved_dict``), model info, KV size and the
    scheduler's live stats (with SGLang's figures that its benchmarks read: `internal_state`)."""
    stats = await ctx.tm.get_stats()
    return JSON(
        {
            **ctx.server_args,
            **ctx.tm.info.settings,  # what the model requires in place of the configured (model_fit.py)
            # what the command line left to the server, as it resolved them
            "model_path": ctx.weights_path or ctx.resolved_model_path,
            "tokenizer_path": ctx.server_args.get("tokenizer_path") or ctx.resolved_model_path,
            "context_length": ctx.tm.context_length,
            "served_model_name": ctx.served_model_name,  # the name answered, the folder's where none was given
            "version": __version__,
            "model_info": ctx.model_info(),
            "max_total_num_tokens": ctx.tm.kv_total_slots,
            "kv_cache": ctx.tm.info.kv_cache,  # bytes per token and capacity (radixrt/memory/kv_format.py)
            "kv_slots": stats.get("kv", {}),
            "host_kv_cache": stats.get("host_kv"),  # the host tier (--enable-hierarchical-cache), or None
            "storage_kv_cache": stats.get("storage_kv"),  # the storage tier (--hicache-storage-backend), or None
            "internal_states": [
                internal_state(stats, ctx.tm.kv_total_slots, ctx.server_args.get("max_running_requests"))
            ],
            "process_ids": ctx.process_ids,
            "uptime_s": round(time.time() - ctx.started, 3),
        }
    )


@router.get("/debug/kv")
async def debug_kv(ctx: ServerContext = Depends(server_context)) -> Response:
    """KV slots (free, tree, private, total), running/waiting counts, requests in flight."""
    stats = await ctx.tm.get_stats()
    return JSON(
        {
            "kv_slots": stats.get("kv", {}),
            "running": stats.get("running"),
            "waiting": stats.get("waiting"),
            "inflight": len(ctx.tm.states),
        }
    )


@router.get("/metrics")
async def metrics(ctx: ServerContext = Depends(server_context)) -> Response:
    """Prometheus text; refreshed from the scheduler's stats when it answers within 3 s."""
    try:
        await ctx.tm.get_stats(timeout=3.0)
    except ServerError:
        pass  # still serve what the server itself measured
    ctx.metrics.set_kv_cache(ctx.tm.info.kv_cache)
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _flush_timeout(request: Request) -> float:
    """The ``timeout`` query parameter of /flush_cache in seconds (0 without one); ServerError 400
    unless it is a number from 0 to `FLUSH_TIMEOUT_MAX_S`."""
    raw = request.query_params.get("timeout")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value <= FLUSH_TIMEOUT_MAX_S:  # NaN fails too
        raise bad_request(f"'timeout' must be a number of seconds from 0 to {FLUSH_TIMEOUT_MAX_S}.", "timeout")
    return value


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """200 when the prefix cache was dropped; 400 while requests are running. ``?timeout=N``
    (SGLang's): wait up to N seconds (at most `FLUSH_TIMEOUT_MAX_S`) for the server to be idle,
    trying again every `FLUSH_RETRY_S`, before answering 400. With ``--admin-api-key``, only that
    key may drop every client's cache (403), as in SGLang."""
    if ctx.admin_api_key:
        ctx.require_admin(request, "flushing the cache (every client's)")
    deadline = time.monotonic() + _flush_timeout(request)
    while not await ctx.tm.flush_cache():
        if time.monotonic() >= deadline:
            return PlainTextResponse("Cache not flushed: requests are running; try again when idle.\n", status_code=400)
        await asyncio.sleep(min(FLUSH_RETRY_S, max(0.0, deadline - time.monotonic())))
    return PlainTextResponse("Cache flushed.\n")


@router.post("/abort_request")
async def abort_request(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """Body ``{"rid": str}`` or ``{"abort_all": true}`` (any ``rid``, null included); 200 (empty)
    once sent to the scheduler. An empty or null ``rid`` without ``abort_all`` aborts nothing and is
    a 200 too, as in SGLang. With ``--admin-api-key`` either needs that key (403), as in SGLang: a
    client's rid is no secret from the others (clients end their own requests by disconnecting)."""
    if ctx.admin_api_key:
        ctx.require_admin(request, "aborting requests (any client's)")
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
    if not isinstance(rid, str):
        raise bad_request("'rid' must be a string or null.", "rid")
    if not isinstance(abort_all, bool):
        raise bad_request("'abort_all' must be a boolean.", "abort_all")
    ctx.tm.check_alive()
    if abort_all:
        ctx.tm.abort_rid("")
    elif rid:
        ctx.tm.abort_rid(rid)
    return Response(status_code=200)


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """SGLang's: the torch profiler over the scheduler's steps until ``/stop_profile`` or
    ``num_steps`` (radixrt/scheduler/profiler.py; the body's fields: requests/profile_fields.py).
    With ``--admin-api-key`` it needs that key (it writes files on the server)."""
    if ctx.admin_api_key:
        ctx.require_admin(request, "profiling (a trace written on the server)")
    body = await read_json(request) if await request.body() else {}
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    with as_bad_request():
        msg = profile_request(body)
    return await _profile(ctx, msg, "Start profiling")


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """End the profile and write its trace (400 when none runs)."""
    if ctx.admin_api_key:
        ctx.require_admin(request, "profiling (a trace written on the server)")
    return await _profile(ctx, ProfileReq("stop"), "Stop profiling")


async def _profile(ctx: ServerContext, msg: ProfileReq, done: str) -> Response:
    reply = await ctx.tm.control(msg, "profile", timeout=600.0)
    if not reply.ok:
        raise bad_request(reply.payload["message"])
    return PlainTextResponse(f"{done}. The trace: {reply.payload['path']}\n")
