"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``.

Requests are pydantic models (`radixrt.server.protocol`); their prompts go
through the front door (`radixrt.requests.intake`) like every other request,
and the answers are built by `radixrt.server.openai_render`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from radixrt.requests.intake import PromptBatch, RequestSpec, build_specs, split_prompts
from radixrt.requests.reasoning import reasoning_mode
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import as_bad_request, bad_request
from radixrt.server.http_utils import JSON, answer_view, read_model
from radixrt.server.openai_checks import (
    bad_words_sampling,
    check_limits,
    constraint_sampling,
    sampling_of,
    truncated,
    validate_specs,
)
from radixrt.server.openai_render import ChatView, CompletionView
from radixrt.server.protocol import ChatCompletionRequest, CompletionRequest, join_text_parts
from radixrt.server.special_text import special_text
from radixrt.server.tokenizer_manager import TokenizerManager
from radixrt.server.tools import ToolCallParser, ToolError, ToolRequest, check_tools, get_parser, template_renders_tools
from radixrt.server.tools.conversation import check_tool_turns
from radixrt.server.tools.grammar import tool_call_structural_tag
from radixrt.server.tools.render import render_messages
from radixrt.server.tools.turns import TURNS, mark_turns, split_encode

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: ServerContext = Depends(server_context)) -> Response:
    """The served model (under each of its served names), then one entry per LoRA adapter (its name
    as ``id``, its ``parent`` the model), as SGLang and vLLM list them."""
    base = {
        "id": ctx.served_model_name,
        "object": "model",
        "created": int(ctx.started),
        "owned_by": "radixrt",
        "root": ctx.resolved_model_path,
        "max_model_len": ctx.tm.context_length,
    }
    adapters = [
        {**base, "id": name, "root": name, "parent": ctx.served_model_name} for name in sorted(ctx.lora_adapters)
    ]
    others = [{**base, "id": name} for name in ctx.other_served_names]  # vLLM lists every served name
    return JSON({"object": "list", "data": [base, *others, *adapters]})


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, ctx: ServerContext = Depends(server_context)) -> Response:
    """The served model under any of its names, or a LoRA adapter's entry as ``/v1/models`` lists it
    (OpenAI's retrieve takes any listed id); 404 for another name."""
    lora = ctx.lora_of(model_id)
    entry = {"id": ctx.answering_model(lora), "object": "model", "created": int(ctx.started), "owned_by": "radixrt"}
    return JSON({**entry, "root": lora, "parent": ctx.served_model_name} if lora else entry)


# ---------------------------------------------------------------------- completions
def _completion_prompts(req: CompletionRequest, tm: TokenizerManager) -> PromptBatch:
    """``prompt`` (a string, a list of ids, or a list of either) through the front door."""
    if req.suffix:
        raise bad_request("'suffix' is not supported.", "suffix")
    p = req.prompt
    if not isinstance(p, (str, list)):
        raise bad_request(
            "'prompt' must be a string, a list of strings, a list of token ids (integers) or a list of such lists.",
            "prompt",
        )
    if isinstance(p, list) and not p:
        raise bad_request("'prompt' must not be empty.", "prompt")
    is_text = isinstance(p, str) or isinstance(p[0], str)
    with as_bad_request():
        return split_prompts(
            p if is_text else None,
            None if is_text else p,
            functools.partial(tm.encode, field="prompt", fit=req.truncate_prompt_tokens is None),
            text_name="prompt",
            ids_name="prompt",
            limits=tm.limits,
            each=max(req.n, req.beam_width or 0, (req.best_of or 0) if req.use_beam_search else 0),
        )


def _completion_specs(
    req: CompletionRequest,
    prompts: PromptBatch,
    admin: bool = False,
    defaults: Optional[dict] = None,
    bans: Optional[dict] = None,
) -> list[RequestSpec]:
    """One spec per prompt, each with max_tokens (16 unless given), ``defaults`` (the model's
    sampling settings) where the request leaves a field unset, and ``bans`` (`bad_words_sampling`).
    ``admin``: the request presented the admin key (any 64-bit ``priority``)."""
    extra = {**constraint_sampling(req), **(bans or {})}
    sampling = [sampling_of(req, req.max_tokens, extra, defaults) for _ in prompts.ids]
    want_lp, prompt_k = req.logprobs is not None, req.prompt_logprobs
    with as_bad_request():
        return build_specs(
            prompts,
            sampling_params=sampling if prompts.batch else sampling[0],
            return_logprob=want_lp or prompt_k is not None,
            logprob_start_len=0 if ((want_lp and req.echo) or prompt_k is not None) else -1,
            top_logprobs_num=max(req.logprobs or 0, prompt_k or 0),
            rid=(req.rid or None) if len(prompts.ids) == 1 else None,
            cache_salt=req.cache_salt,
            extra_key=req.extra_key,
            prompt_cache_key=req.prompt_cache_key,
            priority=req.priority,
            return_cache_info=req.return_cache_info,
            admin=admin,
            return_hidden_states=bool(req.return_hidden_states),
        )


def _completion_plan(
    req: CompletionRequest, tm: TokenizerManager, admin: bool
) -> tuple[PromptBatch, list[RequestSpec]]:
    """The prompts and their validated specs (blocking: tokenizes; run off the event loop)."""
    prompts = _completion_prompts(req, tm)
    for i, ids in enumerate(prompts.ids):
        kept = truncated(ids, req.truncate_prompt_tokens, tm.context_length)
        if len(kept) < len(ids):
            prompts.ids[i], prompts.texts[i] = kept, None  # an echo shows what the model read
    specs = _completion_specs(req, prompts, admin, tm.sampling_defaults, bad_words_sampling(req, tm.tokenizer))
    validate_specs(tm, specs)
    return prompts, specs


@router.post("/v1/completions")
async def completions(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    req = await read_model(request, CompletionRequest)
    per_prompt = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path]
    named = {path: ctx.lora_of(req.model, path) for path in set(per_prompt)}  # each name checked once
    loras = [named[path] for path in per_prompt]
    ctx.check_cache_info(request, req.return_cache_info)
    tm = ctx.tm
    tm.check_alive()
    check_limits(req, tm, {"logprobs": req.logprobs, "prompt_logprobs": req.prompt_logprobs})
    prompts, specs = await tm.run_tokenize(_completion_plan, req, tm, ctx.is_admin(request))
    if not isinstance(req.lora_path, list):
        loras *= len(specs)
    elif len(loras) != len(specs):
        raise bad_request(f"'lora_path' lists {len(loras)} adapters for {len(specs)} prompts.", "lora_path")
    for spec, lora in zip(specs, loras):
        spec.lora = lora
    group = tm.submit(specs, validated=True)
    answering = ctx.answering_model(loras[0] if len(set(loras)) == 1 else None)
    view = CompletionView(req, group, prompts, tm.tokenizer, answering)
    return await answer_view(request, tm, group, view, req.stream)


# ---------------------------------------------------------------------- chat
def _content_text(i: int, m: Any) -> Optional[str]:
    """Message ``i``'s content as text: text parts joined (and an assistant's refusal parts, which
    are text); a 400 for a missing user or system content, or a part of another kind."""
    content = m.content
    if m.role in ("user", "system", "developer") and not (isinstance(content, str) or content):
        raise bad_request(
            f"messages[{i}].content is required for a '{m.role}' message: a string or a non-empty list of "
            f"text parts (got {'an empty list' if content == [] else 'null'}).",
            f"messages.{i}.content",
        )
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        text = part.refusal if part.type == "refusal" else part.text
        if part.type not in ("text", "refusal") or text is None or (part.type == "refusal" and m.role != "assistant"):
            why = {"text": "has no 'text'", "refusal": "belongs to an assistant message, with its 'refusal'"}.get(
                part.type, "is not supported by this model (text only)"
            )
            raise bad_request(f"messages[{i}].content: a '{part.type}' part {why}.", f"messages.{i}.content")
        parts.append(text)
    return join_text_parts(parts)


def _chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as chat-template dicts (text parts joined; developer -> system),
    their tool calls and tool messages checked (`check_tool_turns`: 400 naming the field).
    OpenAI's deprecated ``function_call`` of an assistant message is its one tool call, and the
    ``function`` message after it that call's tool message."""
    messages, legacy_call = [], None
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content_text(i, m)}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key):
                msg[key] = getattr(m, key)
        if m.role == "assistant" and m.function_call is not None and not m.tool_calls:
            legacy_call = f"call_function_{i}"
            msg["tool_calls"] = [{"id": legacy_call, "type": "function", "function": m.function_call}]
        if m.role == "function":  # answers the function_call before it, once (as a tool message its call)
            if legacy_call is None:
                raise bad_request(
                    f"messages[{i}] is a 'function' message, but it must answer the function_call of the "
                    "assistant message before it.",
                    f"messages.{i}.role",
                )
            msg.update(role="tool", tool_call_id=legacy_call)
            legacy_call = None
        if m.role == "assistant" and (m.reasoning_content or m.reasoning):
            msg["reasoning_content"] = m.reasoning_content or m.reasoning  # as the template reads it
        messages.append(msg)
    try:
        check_tool_turns(messages)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    for msg in messages:
        msg["content"] = msg["content"] or ""
    return messages


def _chat_prompt_ids(
    req: ChatCompletionRequest,
    messages: list[dict],
    tm: TokenizerManager,
    tools: Optional[list[dict]] = None,
    reuse_turns: bool = False,
) -> list[int]:
    """The rendered chat template, tokenized (without a second BOS). ``tools``
    goes to a template that renders them itself. With ``reuse_turns``,
    assistant turns the model generated keep the tokens it generated them with
    (radixrt/server/tools/turns.py)."""
    from radixrt.requests.tokenizer_utils import TEMPLATE_CONTROL_KEYS, apply_chat_template

    cont = req.continue_final_message and messages[-1]["role"] == "assistant"
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise bad_request(  # as vLLM: the final message is continued, so no new turn opens
            "'continue_final_message' and 'add_generation_prompt' cannot both be true.", "add_generation_prompt"
        )
    extra_tpl = dict(req.chat_template_kwargs or {})
    control = sorted(k for k in extra_tpl if k in TEMPLATE_CONTROL_KEYS)  # a client's own template, say
    if control:
        why = f"it holds the chat template's variables, not these arguments: {', '.join(sorted(TEMPLATE_CONTROL_KEYS))}"
        raise bad_request(
            f"'chat_template_kwargs' may not set {control[0]!r}: {why}.", f"chat_template_kwargs.{control[0]}"
        )
    if tools:
        extra_tpl["tools"] = tools
    if req.reasoning_effort is not None:
        extra_tpl.setdefault("reasoning_effort", req.reasoning_effort)
    original = messages
    marked, spliced = mark_turns(messages, TURNS if reuse_turns else None, special_text(tm.tokenizer), not cont)
    if spliced:
        messages = marked
    try:
        prompt = apply_chat_template(
            tm.tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=cont,
            extra=extra_tpl,
        )
    except Exception as e:  # noqa: BLE001 - a template may reject a conversation
        raise bad_request(f"The chat template cannot render these messages: {e}", "messages") from None
    bos = getattr(tm.tokenizer, "bos_token", None)
    fit = req.truncate_prompt_tokens is None  # else the caller keeps the prompt's last tokens

    def first(text: str) -> list[int]:
        return tm.encode(text, not (bos and text.startswith(bos)), "messages", fit)

    if spliced:
        ids = split_encode(prompt, spliced, first, lambda t: tm.encode(t, False, "messages", fit) if t else [])
        if ids is not None:
            return ids
        if reuse_turns:
            return _chat_prompt_ids(req, original, tm, tools)  # the template changed a turn: plain tokens
        raise bad_request(
            "A message's content spells a special token, which is read as text, and this chat template "
            "does not render message contents verbatim.",
            "messages",
        )
    return first(prompt)


def _chat_tools(req: ChatCompletionRequest, parser: ToolCallParser, settings: Optional[dict] = None) -> ToolRequest:
    """The request's tools and tool_choice, checked (400 naming the bad tool)
    against the server's ``settings`` (``max_tools``, ``max_tools_chars``).
    Blocking: parses every tool's schema (run it off the event loop)."""
    settings = settings or {}
    try:
        tr = check_tools(
            req.tools,
            req.tool_choice,
            req.parallel_tool_calls,
            flat=req._flat_tools,
            max_tools=settings.get("max_tools"),
            max_chars=settings.get("max_tools_chars"),
        )
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    if tr.enforced and (req.regex or req.json_schema or req.ebnf):
        raise bad_request(
            f"'tool_choice' {req.tool_choice!r} constrains the output to tool calls; it cannot be "
            f"combined with regex, json_schema or ebnf.",
            "tool_choice",
        )
    return tr


def _native(parser: ToolCallParser, tm: TokenizerManager) -> bool:
    """Tools are rendered by the model's chat template (else in the generic format)."""
    return parser.name != "generic" and template_renders_tools(getattr(tm.tokenizer, "chat_template", None))


def _chat_spec(
    req: ChatCompletionRequest,
    tm: TokenizerManager,
    parser: ToolCallParser,
    tr: ToolRequest,
    reasoning: str = "",
    admin: bool = False,
) -> RequestSpec:
    """The one spec of a chat request; without a token limit it may fill the
    context. ``admin``: the request presented the admin key (any 64-bit ``priority``).

    Tools are rendered by the chat template when it renders tools (and the
    parser is not forced to ``generic``), else in the generic format; while
    calls are on, their grammar (a structural tag) constrains the output unless
    the request brings its own constraint."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true.", "top_logprobs")
    native = _native(parser, tm)
    try:
        messages, tools_arg = render_messages(_chat_messages(req), tr, parser, native)
    except ToolError as e:
        raise bad_request(str(e), e.param) from None
    ids = _chat_prompt_ids(req, messages, tm, tools_arg, reuse_turns=bool(tr.tools) and not native)
    ids = truncated(ids, req.truncate_prompt_tokens, tm.context_length)
    # response_format shapes a text answer, which an enforced tool_choice rules out in this turn (as OpenAI)
    extra = {} if tr.enforced else constraint_sampling(req)
    if not extra and not (req.regex or req.json_schema or req.ebnf):
        tag = tool_call_structural_tag(parser, tr, reasoning)
        if tag is not None:
            extra["structural_tag"] = tag
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is None:  # what the context holds (and the KV pool, unless a KV budget bounds the request's)
        room = tm.context_length if req.kv_budget is not None else min(tm.context_length, tm.kv_total_slots)
        max_new = max(room - len(ids), 0)
    with as_bad_request():
        specs = build_specs(
            PromptBatch([ids], [None], False, "messages"),
            sampling_params=sampling_of(
                req, max_new, {**extra, **bad_words_sampling(req, tm.tokenizer)}, tm.sampling_defaults
            ),
            return_logprob=req.logprobs or req.prompt_logprobs is not None,
            logprob_start_len=-1 if req.prompt_logprobs is None else 0,
            top_logprobs_num=max((req.top_logprobs or 0) if req.logprobs else 0, req.prompt_logprobs or 0),
            rid=req.rid or None,
            cache_salt=req.cache_salt,
            extra_key=req.extra_key,
            prompt_cache_key=req.prompt_cache_key,
            priority=req.priority,
            return_cache_info=req.return_cache_info,
            admin=admin,
            return_hidden_states=bool(req.return_hidden_states),
        )
    return specs[0]


def _checked_chat(
    req: ChatCompletionRequest,
    tm: TokenizerManager,
    parser: ToolCallParser,
    reasoning: str,
    settings: dict,
    admin: bool,
) -> tuple[ToolRequest, RequestSpec]:
    """The tools and the validated spec of a chat request. Blocking and
    O(size of the request): checks every tool, renders, tokenizes, validates
    (`plan_chat` runs it off the event loop)."""
    tr = _chat_tools(req, parser, settings)
    spec = _chat_spec(req, tm, parser, tr, reasoning, admin)
    validate_specs(tm, [spec])
    return tr, spec


@dataclass
class ChatPlan:
    """A checked chat request, ready to submit: its one spec (already validated:
    ``tm.submit([plan.spec], validated=True)``) and how to read its output."""

    spec: RequestSpec
    tools: ToolRequest
    parser: Optional[ToolCallParser]  # reads tool calls from the output; None while calls are off
    reasoning: str  # how a <think> block goes to reasoning_content (reasoning.reasoning_mode; "": it does not)
    remember: Optional[Callable[[str, list[int]], None]]  # sees each finished choice's text and ids


async def plan_chat(req: ChatCompletionRequest, ctx: ServerContext, admin: bool = False) -> ChatPlan:
    """Everything /v1/chat/completions does before submitting (also used by
    /v1/responses, whose requests become chat requests): the model name, the
    server's limits, tools and tool_choice, the prompt, the sampling params
    and the grammar that enforces calls, each refused with a 400 naming the
    field. ``admin``: the request presented the admin key (any 64-bit ``priority``).
    A ``model`` naming a LoRA adapter (``"<adapter>"`` or ``"<model>:<adapter>"``) runs it."""
    lora = ctx.lora_of(req.model, req.lora_path)
    tm = ctx.tm
    tm.check_alive()
    check_limits(
        req, tm, {"top_logprobs": req.top_logprobs if req.logprobs else None, "prompt_logprobs": req.prompt_logprobs}
    )
    settings = ctx.server_args
    parser = get_parser(settings.get("tool_call_parser"), getattr(tm.tokenizer, "chat_template", None))
    reasoning = reasoning_mode(req.separate_reasoning, settings.get("reasoning_parser"))
    tr, spec = await tm.run_tokenize(_checked_chat, req, tm, parser, reasoning, settings, admin)
    spec.lora = lora
    remember = None
    if tr.tools and not _native(parser, tm):

        def remember(text: str, ids: list[int]) -> None:
            TURNS.remember(text, ids, lambda x: tm.tokenizer.decode(x, skip_special_tokens=False))

    return ChatPlan(spec, tr, parser if tr.active else None, reasoning, remember)


@router.post("/v1/chat/completions")
@router.post("/invocations")  # SageMaker's route for it
async def chat_completions(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    req = await read_model(request, ChatCompletionRequest, ("messages", ctx.tm.context_length))
    ctx.check_cache_info(request, req.return_cache_info)
    plan = await plan_chat(req, ctx, ctx.is_admin(request))
    tm = ctx.tm
    group = tm.submit([plan.spec], validated=True)
    view = ChatView(
        req,
        group,
        len(plan.spec.input_ids),
        tm.tokenizer,
        ctx.answering_model(plan.spec.lora),
        plan.parser,
        plan.reasoning,
        plan.remember,
    )
    return await answer_view(request, tm, group, view, req.stream)
