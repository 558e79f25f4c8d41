"""SGLang's native generation route: ``POST /generate``.

Body: ``text`` or ``input_ids`` (one prompt or a list), ``sampling_params``
(an object, or one per prompt), ``return_logprob``, ``logprob_start_len``,
``top_logprobs_num`` (a value or one per prompt), ``rid`` (one per prompt),
``return_text_in_logprobs``, ``stream``, ``cache_salt``. Answer: one result
``{"text", "output_ids", "meta_info"}``, or a list for a batch or n > 1; with
``stream``, SSE events of cumulative results (output logprobs as deltas, an
``index`` when several) closed by ``data: [DONE]``.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.requests.intake import RequestSpec, build_specs, split_prompts
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import as_bad_request, bad_request, error_body
from radixrt.server.http_utils import (
    JSON,
    SSE_DONE,
    raise_state_errors,
    read_json,
    sse,
    stream_response,
    wait_group,
)
from radixrt.server.tokenizer_manager import ReqGroup, TokenizerManager

router = APIRouter()

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


def _check_keys(body: Any) -> None:
    """ServerError 400 unless ``body`` is an object of known (or ignorable) fields."""
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


def parse_generate(body: Any, tm: TokenizerManager) -> tuple[list[RequestSpec], bool, bool]:
    """(specs, is_batch, stream) for a native /generate body, through the
    front door; ServerError 400 naming the field on bad input. The specs are
    not yet validated against the limits (`TokenizerManager.submit` does that)."""
    _check_keys(body)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    with as_bad_request():
        prompts = split_prompts(body.get("text"), body.get("input_ids"), tm.encode)
        specs = build_specs(
            prompts, sampling_params=body.get("sampling_params"), return_logprob=body.get("return_logprob"),
            logprob_start_len=body.get("logprob_start_len"), top_logprobs_num=body.get("top_logprobs_num"),
            rid=body.get("rid"), return_text_in_logprobs=body.get("return_text_in_logprobs", False),
            cache_salt=body.get("cache_salt"),
        )
    return specs, prompts.batch, bool(stream)


@router.post("/generate")
async def generate(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    """Generate for one prompt or a batch; 499 (empty) if the client leaves first."""
    tm = ctx.tm
    specs, batch, stream = parse_generate(await read_json(request), tm)
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
    """SSE body: each update of a sample as its cumulative result (output
    logprobs since its last event; ``index`` when ``multi``), then [DONE]."""
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
