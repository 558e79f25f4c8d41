"""HTTP helpers shared by the route modules: JSON and SSE encoding, error
responses, body reading, streamed responses that abort on close, and waiting
for a request group while watching for the client to leave."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable, Optional

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixrt.server.errors import ServerError, bad_request, error_body
from radixrt.server.tokenizer_manager import ReqGroup, TokenizerManager

_json_encoder = msgspec.json.Encoder()

SSE_DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    """JSON bytes; non-finite floats (a -inf logprob) become null."""
    return _json_encoder.encode(obj)


class JSON(Response):
    """A JSON response encoded with `dumps`."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


def error_response(status: int, message: str, param: Optional[str] = None,
                   err_type: Optional[str] = None) -> JSON:
    """An error answer with `error_body`'s body."""
    return JSON(error_body(status, message, param, err_type), status_code=status)


async def read_json(request: Request) -> Any:
    """The request body parsed as JSON; ServerError 400 when empty or malformed."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"Malformed JSON body: {e}") from None


class AbortingStreamingResponse(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (finished,
    client gone, server stopping): unfinished requests are aborted there."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def stream_response(tm: TokenizerManager, group: ReqGroup, body: AsyncIterator[bytes]) -> Response:
    """An SSE response of ``body``; the group's unfinished samples are
    aborted when it closes."""
    def on_close() -> None:
        if not group.done:
            tm.abort_group(group)

    return AbortingStreamingResponse(body, on_close)


async def _client_gone(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_group(request: Request, tm: TokenizerManager, group: ReqGroup) -> bool:
    """Wait for every sample of ``group``. If the client disconnects first (or
    this handler is cancelled), abort the unfinished samples and return False."""
    waiter = asyncio.ensure_future(group.wait())
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        tm.abort_group(group, "aborted: the server is stopping")
        raise
    finally:
        for t in (waiter, watcher):
            if not t.done():
                t.cancel()
    if group.done:
        return True
    tm.abort_group(group)
    return False


def group_error(group: ReqGroup) -> Optional[str]:
    """The server-side failure that ended one of the group's samples, if any."""
    for st in group.states:
        if st.error is not None:
            return st.error
    return None


def raise_state_errors(group: ReqGroup) -> None:
    """ServerError 503 if a sample of ``group`` failed on the server side."""
    err = group_error(group)
    if err is not None:
        raise ServerError(503, err)
