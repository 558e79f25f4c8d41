"""FastAPI app: SGLang-native and OpenAI-compatible routes over the
TokenizerManager.

Error bodies follow OpenAI's shape on every route:
``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from radixrt.sampling.params import SamplingParams
from radixrt.server import openai_api
from radixrt.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from radixrt.server.tokenizer_manager import ReqGroup, ReqSpec, ServerError, TokenizerManager, bad_request

logger = logging.getLogger(__name__)

_json_encoder = msgspec.json.Encoder()


def dumps(obj: Any) -> bytes:
    """JSON bytes; non-finite floats (a -inf logprob) become null."""
    return _json_encoder.encode(obj)


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_body(status: int, message: str, param: Optional[str] = None, err_type: Optional[str] = None) -> dict:
    e = ServerError(status, message, param, err_type)
    return {"error": {"message": message, "type": e.err_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None,
                   err_type: Optional[str] = None) -> JSON:
    return JSON(error_body(status, message, param, err_type), status_code=status)


@dataclass
class ServerContext:
    """What the routes need besides the tokenizer manager."""

    tm: TokenizerManager
    metrics: ServerMetrics
    model_path: str  # as given on the command line
    resolved_model_path: str
    served_model_name: str
    api_key: Optional[str] = None
    max_request_bytes: int = 32 * 1024 * 1024
    server_args: dict = field(default_factory=dict)
    process_ids: dict = field(default_factory=dict)
    model_aliases: set = field(default_factory=set)
    chat_info: dict = field(default_factory=dict)  # chat_role_markers, chat_default_system_prompt
    healthy: Callable[[], bool] = lambda: True
    started: float = field(default_factory=time.time)

    def check_model(self, name: Optional[str]) -> None:
        if name is None or name in self.model_aliases:
            return
        raise ServerError(404, f"The model `{name}` does not exist; this server serves "
                               f"`{self.served_model_name}`.", "model", "model_not_found")


# ---------------------------------------------------------------------- ASGI middleware
_KNOWN_ROUTES = {
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/health_generate",
    "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/flush_cache", "/abort_request",
    "/metrics", "/debug/kv",
}


class GuardMiddleware:
    """API key (every route but /health), request body size limit, HTTP metrics.
    Pure ASGI, so streaming and disconnect detection pass through untouched."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app: Any, ctx_getter: Callable[[], ServerContext]) -> None:
        self.app = app
        self.ctx_getter = ctx_getter

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = self.ctx_getter()
        path = scope.get("path", "")
        route = path if path in _KNOWN_ROUTES else "other"
        status_box = [0]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            if ctx.api_key and path not in self.OPEN_PATHS and not self._authorized(scope, ctx.api_key):
                await self._reply(send_wrapper, error_response(
                    401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                    err_type="authentication_error"), scope, receive)
                return
            limit = ctx.max_request_bytes
            length = self._content_length(scope)
            if length is not None and length > limit:
                await self._reply(send_wrapper, error_response(
                    413, f"The request body ({length} bytes) exceeds the limit of {limit} bytes."),
                    scope, receive)
                return
            received = 0

            async def limited_receive() -> dict:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise ServerError(413, f"The request body exceeds the limit of {limit} bytes.")
                return message

            await self.app(scope, limited_receive, send_wrapper)
        finally:
            if status_box[0]:
                ctx.metrics.observe_http(route, status_box[0])

    @staticmethod
    def _authorized(scope: dict, key: str) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                v = value.decode("latin-1").strip()
                if v.lower().startswith("bearer ") and v[7:].strip() == key:
                    return True
            elif name == b"x-api-key" and value.decode("latin-1").strip() == key:
                return True
        return False

    @staticmethod
    def _content_length(scope: dict) -> Optional[int]:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    @staticmethod
    async def _reply(send: Callable, response: Response, scope: dict, receive: Callable) -> None:
        await response(scope, receive, send)


# ---------------------------------------------------------------------- helpers
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


def stream_response(tm: TokenizerManager, group: ReqGroup, body: AsyncIterator[bytes]) -> Response:
    def on_close() -> None:
        if not group.done:
            tm.abort_group(group)

    return AbortingStreamingResponse(body, on_close)


def raise_state_errors(group: ReqGroup) -> None:
    for st in group.states:
        if st.error is not None:
            raise ServerError(503, st.error)


async def read_json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"Malformed JSON body: {e}") from None


# ---------------------------------------------------------------------- /generate parsing
_GENERATE_KEYS = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "stream", "cache_salt",
}
# SGLang request fields radixrt does not implement: accepted while empty/unset.
_GENERATE_IGNORED = {
    "image_data", "audio_data", "video_data", "lora_path", "lora_id", "session_params", "custom_logit_processor",
    "input_embeds", "modalities", "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank",
    "return_hidden_states", "token_ids_logprob", "stream_options", "priority", "extra_key",
    "return_routed_experts", "conversation_id", "label", "background", "custom_labels",
}
_GENERATE_ALWAYS_IGNORED = {"log_metrics", "no_logs"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_generate(body: Any, tm: TokenizerManager) -> tuple[list[ReqSpec], bool, bool]:
    """(specs, is_batch, stream) for a native /generate body; ServerError 400 on bad input."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for key, value in body.items():
        if key in _GENERATE_KEYS or key in _GENERATE_ALWAYS_IGNORED:
            continue
        if key in _GENERATE_IGNORED:
            if value in (None, False, [], {}, ""):
                continue
            raise bad_request(f"'{key}' is not supported by radixrt.", key)
        raise bad_request(f"Unknown field '{key}' in the /generate request.", key)

    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise bad_request("Give exactly one of 'text' or 'input_ids'.", "text")
    if text is not None:
        if isinstance(text, str):
            batch, texts = False, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            batch, texts = True, text
        else:
            raise bad_request("'text' must be a string or a non-empty list of strings.", "text")
        ids_list = [tm.encode(t) if t else [] for t in texts]
    else:
        if isinstance(input_ids, list) and all(_is_int(t) for t in input_ids):
            batch, ids_list = False, [list(input_ids)]
        elif (isinstance(input_ids, list) and input_ids
              and all(isinstance(x, list) and all(_is_int(t) for t in x) for x in input_ids)):
            batch, ids_list = True, [list(x) for x in input_ids]
        else:
            raise bad_request("'input_ids' must be a list of integers or a non-empty list of such lists.",
                              "input_ids")
    n = len(ids_list)

    def per_item(name: str, default: Any, check: Callable[[Any], bool], what: str) -> list[Any]:
        value = body.get(name)
        if value is None:
            return [default] * n
        if isinstance(value, list) and (batch or name == "sampling_params" and len(value) == 1):
            if len(value) != n:
                raise bad_request(f"'{name}' has {len(value)} entries for {n} prompts.", name)
            values = [default if v is None else v for v in value]
        else:
            values = [value] * n
        for v in values:
            if not check(v):
                raise bad_request(f"'{name}' must be {what}, got {v!r}.", name)
        return values

    sampling = per_item("sampling_params", {}, lambda v: isinstance(v, dict), "an object (or a list of objects)")
    logprob_flags = per_item("return_logprob", False, lambda v: isinstance(v, bool), "a boolean")
    starts = per_item("logprob_start_len", -1, _is_int, "an integer")
    tops = per_item("top_logprobs_num", 0, lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    rids = per_item("rid", None, lambda v: isinstance(v, str) and v != "", "a non-empty string")
    if not batch and isinstance(body.get("rid"), list):
        raise bad_request("'rid' must be a string for a single prompt.", "rid")
    text_in_lp = body.get("return_text_in_logprobs", False)
    if not isinstance(text_in_lp, bool):
        raise bad_request("'return_text_in_logprobs' must be a boolean.", "return_text_in_logprobs")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise bad_request("'cache_salt' must be a string.", "cache_salt")
    if batch and len(set(r for r in rids if r)) != len([r for r in rids if r]):
        raise bad_request("'rid' values must be unique.", "rid")

    specs = []
    for i, ids in enumerate(ids_list):
        try:
            sp = SamplingParams.from_dict(sampling[i])
        except ValueError as e:
            raise bad_request(str(e), "sampling_params") from None
        specs.append(ReqSpec(
            input_ids=ids, sampling=sp, return_logprob=logprob_flags[i] or tops[i] > 0,
            logprob_start_len=starts[i], top_logprobs_num=tops[i], return_text_in_logprobs=text_in_lp,
            cache_salt=salt, rid=rids[i], field="text" if text is not None else "input_ids",
        ))
    return specs, batch, stream


# ---------------------------------------------------------------------- app
def build_app(ctx: ServerContext, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="radixrt", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.add_middleware(GuardMiddleware, ctx_getter=lambda: app.state.ctx)
    tm = ctx.tm

    # -- errors ----------------------------------------------------------------
    @app.exception_handler(ServerError)
    async def _server_error(_: Request, exc: ServerError) -> Response:
        return error_response(exc.status, exc.message, exc.param, exc.err_type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        kind = first.get("type", "")
        if kind == "json_invalid":
            return error_response(400, f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
        field_name = ".".join(loc) if loc else None
        msg = first.get("msg", "invalid request")
        if field_name:
            message = f"Invalid value for '{field_name}': {msg}"
            if "input" in first and kind != "missing":
                message += f" (got {first['input']!r})"
        else:
            message = f"Invalid request: {msg}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more errors)"
        return error_response(400, message, field_name)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        cause = exc.__cause__
        if isinstance(cause, ServerError):  # e.g. the body limit hit while FastAPI read a model's body
            return error_response(cause.status, cause.message, cause.param, cause.err_type)
        message = {404: "Not found: no such route.", 405: "Method not allowed on this route."}.get(
            exc.status_code, str(exc.detail))
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")

    # -- health and info ---------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if ctx.healthy() and tm.dead_reason is None:
            return Response(status_code=200)
        return error_response(503, f"unhealthy: {tm.dead_reason or 'a server process is down'}")

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        tm.check_alive()
        spec = ReqSpec(input_ids=[tm.tokenizer.eos_token_id or 0],
                       sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        group = tm.submit([spec])
        try:
            await asyncio.wait_for(wait_group(request, tm, group), 30)
        except asyncio.TimeoutError:
            tm.abort_group(group, "health check timed out")
            return error_response(503, "unhealthy: a one-token generation did not finish in 30 s")
        raise_state_errors(group)
        return Response(status_code=200)

    def model_info() -> dict:
        return {
            "model_path": ctx.resolved_model_path,
            "tokenizer_path": ctx.resolved_model_path,
            "served_model_name": ctx.served_model_name,
            "is_generation": True,
            "context_length": tm.context_length,
            "vocab_size": tm.vocab_size,
            "chat_role_markers": ctx.chat_info.get("chat_role_markers"),
            "chat_default_system_prompt": ctx.chat_info.get("chat_default_system_prompt"),
            "preferred_sampling_params": None,
        }

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return JSON(model_info())

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        stats = await tm.get_stats()
        import radixrt

        return JSON({
            **ctx.server_args,
            "version": getattr(radixrt, "__version__", "0"),
            "model_info": model_info(),
            "max_total_num_tokens": tm.kv_total_slots,
            "kv_slots": stats.get("kv", {}),
            "internal_states": [stats],
            "process_ids": ctx.process_ids,
            "uptime_s": round(time.time() - ctx.started, 3),
        })

    @app.get("/debug/kv")
    async def debug_kv() -> Response:
        stats = await tm.get_stats()
        return JSON({"kv_slots": stats.get("kv", {}), "running": stats.get("running"),
                     "waiting": stats.get("waiting"), "inflight": len(tm.states)})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            await tm.get_stats(timeout=3.0)
        except ServerError:
            pass  # still serve what the server itself measured
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await tm.flush_cache():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: requests are running; try again when idle.\n",
                                 status_code=400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str):
            raise bad_request("'rid' must be a string.", "rid")
        if not isinstance(abort_all, bool):
            raise bad_request("'abort_all' must be a boolean.", "abort_all")
        if not rid and not abort_all:
            raise bad_request("Give a 'rid' to abort, or 'abort_all': true.", "rid")
        tm.check_alive()
        tm.abort_rid("" if abort_all else rid)
        return Response(status_code=200)

    # -- native generate ----------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        specs, batch, stream = parse_generate(body, tm)
        group = tm.submit(specs)
        multi = batch or len(group.states) > 1
        if stream:
            return stream_response(tm, group, _native_stream(group, multi))
        if not await wait_group(request, tm, group):
            return Response(status_code=499)
        raise_state_errors(group)
        results = [st.acc.to_dict() for st in group.states]
        return JSON(results if multi else results[0])

    async def _native_stream(group: ReqGroup, multi: bool) -> AsyncIterator[bytes]:
        async for news in group.updates():
            chunks = []
            for st in news:
                if st.error is not None:
                    chunks.append(sse(error_body(503, st.error)))
                    continue
                d = st.acc.to_dict(logprob_offset=st.sent_logprobs)
                st.sent_logprobs = len(st.acc.output_token_logprobs)
                if multi:
                    d["index"] = group.states.index(st)
                chunks.append(sse(d))
            yield b"".join(chunks)
        yield SSE_DONE

    # -- OpenAI -----------------------------------------------------------------
    openai_api.add_routes(app, ctx)
    return app
