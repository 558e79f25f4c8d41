"""HTTP helpers shared by the route modules: JSON and SSE encoding, error
responses, body reading, streamed responses that abort on close, and waiting
for a request group while watching for the client to leave."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

import msgspec
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixrt.requests.router import ReqGroup
from radixrt.server.errors import ANTHROPIC_PREFIX, ServerError, anthropic_error_body, bad_request, error_body
from radixrt.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)
# a stream whose client reads nothing (its connection's buffers full) for this long is ended
SEND_STALL_TIMEOUT_S = 60.0

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


def error_response(
    status: int, message: str, param: Optional[str] = None, err_type: Optional[str] = None, path: str = ""
) -> JSON:
    """An error answer with `error_body`'s body, or Anthropic's on its Messages routes (``path``)."""
    if path.startswith(ANTHROPIC_PREFIX):
        return JSON(anthropic_error_body(status, message), status_code=status)
    return JSON(error_body(status, message, param, err_type), status_code=status)


# Deepest nesting of arrays and objects accepted in a request body. Real
# bodies nest a few levels (a JSON schema in response_format a few dozen);
# the limit keeps recursive code (parsers, validators, repr in error
# messages) far from Python's recursion limit.
MAX_JSON_DEPTH = 100
# Bodies larger than this are parsed in a worker thread, not on the event loop.
PARSE_IN_THREAD_BYTES = 256 * 1024
# Where the middleware leaves a body it already parsed (see GuardMiddleware).
SCOPE_JSON_KEY = "radixrt.json_body"

# A \uD800-\uDFFF escape (possibly preceded by an escaped backslash: the
# precise check runs only when this matches).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_deep(obj: Any, limit: int) -> bool:
    """Whether ``obj`` (as json.loads makes it) nests lists/dicts more than ``limit`` deep.
    Level by level, without recursion; the leaves of a container are skipped in C."""
    level = [obj] if isinstance(obj, (list, dict)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        nested: list[Any] = []
        for c in level:
            values = list(c.values()) if isinstance(c, dict) else c
            kinds = set(map(type, values))
            if list in kinds or dict in kinds:
                nested.extend(v for v in values if isinstance(v, (list, dict)))
        level = nested
    return False


def query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    """Query parameter ``name`` as an integer in [``lo``, ``hi``] (``default`` when absent); a 400
    naming it otherwise."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"'{name}' must be an integer in [{lo}, {hi}].", name) from None
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be an integer in [{lo}, {hi}], got {value}.", name)
    return value


def parse_json_body(raw: bytes) -> Any:
    """``raw`` parsed as JSON (UTF-8); ServerError 400 when it is not valid
    UTF-8 or not JSON, nests more than MAX_JSON_DEPTH deep, holds an integer of
    more digits than Python converts (4,300 by default), or holds a lone
    UTF-16 surrogate escape (``"\\ud800"``: not a Unicode character, so no
    tokenizer or encoder can take it). NaN and Infinity are accepted as
    Python's json does; the fields that take numbers refuse them."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    if not text.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        obj = json.loads(text)
        too_deep = _too_deep(obj, MAX_JSON_DEPTH)
    except json.JSONDecodeError as e:
        raise bad_request(f"Malformed JSON body: {e}") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise bad_request(f"The JSON body holds a number Python will not read: {e}") from None
    except RecursionError:
        too_deep = True
    if too_deep:
        raise bad_request(f"The JSON body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep.")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(
                f"The JSON body holds a lone UTF-16 surrogate ({e.object[e.start : e.end]!a}), "
                "which is not a Unicode character; escape astral characters as a "
                "surrogate pair or send them as UTF-8."
            ) from None
    return obj


async def parse_json_body_async(raw: bytes) -> Any:
    """`parse_json_body`, in a worker thread when ``raw`` is large (the event
    loop keeps serving meanwhile)."""
    if len(raw) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


async def read_json(request: Request) -> Any:
    """The request body parsed as JSON (as `parse_json_body`; reused when the
    middleware already parsed it); ServerError 400 when empty or malformed."""
    scope = request.scope
    if SCOPE_JSON_KEY in scope:
        return scope[SCOPE_JSON_KEY]
    return await parse_json_body_async(await request.body())


M = TypeVar("M", bound=BaseModel)


def check_items(body: Any, field: str, limit: int) -> None:
    """ServerError 400 unless ``body[field]``, a list of messages or items, holds at most
    ``limit`` of them and of their content parts together. Validating a list holds the
    GIL throughout (pydantic's core), so a million items stalled the event loop for
    seconds from a worker thread; each costs at least one token, so a list longer than
    the context (the routes' ``limit``) is refused before, in O(limit)."""
    items = body.get(field) if isinstance(body, dict) else None
    if not isinstance(items, list):
        return
    total = len(items)
    if total <= limit:
        total += sum(len(m["content"]) for m in items if isinstance(m, dict) and isinstance(m.get("content"), list))
    if total > limit:
        raise bad_request(
            f"'{field}' holds more than {limit} messages and content parts together; each takes at least "
            f"one token of this model's context ({limit} tokens)",
            field,
        )


async def read_model(request: Request, model: type[M], max_items: Optional[tuple[str, int]] = None) -> M:
    """The JSON body (`read_json`) validated as the pydantic ``model``;
    RequestValidationError (a 400 naming the field) when it does not fit.
    A body too large to parse on the event loop is validated in a worker
    thread too (a route that declares its body model has FastAPI parse and
    validate it again, on the loop). ``max_items`` (field, n): first, a 400
    unless that list holds at most n items and content parts (`check_items`)."""
    body = await read_json(request)
    if max_items is not None:
        check_items(body, *max_items)
    length = request.headers.get("content-length")
    large = not (length and length.isdigit()) or int(length) > PARSE_IN_THREAD_BYTES
    try:
        if large:
            return await asyncio.to_thread(model.model_validate, body)
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


class _ClientStalled(Exception):
    """A stream's client read nothing for `SEND_STALL_TIMEOUT_S`."""


class AbortingStreamingResponse(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (finished,
    client gone, server stopping, or a client that reads nothing: a write that
    waits ``stall_timeout_s`` for the client ends the stream, and the server closes
    the connection): unfinished requests are aborted there, and what the stream held
    is freed, however long it would have run."""

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], stall_timeout_s: float = 0.0
    ) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.on_close = on_close
        self.stall_timeout_s = stall_timeout_s or SEND_STALL_TIMEOUT_S

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def send_or_give_up(message: Any) -> None:
            try:
                async with asyncio.timeout(self.stall_timeout_s):  # the transport waits for the client to read
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, send_or_give_up)
        except _ClientStalled:
            logger.warning("a stream's client read nothing for %.0f s: its requests end", self.stall_timeout_s)
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


async def _settled(group: ReqGroup) -> None:
    """Until every sample of ``group`` is done, or one ended with an abort that carries an HTTP
    status (`status_abort`): that is then the whole call's answer."""
    while not group.done and status_abort(group) is None:
        await group.event.wait()
        group.event.clear()


async def wait_group(request: Request, tm: TokenizerManager, group: ReqGroup) -> bool:
    """Wait for every sample of ``group``, or until one ends with an abort that carries a status
    (a timeout's 503, a refusal's 400): the others are aborted then, since the call's answer is
    that error (they ran to their end for nothing). If the client disconnects first (or this
    handler is cancelled), abort the unfinished samples and return False."""
    waiter = asyncio.ensure_future(_settled(group))
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
    if waiter.done() and not waiter.cancelled():
        tm.abort_group(group, "aborted: another prompt or sample of the call failed")
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


async def answer_view(request: Request, tm: TokenizerManager, group: ReqGroup, view: Any, stream: bool) -> Response:
    """Stream ``view`` (its ``stream()``), or wait for the group and answer its ``response()``
    whole (499 if the client left; a failure or a refusal as its error)."""
    if stream:
        return stream_response(tm, group, view.stream())
    if not await wait_group(request, tm, group):
        return Response(status_code=499)
    raise_state_errors(group)
    raise_refused(group)
    return JSON(view.response())


def status_abort(group: ReqGroup) -> Optional[tuple[int, str]]:
    """(status, message) of the first sample of ``group`` that the scheduler ended with an abort
    carrying an HTTP status: 400 for a refusal (a grammar that does not compile, a stop_regex
    whose search runs away), 503 or 500 for the server's own abort (a waiting or running
    timeout); None when there is none. An abort without a status (an admin's ``/abort_request``)
    is an answer with finish reason abort."""
    for st in group.states:
        fr = st.acc.finish_reason
        if fr is not None and fr.is_abort and fr.status_code in (400, 500, 503):
            default = "The request was refused." if fr.status_code == 400 else "The server aborted the request."
            return fr.status_code, fr.message or default
    return None


def raise_refused(group: ReqGroup) -> None:
    """ServerError for `status_abort` of ``group``, as SGLang answers such a request whole; a
    stream sends it as an error event after the aborted choice instead."""
    found = status_abort(group)
    if found is not None:
        raise bad_request(found[1]) if found[0] == 400 else ServerError(*found)
