"""SGLang's sessions on the server: ``/open_session``, ``/close_session``, and the turns of
``/generate`` requests with ``session_params`` (`radixrt.requests.sessions`).

``/open_session`` (GET or POST; ``session_id``, ``streaming``, ``timeout``, SGLang's
``capacity_of_str_len`` accepted) answers the session's id as a JSON string; ``/close_session``
(``session_id``) answers 200. A ``/generate`` turn takes one prompt with ``n`` 1; its answer is
remembered once it finished (`end_turn`), whole or streamed.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.requests.finish import LENGTH, STOP
from radixrt.requests.intake import RequestSpec
from radixrt.requests.router import ReqGroup
from radixrt.requests.sessions import SessionStore, SessionTurn
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


def start_turn(
    sessions: SessionStore, body: Any, specs: list[RequestSpec], bos: Optional[int]
) -> Optional[SessionTurn]:
    """The session turn of a /generate body with ``session_params`` (its spec's prompt becomes the
    turn's whole prompt), or None without; ServerError 400 where the session cannot take it."""
    params = body.get("session_params") if isinstance(body, dict) else None
    if params is None:
        return None
    if len(specs) != 1 or specs[0].sampling.n != 1 or specs[0].sampling.beam_width > 1:
        raise bad_request("'session_params' takes one prompt, with n = 1 and no beam search.", "session_params")
    with as_bad_request():
        turn = sessions.begin(params, specs[0].input_ids, bos)
    specs[0].input_ids = turn.prompt
    return turn


def end_turn(sessions: SessionStore, turn: Optional[SessionTurn], group: Optional[ReqGroup]) -> None:
    """Remember a turn that finished (a failed, refused or aborted one, or none: forgotten)."""
    if turn is None:
        return
    if group is None:  # refused before it was submitted
        sessions.finish(turn, "", [], ok=False)
        return
    st = group.states[0]
    fr = st.acc.finish_reason
    ok = st.error is None and fr is not None and fr.type in (STOP, LENGTH)
    sessions.finish(turn, st.acc.rid, list(st.acc.output_ids), ok)
