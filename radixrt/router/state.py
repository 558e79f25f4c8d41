"""What the router's routes share (`RouterState`), its settings (`RouterConfig`), and the
OpenAI-shaped errors it answers with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import httpx
from fastapi import Request
from starlette.responses import JSONResponse

from radixrt.router.kv_routing import KVEventRouting
from radixrt.router.workers import WorkerPool
from radixrt.server.api_keys import presented_key, same_key

FORWARD_HEADERS = ("authorization", "x-api-key", "content-type", "accept")
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    502: "bad_gateway",
    503: "service_unavailable",
}


def error_body(status: int, message: str) -> dict:
    """The OpenAI-shaped error body radixrt's servers use."""
    return {
        "error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": None, "code": status}
    }


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


@dataclass
class RouterConfig:
    api_key: Optional[str] = None
    # a --dp front's: accepted wherever api_key is, as a single server does; the replicas
    # (which get the same key and the forwarded header) decide what it may do beyond that
    admin_api_key: Optional[str] = None
    request_timeout_s: float = 1800.0
    require_all_healthy: bool = False  # /health: every worker (a --dp server) or any (standalone)
    eviction_interval_s: Optional[float] = None


class RouterState:
    """What the routes share: the pool, an HTTP client, draining and counters."""

    def __init__(self, pool: WorkerPool, config: RouterConfig, kv_events: Optional[KVEventRouting] = None) -> None:
        self.pool = pool
        self.config = config
        self.kv_events = kv_events
        self.client: Optional[httpx.AsyncClient] = None
        self.draining = False
        self.active = 0  # requests the front is answering
        self.failovers = 0

    def headers(self, request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}

    def authorized(self, request: Request) -> bool:
        if not self.config.api_key:
            return True
        given = presented_key(request.scope.get("headers", []))
        keys = [k for k in (self.config.api_key, self.config.admin_api_key) if k]
        return given is not None and any(same_key(given, k) for k in keys)
