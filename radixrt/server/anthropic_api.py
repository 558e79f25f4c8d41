"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``,
for agents built on the ``anthropic`` SDK (``base_url`` pointed at this server, the API key
as ``x-api-key``).

A Messages request becomes a chat request (`anthropic_input`) and takes the chat route's own
path (`openai_api.plan_chat`): the same checks of tools and tool_choice, the same prompt
rendering (so the radix cache serves a conversation's earlier turns), the same grammar
enforcing calls, the same sampling. The answer is written by `anthropic_render`; errors come
in Anthropic's shape (`radixrt.server.errors.anthropic_error_body`). ``count_tokens`` answers
how many tokens that prompt takes.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.server.anthropic_input import Translation, to_chat_request
from radixrt.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from radixrt.server.anthropic_render import MessageView
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import ServerError
from radixrt.server.http_utils import JSON, answer_view, read_model
from radixrt.server.openai_api import ChatPlan, plan_chat
from radixrt.server.protocol import ChatCompletionRequest

router = APIRouter()


async def _plan(chat: ChatCompletionRequest, t: Translation, ctx: ServerContext, request: Request) -> ChatPlan:
    """`plan_chat`, its 400s naming the Anthropic request's fields."""
    try:
        return await plan_chat(chat, ctx, ctx.is_admin(request))
    except ServerError as e:
        if e.status != 400:
            raise
        raise t.renamed(e) from None


@router.post("/v1/messages")
async def create_message(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    tm = ctx.tm
    req = await read_model(request, MessagesRequest, ("messages", tm.context_length))
    chat, t = await tm.run_tokenize(to_chat_request, req)
    plan = await _plan(chat, t, ctx, request)
    group = tm.submit([plan.spec], validated=True)
    view = MessageView(
        group,
        len(plan.spec.input_ids),
        ctx.answering_model(plan.spec.lora),
        plan.parser,
        plan.reasoning,
        req.stop_sequences,
        plan.remember,
    )
    return await answer_view(request, tm, group, view, bool(req.stream))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    req = await read_model(request, CountTokensRequest, ("messages", ctx.tm.context_length))
    chat, t = await ctx.tm.run_tokenize(to_chat_request, req)
    plan = await _plan(chat, t, ctx, request)
    return JSON({"input_tokens": len(plan.spec.input_ids)})
