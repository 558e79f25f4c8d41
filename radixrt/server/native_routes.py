"""SGLang's native generation route: ``POST /generate``.

Body: ``text`` or ``input_ids`` (one prompt or a list), ``sampling_params``
(an object, or one per prompt), ``return_logprob``, ``logprob_start_len``,
``top_logprobs_num`` (a value or one per prompt), ``token_ids_logprob`` (token
ids whose logprobs every position returns, in ``meta_info.input_token_ids_logprobs``
and ``output_token_ids_logprobs``; a list, or one per prompt), ``rid`` (one per prompt),
``return_text_in_logprobs``, ``stream``, ``cache_salt`` and ``extra_key`` (each a string or one
per prompt: a radix-cache namespace of their own), ``priority`` (an int in
``[-N, N]`` for ``--max-client-priority N``, or one per prompt: orders the waiting
queue under ``--enable-priority-scheduling``, else ignored), ``return_cache_info``
(radixrt's extension: ``meta_info.cache_info`` explains the prompt's radix-cache
match). Answer: one result
``{"text", "output_ids", "meta_info"}``, or a list for a batch or n > 1; with
``stream``, SSE events of cumulative results (text, output ids and logprobs
so far, as SGLang sends them: its clients keep the last event's
``meta_info``; an ``index`` when several) closed by ``data: [DONE]``; under
``--incremental-streaming-output`` (SGLang's flag) each event holds only what
is new since the sample's previous one (`ResultAccumulator.stream_chunk`).
With ``return_logprob``, ``meta_info.output_token_logprobs_length`` counts the
output logprobs so far (SGLang's current field).

Every other field of SGLang's ``GenerateReqInput`` is accepted while unset
(``None``, ``false``, empty), since SGLang's clients send some of them
explicitly (``RuntimeEndpoint``, ``Runtime.generate``: ``session_id``,
``image_data``...); set, it is a 400 naming it, except the
pure hints (logging, tracing, routing): `radixrt.requests.sglang_fields`,
which `Engine.generate` checks its SGLang arguments with too.

``POST /concate_and_append_request`` is what SGLang's ``RuntimeEndpoint``
posts when a program joins its forks with ``mode="concate_and_append"``.
"""

from __future__ import annotations

import functools
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.config.lora import unknown_adapter
from radixrt.requests.intake import RequestSpec, build_specs, sequences_each, split_prompts
from radixrt.requests.router import ReqGroup
from radixrt.requests.sessions import SessionStore, SessionTurn, end_turn, start_turn
from radixrt.requests.sglang_fields import HINT_FIELDS, UNSUPPORTED_FIELDS, check_unsupported
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import as_bad_request, bad_request, error_body
from radixrt.server.http_utils import (
    JSON,
    SSE_DONE,
    raise_refused,
    raise_state_errors,
    read_json,
    sse,
    stream_response,
    wait_group,
)
from radixrt.server.tokenizer_manager import TokenizerManager

router = APIRouter()

_GENERATE_KEYS = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "cache_salt",
    "priority",
    "return_cache_info",
    "lora_path",
    "return_prompt_token_ids",
    "extra_key",
    "return_hidden_states",
    "session_params",  # SGLang's sessions (session_routes.py)
}


def _check_keys(body: Any) -> None:
    """ServerError 400 unless ``body`` is an object of known (or ignorable) fields."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for key, value in body.items():
        if key in _GENERATE_KEYS:
            continue
        if key in UNSUPPORTED_FIELDS or key in HINT_FIELDS:
            with as_bad_request():
                check_unsupported({key: value})
            continue
        raise bad_request(f"Unknown field '{key}' in the /generate request.", key)


def parse_generate(body: Any, tm: TokenizerManager, admin: bool = False) -> tuple[list[RequestSpec], bool, bool]:
    """(specs, is_batch, stream) for a native /generate body, through the
    front door; ServerError 400 naming the field on bad input. The specs are
    not yet validated against the limits (`TokenizerManager.validate_specs`).
    ``admin``: the request presented the admin key (any 64-bit ``priority``)."""
    _check_keys(body)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    with as_bad_request():
        encode = functools.partial(tm.encode, field="text")
        each = sequences_each(body.get("sampling_params"))
        prompts = split_prompts(body.get("text"), body.get("input_ids"), encode, limits=tm.limits, each=each)
        specs = build_specs(
            prompts,
            sampling_params=body.get("sampling_params"),
            return_logprob=body.get("return_logprob"),
            logprob_start_len=body.get("logprob_start_len"),
            top_logprobs_num=body.get("top_logprobs_num"),
            token_ids_logprob=body.get("token_ids_logprob"),
            rid=body.get("rid"),
            return_text_in_logprobs=body.get("return_text_in_logprobs", False),
            cache_salt=body.get("cache_salt"),
            priority=body.get("priority"),
            return_cache_info=body.get("return_cache_info", False),
            admin=admin,
            lora_path=body.get("lora_path"),
            return_prompt_token_ids=body.get("return_prompt_token_ids") or False,
            extra_key=body.get("extra_key"),
            return_hidden_states=body.get("return_hidden_states") or False,
            sampling_defaults=tm.limits.preferred_sampling,
        )
    if body.get("log_metrics") is False:  # SGLang's hint: leave these out of the metrics
        for spec in specs:
            spec.log_metrics = False
    return specs, prompts.batch, bool(stream)


def _checked_generate(
    body: Any, tm: TokenizerManager, admin: bool, sessions: SessionStore
) -> tuple[list[RequestSpec], bool, bool, Optional[SessionTurn]]:
    """`parse_generate`, its session turn begun, then the specs validated (blocking: run off
    the event loop)."""
    specs, batch, stream = parse_generate(body, tm, admin)
    with as_bad_request():
        turn = start_turn(sessions, body.get("session_params"), specs, getattr(tm.tokenizer, "bos_token_id", None))
    try:
        tm.validate_specs(specs)
    except BaseException:
        end_turn(sessions, turn, None)
        raise
    return specs, batch, stream, turn


@router.api_route("/generate", methods=["POST", "PUT"])  # SGLang takes both
async def generate(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """Generate for one prompt or a batch; 499 (empty) if the client leaves first."""
    tm = ctx.tm
    body = await read_json(request)
    if isinstance(body, dict):
        ctx.check_cache_info(request, body.get("return_cache_info"))
    args = (body, tm, ctx.is_admin(request), ctx.sessions)
    specs, batch, stream, turn = await tm.run_tokenize(_checked_generate, *args)
    unknown = unknown_adapter((s.lora for s in specs), ctx.lora_adapters)
    if unknown is not None:  # before a stream's 200, as for a whole answer
        end_turn(ctx.sessions, turn, None)
        raise bad_request(f"unknown LoRA adapter {unknown[:128]!r}; load it with /load_lora_adapter.", "lora_path")
    try:
        group = tm.submit(specs, validated=True, on_done=functools.partial(end_turn, ctx.sessions, turn))
    except BaseException:
        end_turn(ctx.sessions, turn, None)
        raise
    multi = batch or len(group.states) > 1
    if stream:
        incremental = bool(ctx.server_args.get("incremental_streaming_output"))
        return stream_response(tm, group, _native_stream(group, multi, incremental))
    if not await wait_group(request, tm, group):
        return Response(status_code=499)
    raise_state_errors(group)
    raise_refused(group)
    results = [st.acc.to_dict() for st in group.states]
    return JSON(results if multi else results[0])


async def _native_stream(group: ReqGroup, multi: bool, incremental: bool) -> AsyncIterator[bytes]:
    """SSE body: each update of a sample as its cumulative result, or what is
    new in it when ``incremental`` (``index`` when ``multi``), then [DONE]."""
    async for news in group.updates():
        chunks = []
        for st in news:
            if st.error is not None:
                chunks.append(sse(error_body(503, st.error)))
                continue
            d = st.acc.stream_chunk(incremental)
            if multi:
                d["index"] = group.states.index(st)
            chunks.append(sse(d))
        yield b"".join(chunks)
    yield SSE_DONE


@router.post("/concate_and_append_request")
async def concate_and_append_request(request: Request) -> Response:
    """SGLang's fork join ``mode="concate_and_append"``: body ``{"src_rids":
    [str, ...], "dst_rid": str}``, 200 ``{"success": true}``.

    SGLang's ``RuntimeEndpoint`` posts it after appending the forks' texts to
    the parent's text, as a hint that the parent's KV could be built from the
    forks' (their ids are the program's stream ids, not request ids). With
    the radix cache nothing needs doing: the parent's next request shares the
    forks' prefix and computes only the appended text, and computes it
    exactly (SGLang's own server has no such route, so the client, which
    posts it from a worker thread, waits forever there)."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    src, dst = body.get("src_rids"), body.get("dst_rid")
    if not isinstance(src, list) or not all(isinstance(r, str) for r in src):
        raise bad_request("'src_rids' must be a list of strings.", "src_rids")
    if not isinstance(dst, str):
        raise bad_request("'dst_rid' must be a string.", "dst_rid")
    return JSON({"success": True})
