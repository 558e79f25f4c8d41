"""The router's HTTP front: a FastAPI app that proxies radixrt's (and
SGLang's) native and OpenAI routes to its workers.

* ``POST /generate``, ``/v1/completions``, ``/v1/chat/completions``: routed
  by the policy on the prompt (`keys.routing_key`); answers and streams are
  passed through as the worker sends them.
* ``/abort_request``: sent to every healthy worker (it matches rids, which only
  the worker running it knows).
* ``/flush_cache``, ``/load_lora_adapter``, ``/unload_lora_adapter``, ``/update_weights_from_disk``,
  ``/update_weight_version``, ``/pause_generation``, ``/continue_generation``,
  ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/start_profile``,
  ``/stop_profile``: sent to every healthy worker, so that any of them serves the adapter (the
  weights; pauses). When all answer alike (done, or refused for one reason) that answer is passed
  on; otherwise a 502 (some applied it) or 400 names each worker's failure, a worker out of
  routing among them (it did not get the change). A worker added later loads only its own
  ``--lora-paths``.
* ``GET /get_server_info`` (``/server_info``): every worker's info under
  ``workers``, their ``internal_states`` concatenated, the router's own under
  ``router``; the first healthy worker's fields at the top level (but the router's own ``host``
  and ``port``, and under ``--dp`` SGLang's ``dp_size``).
* ``GET /get_load``, ``GET /v1/loads``: every worker's entry, numbered by its rank (`loads.py`).
* ``GET /health``: 200 while a worker is healthy (every worker with
  ``require_all_healthy``, as in ``radixrt serve --dp``) and the router is not
  draining; else 503.
* ``GET /list_workers``; ``POST /add_worker?url=`` and ``POST /remove_worker?url=``
  need the admin key (they decide where clients' requests and keys go); a url
  that reaches the router itself is refused.
* ``/init_weights_update_group``, ``/update_weights_from_distributed``,
  ``/destroy_weights_update_group``: a 400 (each worker joins a group with its own rank:
  send them to the workers themselves).
* Any other path: proxied to the least loaded worker.

Failover: a request whose worker cannot be reached (connect error, or the
connection closed before any answer) or answers 503 goes to another healthy
worker (each worker tried once); an unreachable worker leaves routing at
once. A stream whose worker fails after the answer started cannot move: it
ends with an error event and ``data: [DONE]``. A client that leaves before
its answer starts has its request to the worker cancelled (the worker aborts
it); one that leaves mid-answer closes the worker's stream the same way.

Auth: with an API key, every route but ``/health`` needs ``Authorization:
Bearer KEY`` (or ``x-api-key``); the client's header is passed to the
workers, so they may share the key. What every request passes first (loops,
keys, the body size limit) is `guard.RouterGuard`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Optional

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixrt.router.broadcast import add_broadcast_routes, add_profile_routes
from radixrt.router.dp_rank import RANK_HEADER, RANKED_PATHS, rank_of
from radixrt.router.guard import RouterGuard
from radixrt.router.keys import routing_key
from radixrt.router.kv_routing import KVEventRouting
from radixrt.router.loads import add_load_routes
from radixrt.router.sessions import SESSION_PATHS, session_of, session_worker
from radixrt.router.state import VIA_HEADER, RouterConfig, RouterState, error_body, error_response
from radixrt.router.workers import NoWorkerError, Worker, WorkerPool, normalize_url

logger = logging.getLogger("radixrt.router")

ROUTED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
SSE_DONE = b"data: [DONE]\n\n"
PARSE_ON_LOOP_BYTES = 64 * 1024  # larger bodies are parsed in a thread


async def _send(
    state: RouterState, w: Worker, method: str, path: str, headers: dict, body: bytes, params: Any
) -> httpx.Response:
    assert state.client is not None
    req = state.client.build_request(
        method,
        w.url + path,
        headers=headers,
        content=body,
        params=params,
        timeout=httpx.Timeout(state.config.request_timeout_s, connect=5.0),
    )
    return await state.client.send(req, stream=True)


async def _parse(body: bytes) -> Any:
    """The JSON body, or None where it is malformed (the worker answers that with its own 400);
    a large one is parsed off the event loop, so other clients' requests do not wait for it."""
    try:
        if len(body) <= PARSE_ON_LOOP_BYTES:
            return json.loads(body)
        return await asyncio.to_thread(json.loads, body)
    except (ValueError, RecursionError):
        return None


async def _client_left(request: Request) -> None:
    """Return when the client closes its connection (its body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _send_while_client_waits(request: Request, send: Awaitable[httpx.Response]) -> Optional[httpx.Response]:
    """The worker's answer, or None when the client leaves first: the request to the worker is
    then cancelled, which closes its connection, and the worker aborts it as it does for any
    client that leaves (a non-streaming answer starts only when it is complete)."""
    answer = asyncio.ensure_future(send)
    left = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait((answer, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not answer.done():
            answer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await answer
    return answer.result() if not answer.cancelled() else None


async def proxy(state: RouterState, request: Request, path: str, key_from_body: bool) -> Response:
    """Route one request and pass its answer (or stream) back; fail over while nothing was answered."""
    body = await request.body()
    key = tokens = pinned = None
    if key_from_body or path in SESSION_PATHS or path in RANKED_PATHS:
        parsed = await _parse(body) if body.strip() else None
        session, body = session_of(path, parsed, body)
        try:
            rank, ranked_body = rank_of(path, parsed, request.headers.get(RANK_HEADER))
        except ValueError as e:
            return error_response(400, str(e))
        if session is not None:  # its worker holds its turns
            pinned = session_worker(list(state.pool.workers), session)
        elif rank is not None:  # SGLang's routed_dp_rank: the worker of that rank, in the router's order
            workers = list(state.pool.workers)
            if not 0 <= rank < len(workers):
                return error_response(400, f"data-parallel rank {rank} names no worker of this router's {len(workers)}")
            pinned, body = workers[rank], ranked_body or body
        elif key_from_body:
            key = routing_key(path, parsed)
            tokens = await state.kv_events.key(path, parsed) if state.kv_events is not None else None
    headers = state.headers(request)
    tried: list[str] = []
    last_error = "no healthy worker is available"
    while True:
        try:
            w = _pinned(state, pinned, tried) if pinned is not None else state.pool.pick(key, tuple(tried), tokens)
        except NoWorkerError as e:
            return error_response(503, f"{e}: {last_error}" if tried else str(e))
        tried.append(w.url)
        w.load += 1
        try:
            resp = await _send_while_client_waits(
                request, _send(state, w, request.method, path, headers, body, request.query_params)
            )
        except (
            httpx.ConnectError,
            httpx.ConnectTimeout,
            httpx.RemoteProtocolError,
            httpx.ReadError,
            httpx.WriteError,
        ) as e:
            w.load -= 1
            last_error = f"worker {w.url}: {type(e).__name__}: {e}"
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                state.pool.set_healthy(w.url, False, last_error)
            else:  # closed without an answer: a dead worker, or only a stale keep-alive connection
                state.pool.probe(w.url)
            state.failovers += 1
            logger.warning("failing over: %s", last_error)
            continue
        except httpx.HTTPError as e:
            w.load -= 1
            return error_response(502, f"worker {w.url} failed: {type(e).__name__}: {e}")
        except BaseException:
            w.load -= 1
            raise
        if resp is None:
            w.load -= 1
            logger.info("%s %r: the client left before the worker answered; cancelled there", request.method, path)
            return Response(status_code=499)
        if resp.status_code == 503 and len(tried) < len(state.pool.workers):
            last_error = f"worker {w.url} answered 503"
            await resp.aclose()
            w.load -= 1
            state.failovers += 1
            continue
        return _pass_through(state, w, resp)


def _pinned(state: RouterState, url: str, tried: list[str]) -> Worker:
    """The one worker a request must go to (a session's, router/sessions.py; a DP rank's,
    router/dp_rank.py); NoWorkerError when it is down or failed already (no failover)."""
    w = state.pool.workers[url]
    if tried or not w.healthy:
        raise NoWorkerError(f"the worker this request must go to ({url}) is not available; it does not fail over")
    w.routed += 1
    return w


def _pass_through(state: RouterState, w: Worker, resp: httpx.Response) -> Response:
    media = resp.headers.get("content-type", "application/json")
    out_headers = {"x-radixrt-worker": w.url}

    async def body_iter() -> AsyncIterator[bytes]:
        streaming = media.startswith("text/event-stream")
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            msg = f"worker {w.url} failed mid-answer: {type(e).__name__}: {e}"
            logger.warning("%s", msg)
            if streaming:
                yield b"\n\ndata: " + json.dumps(error_body(502, msg)).encode() + b"\n\n" + SSE_DONE
            else:
                raise
        finally:
            w.load -= 1
            await resp.aclose()

    return StreamingResponse(body_iter(), status_code=resp.status_code, media_type=media, headers=out_headers)


def build_router_app(
    pool: WorkerPool, config: RouterConfig, lifespan: Any = None, kv_events: Optional[KVEventRouting] = None
) -> FastAPI:
    """The router's app over ``pool``; ``lifespan`` (an async context manager
    factory) runs inside the router's own (HTTP client, worker health checks,
    the ``kv_events`` subscriber, whose index ``pool``'s policy should read)."""
    state = RouterState(pool, config, kv_events)
    app = FastAPI(
        title="radixrt router",
        lifespan=_router_lifespan(state, lifespan),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.router = state
    app.add_middleware(RouterGuard, state=state)
    _add_worker_routes(app, state)
    add_broadcast_routes(app, state)
    add_profile_routes(app, state)
    add_load_routes(app, state)
    _add_server_info_routes(app, state)
    _add_proxied_routes(app, state)  # last: its catch-all route takes every other path
    return app


def _router_lifespan(state: RouterState, inner: Any) -> Any:
    """The app's lifespan: the HTTP client and the pool's health checks around ``inner``'s."""

    @contextlib.asynccontextmanager
    async def router_lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
        state.client = httpx.AsyncClient(limits=limits)
        await state.pool.start(state.config.eviction_interval_s, headers={VIA_HEADER: state.config.instance_id})
        if state.kv_events is not None:
            await asyncio.to_thread(state.kv_events.start)
        try:
            if inner is not None:
                async with inner(app):
                    yield
            else:
                yield
        finally:
            if state.kv_events is not None:
                state.kv_events.stop()
            await state.pool.stop()
            await state.client.aclose()

    return router_lifespan


def _health_problem(state: RouterState) -> Optional[str]:
    """Why ``/health`` answers 503 (draining, or `WorkerPool.health_problem`), or None."""
    if state.draining:
        return "the server is shutting down"
    return state.pool.health_problem(state.config.require_all_healthy)


def _router_view(state: RouterState) -> dict[str, Any]:
    pool = state.pool
    return {
        "policy": pool.policy.name,
        "workers": pool.public(),
        "policy_stats": pool.policy.stats(),
        "failovers": state.failovers,
    }


def _add_worker_routes(app: FastAPI, state: RouterState) -> None:
    """/health, /list_workers, /add_worker, /remove_worker."""
    pool = state.pool

    @app.get("/health")
    async def health() -> Response:
        problem = _health_problem(state)
        if problem:
            return error_response(503, f"unhealthy: {problem}")
        return Response(status_code=200)

    @app.get("/list_workers")
    async def list_workers() -> Response:
        return JSONResponse(_router_view(state))

    @app.post("/add_worker")
    async def add_worker(request: Request, url: str) -> Response:
        refusal = _needs_admin(state, request, "adding a worker")
        if refusal is not None:
            return refusal
        try:
            url = normalize_url(url)
        except ValueError as e:
            return error_response(400, str(e))
        if await _reaches_this_router(state, url):
            return error_response(400, f"{url!r} reaches this router itself: a worker must be a server.")
        pool.add(url)
        if state.kv_events is not None:  # with --kv-events-port: its events too
            state.kv_events.add_worker(url)
        await pool.check_once()
        return JSONResponse({"workers": pool.public()})

    @app.post("/remove_worker")
    async def remove_worker(request: Request, url: str) -> Response:
        refusal = _needs_admin(state, request, "removing a worker")
        if refusal is not None:
            return refusal
        try:
            removed = pool.remove(url)
        except ValueError as e:
            return error_response(400, str(e))
        if not removed:
            return error_response(404, f"no worker {url!r}")
        if state.kv_events is not None:
            state.kv_events.remove_worker(url)
        return JSONResponse({"workers": pool.public()})


def _needs_admin(state: RouterState, request: Request, what: str) -> Optional[Response]:
    """A 403 unless ``request`` presents the admin key: who may change where the router sends
    clients' requests (and their keys) is the operator's decision."""
    if state.is_admin(request):
        return None
    hint = "" if state.config.admin_api_key else " (this router has none: --admin-api-key)"
    return error_response(403, f"{what.capitalize()} needs the router's admin key{hint}.")


async def _reaches_this_router(state: RouterState, url: str) -> bool:
    """Whether ``url``'s /health answers as a loop back to this router (the router's own address)."""
    assert state.client is not None
    try:
        r = await state.client.get(url + "/health", headers={VIA_HEADER: state.config.instance_id}, timeout=5.0)
    except httpx.HTTPError:
        return False  # unreachable now: the health checks decide when it serves
    return r.status_code == 508


async def _worker_info(state: RouterState, url: str, headers: dict[str, str]) -> dict:
    """``{"url", "info"}`` with a worker's /get_server_info, or ``{"url", "error"}``."""
    assert state.client is not None
    try:
        r = await state.client.get(url + "/get_server_info", headers=headers, timeout=30.0)
        if r.status_code == 200:
            return {"url": url, "info": r.json()}
        return {"url": url, "error": f"{r.status_code}: {r.text[:500]}"}
    except (httpx.HTTPError, ValueError) as e:
        return {"url": url, "error": f"{type(e).__name__}: {e}"}


def _add_server_info_routes(app: FastAPI, state: RouterState) -> None:
    """/get_server_info (and /server_info): the workers' infos and the router's view."""

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        assert state.client is not None
        headers = state.headers(request)
        per = list(await asyncio.gather(*(_worker_info(state, u, headers) for u in state.pool.healthy_urls())))
        infos = [p["info"] for p in per if "info" in p]
        if not infos:
            errs = "; ".join(f"{p['url']}: {p['error']}" for p in per) or "no healthy worker"
            status = 401 if any(p.get("error", "").startswith("401") for p in per) else 503
            return error_response(status, f"no worker answered /get_server_info: {errs}")
        out = dict(infos[0])
        server = request.scope.get("server")
        if server:  # the front's address, where a client derives URLs from it (not the worker's own)
            out["host"], out["port"] = server[0], server[1]
        if state.config.require_all_healthy:  # a --dp front: its replicas are its ranks (SGLang's dp_size)
            out["dp_size"] = len(state.pool.workers)
        out["internal_states"] = [s for i in infos for s in i.get("internal_states", [])]
        out["workers"] = per
        out["router"] = _router_view(state)
        return JSONResponse(out)


WEIGHT_GROUP_PATHS = ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group")


def _add_proxied_routes(app: FastAPI, state: RouterState) -> None:
    """The routed paths (by the policy, on the prompt), then every other path
    (to the least loaded worker)."""

    def routed(path: str) -> Any:
        async def endpoint(request: Request) -> Response:
            return await proxy(state, request, path, key_from_body=True)

        return endpoint

    for route in ROUTED_PATHS:
        app.add_api_route(route, routed(route), methods=["POST"])

    async def one_worker_each(request: Request) -> Response:
        """A weight-update group's member has one rank: one worker would join (or update) and the
        others keep their weights, with nothing to say so (SGLang refuses them under DP too)."""
        return error_response(
            400,
            f"{request.url.path} is not served behind a router or --dp: each worker joins a weight-update "
            "group with its own rank, so send it to every worker's own address (GET /list_workers).",
        )

    for route in WEIGHT_GROUP_PATHS:
        app.add_api_route(route, one_worker_each, methods=["POST"])

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def other(request: Request, path: str) -> Response:
        return await proxy(state, request, "/" + path, key_from_body=False)
