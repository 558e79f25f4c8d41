"""The router's routes that go to every healthy worker: ``/flush_cache``,
``/abort_request``, ``/load_lora_adapter``, ``/unload_lora_adapter``,
``/update_weights_from_disk``, ``/update_weight_version``, ``/pause_generation``,
``/continue_generation``, ``/release_memory_occupation``, ``/resume_memory_occupation``,
``/start_profile`` and ``/stop_profile`` (the router app's docstring says what each answers).

All but ``/abort_request`` change a worker's state, and a worker out of routing when one is sent
(stuck, overloaded, restarting) would come back without it (no adapter, old weights, its cache
unflushed) while the answer said done: for these a worker out of routing counts as one that
failed, so the answer is a 502 naming it and the client sends it again once ``/health`` is 200."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

import httpx
from fastapi import FastAPI, Request
from starlette.responses import Response

from radixrt.router.state import RouterState, error_response

Answer = tuple[str, Optional[httpx.Response], str]
# a worker answers an update once its running requests are done: within an hour (its own limit)
UPDATE_TIMEOUT_S = 3610.0


async def broadcast(
    state: RouterState,
    request: Request,
    path: str,
    timeout: float = 60.0,
    bodies: Optional[dict[str, bytes]] = None,
    changes_state: bool = True,
) -> list[Answer]:
    """Send the request to every healthy worker (with ``bodies[url]`` as its body, where given);
    (url, response or None, error) each, and where it ``changes_state`` a failed answer for each
    worker out of routing, which did not get it."""
    assert state.client is not None
    body = await request.body()
    headers = state.headers(request)

    async def one(url: str) -> Answer:
        assert state.client is not None
        content = body if bodies is None else bodies.get(url, body)
        try:
            r = await state.client.request(
                request.method,
                url + path,
                headers=headers,
                content=content,
                params=request.query_params,
                timeout=timeout,
            )
            return url, r, ""
        except httpx.HTTPError as e:
            return url, None, f"{type(e).__name__}: {e}"

    answers = list(await asyncio.gather(*(one(u) for u in state.pool.healthy_urls())))
    missed = [(u, w.last_error) for u, w in state.pool.workers.items() if not w.healthy] if changes_state else []
    return answers + [(u, None, f"not sent: out of routing ({why or 'not healthy'})") for u, why in missed]


def failures(results: list[Answer]) -> list[str]:
    """The workers that did not answer 200, with what they said."""
    return [
        f"{u}: {r.status_code} {r.text.strip()}" if r is not None else f"{u}: {err}"
        for u, r, err in results
        if r is None or r.status_code != 200
    ]


async def to_every_worker(
    state: RouterState,
    request: Request,
    path: str,
    timeout: float = 130.0,
    bodies: Optional[dict[str, bytes]] = None,
    joined: bool = False,
) -> Response:
    """The workers' one answer when they agree (``joined``: all their texts when they
    succeeded, each saying what it did), else what failed where (a 400 when nothing
    applied it, a 502 when some did). The default timeout: the LoRA routes' (120 s) and more."""
    if not state.pool.healthy_urls():
        return error_response(503, "no healthy worker is available")
    results = await broadcast(state, request, path, timeout=timeout, bodies=bodies)
    first = results[0][1]
    if first is not None and all(r is not None and r.status_code == first.status_code for _, r, _ in results):
        # one answer from all (loaded, or refused alike: a bad folder, a missing key): one server's answer
        ok = joined and first.status_code == 200
        content = b"".join(r.content for _, r, _ in results if r is not None) if ok else first.content
        return Response(content, status_code=first.status_code, media_type=first.headers.get("content-type"))
    failed = failures(results)
    applied = len(results) - len(failed)
    reasons = "; ".join(failed)
    message = f"{path} failed on {len(failed)} of {len(results)} workers ({applied} applied it): {reasons}"
    return error_response(502 if applied else 400, message)


def add_broadcast_routes(app: FastAPI, state: RouterState) -> None:
    """/flush_cache, /abort_request and the LoRA routes, sent to every healthy worker."""

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        answer = await to_every_worker(state, request, "/flush_cache", 610.0)  # ?timeout= waits up to 600 s
        state.pool.policy.reset()
        return answer

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        results = await broadcast(state, request, "/abort_request", changes_state=False)
        answered = [r for _, r, _ in results if r is not None]
        if not answered:
            return error_response(503, "no healthy worker is available")
        bad = [r for r in answered if r.status_code != 200]
        if bad:  # the same body went to all: a 400 from one is a 400 from each
            return Response(
                bad[0].content, status_code=bad[0].status_code, media_type=bad[0].headers.get("content-type")
            )
        return Response(status_code=200)

    def forward(path: str, timeout: float = 130.0) -> None:
        async def route(request: Request) -> Response:
            return await to_every_worker(state, request, path, timeout)

        app.add_api_route(path, route, methods=["POST"], name=path.strip("/"))

    for path in ("/load_lora_adapter", "/unload_lora_adapter", "/pause_generation", "/continue_generation"):
        forward(path)
    forward("/update_weight_version")
    forward("/update_weights_from_disk", UPDATE_TIMEOUT_S)
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        forward(path, UPDATE_TIMEOUT_S)


def add_profile_routes(app: FastAPI, state: RouterState) -> None:
    """/start_profile and /stop_profile, sent to every healthy worker (each writes its own trace)."""

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request) -> Response:
        """Every worker profiles, each into its own trace: one ``profile_id`` for all (the
        request's, or the time), and with several workers each one's rank in the router's order
        (``dp_rank``: SGLang's ``-DP-<rank>`` in the file's name)."""
        raw = await request.body()
        try:
            fields = json.loads(raw) if raw.strip() else {}
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            return error_response(400, "The request body must be a JSON object.")
        fields["profile_id"] = fields.get("profile_id") or str(time.time())  # one for all (null: the time)
        urls = list(state.pool.workers)
        ranked = {u: {**fields, "dp_rank": i} if len(urls) > 1 else fields for i, u in enumerate(urls)}
        bodies = {u: json.dumps(b).encode() for u, b in ranked.items()}
        return await to_every_worker(state, request, "/start_profile", 610.0, bodies, joined=True)

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile(request: Request) -> Response:
        return await to_every_worker(state, request, "/stop_profile", 610.0, joined=True)
