"""SGLang's load probes, for routers and gateways that poll a worker's load: ``GET /v1/loads``
(SGLang's current one: one entry per data-parallel rank, its core figures; ``format=prometheus``
gives them as gauges) and ``GET /get_load`` (its earlier one: requests and tokens per rank).
A radixrt server is one rank (``--dp`` puts a router in front of several servers)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import bad_request
from radixrt.server.http_utils import JSON, query_int
from radixrt.version import __version__

router = APIRouter()

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})  # SGLang's names


def _core(stats: dict[str, Any], ctx: ServerContext) -> dict[str, Any]:
    """SGLang's core load figures of this server (data-parallel rank 0) from the scheduler's stats.
    As SGLang counts them: KV tokens in use leave out cache no request holds (eviction frees it
    for whoever comes), and the total adds the waiting requests' prompts."""
    kv = stats.get("kv", {})
    total = int(kv.get("total_slots") or ctx.tm.kv_total_slots)
    used = total - int(kv.get("free_slots", total)) - int(kv.get("evictable_slots", 0))
    return {
        "dp_rank": 0,
        "num_running_reqs": int(stats.get("running", 0)),
        "num_waiting_reqs": int(stats.get("waiting", 0)),
        "num_used_tokens": used,
        "num_total_tokens": used + int(stats.get("waiting_tokens", 0)),
        "max_total_num_tokens": total,
        "max_running_requests": ctx.server_args.get("max_running_requests"),
        "token_usage": round(used / total, 6) if total else 0.0,
        "gen_throughput": float(stats.get("last_gen_throughput", 0.0)),
        "cache_hit_rate": float(stats.get("cache", {}).get("hit_rate", 0.0)),
    }


@router.get("/v1/loads")
async def loads(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """``dp_rank`` (only that rank: 0 here), ``include`` (SGLang's sections; this server reports the
    core figures), ``format`` (``json`` or ``prometheus``)."""
    dp_rank = query_int(request, "dp_rank", 0, 0, 1 << 20) if "dp_rank" in request.query_params else None
    include = [s.strip() for s in request.query_params.get("include", "").split(",") if s.strip()]
    unknown = sorted(set(include) - SECTIONS)
    if unknown:
        raise bad_request(f"unknown 'include' sections {unknown}; choose from {sorted(SECTIONS)}.", "include")
    fmt = request.query_params.get("format", "json")
    if fmt not in ("json", "prometheus"):
        raise bad_request("'format' must be 'json' or 'prometheus'.", "format")
    rows = [] if dp_rank not in (None, 0) else [_core(await ctx.tm.get_stats(), ctx)]
    if fmt == "prometheus":
        lines = []
        for key in rows[0] if rows else ():
            if key != "dp_rank" and isinstance(rows[0][key], (int, float)):
                lines += [f"# TYPE sglang_{key} gauge", f'sglang_{key}{{dp_rank="0"}} {rows[0][key]}']
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")
    cuda = str(ctx.server_args.get("device") or "").startswith("cuda")
    return JSON(
        {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": __version__,
            "accelerator": "cuda" if cuda else "cpu",
            "num_accelerators": int(ctx.server_args.get("tp_size") or 1) if cuda else 0,
            "loads": rows,
        }
    )


@router.get("/get_load")
async def get_load(ctx: ServerContext = Depends(server_context)) -> Response:
    """SGLang's earlier probe: per rank, requests in the system, those waiting, and KV tokens in use
    or asked for by waiting prompts."""
    core = _core(await ctx.tm.get_stats(), ctx)
    return JSON(
        [
            {
                "dp_rank": 0,
                "num_reqs": core["num_running_reqs"] + core["num_waiting_reqs"],
                "num_waiting_reqs": core["num_waiting_reqs"],
                "num_tokens": core["num_total_tokens"],
            }
        ]
    )
