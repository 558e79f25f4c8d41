"""SGLang's sessions on the server: ``/open_session``, ``/close_session``, and the turns of
``/generate`` requests with ``session_params`` (`radixrt.requests.sessions`).

``/open_session`` (GET or POST; ``session_id``, ``streaming``, ``timeout``, SGLang's
``capacity_of_str_len`` accepted) answers the session's id as a JSON string; ``/close_session``
(``session_id``) answers 200. A ``/generate`` turn takes one prompt with ``n`` 1; its answer is
remembered once it finished (`radixrt.requests.sessions.end_turn`), whole or streamed.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import as_bad_request, bad_request
from radixrt.server.http_utils import JSON, read_json

router = APIRouter()


async def _body(request: Request) -> dict:
    body = await read_json(request) if await request.body() else {}
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


@router.api_route("/open_session", methods=["GET", "POST"])
async def open_session(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    body = await _body(request)
    with as_bad_request():
        sid = ctx.sessions.open(body.get("session_id"), body.get("streaming") or False, body.get("timeout"))
    return JSON(sid)


@router.api_route("/close_session", methods=["GET", "POST"])
async def close_session(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    body = await _body(request)
    with as_bad_request():
        ctx.sessions.close(body.get("session_id"))
    return Response(status_code=200)
