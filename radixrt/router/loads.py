"""SGLang's load probes behind a router (``radixrt router``, ``radixrt serve --dp``):
``GET /get_load`` and ``GET /v1/loads`` ask every healthy worker and answer one entry per
worker, its ``dp_rank`` being its place in the router's order of workers (as ``routed_dp_rank``
and ``/start_profile`` number them). ``/v1/loads?dp_rank=N`` keeps that worker's entry."""

from __future__ import annotations

import asyncio
from typing import Optional, Union

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from radixrt.router.state import RouterState, error_response

RankedAnswers = list[tuple[int, httpx.Response]]


async def _ask_every_worker(
    state: RouterState, request: Request, path: str, params: dict[str, str]
) -> Union[RankedAnswers, Response]:
    """(rank, answer) of each healthy worker that answered 200, in rank order; else an error
    answer: a worker's refusal of the query (the same for all), or a 503 when none answered."""
    assert state.client is not None
    client, headers = state.client, state.headers(request)
    rank_of = {url: i for i, url in enumerate(state.pool.workers)}

    async def one(url: str) -> Optional[httpx.Response]:
        try:
            return await client.get(url + path, headers=headers, params=params, timeout=30.0)
        except httpx.HTTPError:
            return None

    urls = state.pool.healthy_urls()
    answers = [(rank_of[u], r) for u, r in zip(urls, await asyncio.gather(*map(one, urls))) if r is not None]
    refused = [r for _, r in answers if r.status_code != 200]
    if refused:
        r = refused[0]
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
    if not answers:
        return error_response(503, "no healthy worker answered")
    return sorted(answers, key=lambda a: a[0])


def _gauges_by_metric(texts: list[tuple[int, str]]) -> str:
    """Each worker's gauges (rank 0's labels) under its rank, one group per metric with its
    ``# TYPE`` line once, as Prometheus' text format asks."""
    groups: dict[str, list[str]] = {}
    for rank, text in texts:
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                groups.setdefault(line.split()[2], [line])
            elif line:
                name = line.split("{", 1)[0]
                groups.setdefault(name, []).append(line.replace('dp_rank="0"', f'dp_rank="{rank}"'))
    return "".join(line + "\n" for lines in groups.values() for line in lines)


def add_load_routes(app: FastAPI, state: RouterState) -> None:
    """/get_load and /v1/loads, one entry per worker."""

    @app.get("/get_load")
    async def get_load(request: Request) -> Response:
        answers = await _ask_every_worker(state, request, "/get_load", {})
        if isinstance(answers, Response):
            return answers
        return JSONResponse([{**row, "dp_rank": rank} for rank, r in answers for row in r.json()])

    @app.get("/v1/loads")
    async def loads(request: Request) -> Response:
        params = dict(request.query_params)
        wanted = params.pop("dp_rank", None)
        if wanted is not None and not wanted.isdigit():
            return error_response(400, f"'dp_rank' must be an integer >= 0, got {wanted!r}.")
        answers = await _ask_every_worker(state, request, "/v1/loads", params)
        if isinstance(answers, Response):
            return answers
        kept = [(rank, r) for rank, r in answers if wanted is None or rank == int(wanted)]
        if params.get("format") == "prometheus":
            text = _gauges_by_metric([(rank, r.text) for rank, r in kept])
            return Response(text, media_type=answers[0][1].headers.get("content-type"))
        body = answers[0][1].json()
        body["loads"] = [{**row, "dp_rank": rank} for rank, r in kept for row in r.json()["loads"]]
        return JSONResponse(body)
