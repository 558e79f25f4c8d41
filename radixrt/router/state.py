"""What the router's routes share (`RouterState`), its settings (`RouterConfig`), and the
OpenAI-shaped errors it answers with."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Optional

import httpx
from fastapi import Request
from starlette.responses import JSONResponse

from radixrt.router.kv_routing import KVEventRouting
from radixrt.router.workers import WorkerPool
from radixrt.server.api_keys import presented_key, same_key

FORWARD_HEADERS = ("authorization", "x-api-key", "content-type", "accept")
# the routers a request has passed through (their instance ids, comma-separated): a request that
# comes back to a router it passed (a router added as its own worker, two routers added as each
# other's) is refused with a 508 instead of going round until a timeout
VIA_HEADER = "x-radixrt-router-via"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    502: "bad_gateway",
    503: "service_unavailable",
    508: "loop_detected",
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
    # accepted wherever api_key is, as a single server does, and needed to change the workers
    # (/add_worker, /remove_worker); None: nobody may. Routes proxied to workers: the workers,
    # which get the forwarded header, decide what it may do there.
    admin_api_key: Optional[str] = None
    request_timeout_s: float = 1800.0
    require_all_healthy: bool = False  # /health: every worker (a --dp server) or any (standalone)
    eviction_interval_s: Optional[float] = None
    max_request_bytes: int = 32 * 1024 * 1024  # a larger request body is a 413, read no further
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))  # in VIA_HEADER


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
        """The headers a request to a worker carries: the client's key and content headers, and
        the routers it passed, this one last."""
        out = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        out[VIA_HEADER] = ",".join([*passed_routers(request.headers.get(VIA_HEADER)), self.config.instance_id])
        return out

    def is_admin(self, request: Request) -> bool:
        """Whether ``request`` presents the admin key (never, when none is set)."""
        admin = self.config.admin_api_key
        given = presented_key(request.scope.get("headers", []))
        return bool(admin) and given is not None and same_key(given, admin or "")

    def came_back(self, request: Request) -> bool:
        """Whether ``request`` already passed this router (a loop)."""
        return self.config.instance_id in passed_routers(request.headers.get(VIA_HEADER))

    def authorized(self, request: Request) -> bool:
        if not self.config.api_key:
            return True
        given = presented_key(request.scope.get("headers", []))
        keys = [k for k in (self.config.api_key, self.config.admin_api_key) if k]
        return given is not None and any(same_key(given, k) for k in keys)


def passed_routers(via: Optional[str]) -> list[str]:
    """The router ids in a `VIA_HEADER` value (at most 16 kept: a longer chain is no route)."""
    return [v.strip() for v in (via or "").split(",") if v.strip()][-16:]
