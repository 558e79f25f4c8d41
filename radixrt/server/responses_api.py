"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A Responses request becomes a chat request (`responses_input`) and takes
the chat route's own path (`openai_api.plan_chat`): the same checks of tools
and tool_choice, the same prompt rendering, the same grammar enforcing
calls, the same sampling; a 400 from there names the Responses field
(``input[1].call_id``, ``text.format``, ``max_output_tokens``). The answer is
written by `responses_render`.

A continuation's prompt is the earlier conversation rendered the same way
plus the new turn, so its tokens start with the earlier prompt and output:
the radix cache serves them (``usage.input_tokens_details.cached_tokens``).
As in OpenAI's API, the earlier ``instructions`` are not carried over.

``store`` (default true): the finished response is kept in a bounded LRU
(`responses_store`, ``--responses-store-size`` entries and
``--responses-store-mb``); one made with ``store: false`` cannot be
retrieved or continued.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import ServerError, bad_request
from radixrt.server.http_utils import JSON, answer_view, read_model
from radixrt.server.openai_api import ChatPlan, plan_chat
from radixrt.server.protocol import ChatCompletionRequest
from radixrt.server.responses_input import Conversation, drop_unanswered_cuts, input_items, to_chat_request
from radixrt.server.responses_items import listed_inputs, page
from radixrt.server.responses_protocol import (
    INCLUDABLE,
    LOGPROBS_INCLUDE,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    ResponsesRequest,
)
from radixrt.server.responses_render import ResponseView, new_id
from radixrt.server.responses_store import ResponseStore, StoredResponse

router = APIRouter()

DEFAULT_STORE_SIZE = 1024  # responses
DEFAULT_STORE_MB = 256.0


def responses_store(request: Request) -> ResponseStore:
    """The app's store, made on first use from ``--responses-store-size`` / ``--responses-store-mb``."""
    state = request.app.state
    store = getattr(state, "responses_store", None)
    if store is None:
        args = state.ctx.server_args
        size = args.get("responses_store_size")
        mb = args.get("responses_store_mb")
        store = state.responses_store = ResponseStore(
            DEFAULT_STORE_SIZE if size is None else int(size),
            int((DEFAULT_STORE_MB if mb is None else float(mb)) * 2**20),
        )
    return store


def _not_stored(rid: str, store: ResponseStore) -> str:
    return (
        f"No response with id {rid!r} is stored on this server: a response made with store=false is "
        f"not kept, and the store keeps the {store.capacity} most recently used "
        f"(--responses-store-size)."
    )


def _check_request(req: ResponsesRequest) -> None:
    if req.background:
        raise bad_request("'background' responses are not supported; leave it false (or stream).", "background")
    if req.conversation is not None:
        raise bad_request(
            "'conversation' is not supported: continue a stored response with 'previous_response_id', "
            "or send the whole conversation as 'input'.",
            "conversation",
        )
    unknown = [v for v in req.include or [] if v not in INCLUDABLE]
    if unknown:
        raise bad_request(f"'include' has {unknown[0]!r}; expected any of {', '.join(INCLUDABLE)}.", "include")
    md = req.metadata or {}
    if len(md) > MAX_METADATA_PAIRS or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in md.items()
    ):
        raise bad_request(
            f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
            f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}.",
            "metadata",
        )


def _prepare(
    req: ResponsesRequest,
    prev: Optional[StoredResponse],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], ChatCompletionRequest, Conversation]:
    """The stored conversation, the new input items, and the chat request of
    both with its `Conversation`. Blocking and O(size of the conversation):
    run off the event loop."""
    new_items = input_items(req)
    history = drop_unanswered_cuts(prev.conversation(), new_items) if prev is not None else []
    chat, conv = to_chat_request(req, history, new_items)
    return history, new_items, chat, conv


# ---------------------------------------------------------------------- routes
def _skeleton(req: ResponsesRequest, rid: str, model: str, plan: ChatPlan) -> dict[str, Any]:
    """The response object's fields that do not depend on the output."""
    fmt = req.text.format if req.text is not None else None
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "background": False,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": plan.tools.parallel,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "error": None,
        "incomplete_details": None,
    }


@router.post("/v1/responses")
async def create_response(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    req = await read_model(request, ResponsesRequest, ("input", ctx.tm.context_length))
    _check_request(req)
    store = responses_store(request)
    prev = None
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise bad_request(_not_stored(req.previous_response_id, store), "previous_response_id")
    tm = ctx.tm
    history, new_items, chat, conv = await tm.run_tokenize(_prepare, req, prev)
    try:
        plan = await plan_chat(chat, ctx, ctx.is_admin(request))
    except ServerError as e:
        if e.status != 400:
            raise
        if req.truncation == "auto" and "context" in e.message:  # taken as vLLM and SGLang take it
            e = ServerError(400, e.message + " ('truncation': 'auto' drops no input here.)", e.param, e.err_type)
        raise conv.renamed(e) from None
    rid = new_id("resp")

    def on_done(body: dict[str, Any]) -> None:
        if req.store:  # a cut call too: the next request may answer it (or not: drop_unanswered_cuts)
            store.put(rid, body, history + new_items + body["output"], listed_inputs(new_items))

    group = tm.submit([plan.spec], validated=True)
    view = ResponseView(
        _skeleton(req, rid, ctx.answering_model(plan.spec.lora), plan),
        group,
        len(plan.spec.input_ids),
        plan.parser,
        plan.reasoning,
        plan.remember,
        on_done,
        tokenizer=tm.tokenizer,
        logprobs=LOGPROBS_INCLUDE in (req.include or []),
    )
    return await answer_view(request, tm, group, view, bool(req.stream))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: Optional[str] = None) -> Response:
    if stream not in (None, "false"):  # OpenAI replays a background response's events: none here
        raise bad_request("'stream' is not supported on a stored response: it is answered whole.", "stream")
    entry = responses_store(request).get(response_id)
    if entry is None:
        raise ServerError(404, _not_stored(response_id, responses_store(request)), "response_id")
    return Response(entry.body, media_type="application/json")


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str, request: Request, order: str = "desc", after: Optional[str] = None, limit: Optional[str] = None
) -> Response:
    entry = responses_store(request).get(response_id)
    if entry is None:
        raise ServerError(404, _not_stored(response_id, responses_store(request)), "response_id")
    return JSON(page(entry.input_items(), order, after, limit))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    store = responses_store(request)
    if not store.delete(response_id):
        raise ServerError(404, _not_stored(response_id, store), "response_id")
    return JSON({"id": response_id, "object": "response", "deleted": True})
