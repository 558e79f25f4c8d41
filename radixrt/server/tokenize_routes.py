"""``POST /tokenize`` and ``POST /detokenize`` (also under ``/v1/``), in the
shapes vLLM and SGLang serve.

``/tokenize`` body: ``model`` (optional; checked like the OpenAI routes),
and exactly one of

* ``prompt``: a string, or a list of strings (SGLang's batch form), with
  ``add_special_tokens`` (default true: the BOS the model's tokenizer adds);
* ``messages``: a chat conversation, rendered and tokenized exactly as
  ``/v1/chat/completions`` renders it (the same code: chat template, tools,
  ``chat_template_kwargs``, ``continue_final_message``, generation prompt),
  so the ids are the prompt a chat request with these fields computes
  (``add_generation_prompt``, default true, as the chat route takes it).

``return_token_strs`` (vLLM) adds each id's vocabulary string. Answer:
``{"tokens", "count", "max_model_len"}`` (+ ``token_strs``); for a list of
prompts ``tokens``, ``count`` (and ``token_strs``) are lists, one per prompt.
A prompt may be longer than the context (its count is what the caller wants
to know), up to the size every route refuses before tokenizing; a list holds
at most ``--max-request-sequences`` prompts, as a ``/generate`` call.

``/detokenize`` body: ``model`` (optional), ``tokens``: a list of ids or a
list of such lists. Answer: ``{"prompt", "text"}`` (vLLM names it prompt,
SGLang text; both hold the same decoded string, or a list of strings for a
batch). Special tokens are kept. Ids outside the vocabulary are a 400, and so
are more than ``--max-request-sequences`` lists or more ids in all than the KV
pool holds.

Tokenizing and decoding run in the tokenizer manager's worker threads, off
the event loop.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from starlette.responses import Response

from radixrt.requests.intake import check_prompt_count
from radixrt.requests.no_tokenizer import SKIPPED, has_text
from radixrt.requests.token_id_lists import bad_token_ids, is_int
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import as_bad_request, bad_request
from radixrt.server.http_utils import JSON, read_json
from radixrt.server.tokenizer_manager import TokenizerManager

router = APIRouter()

_TOKENIZE_KEYS = {
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "return_token_strs",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
}
_DETOKENIZE_KEYS = {"model", "tokens"}


def _body(body: Any, known: set[str], route: str, ctx: ServerContext) -> dict:
    """``body`` as a dict of known fields whose model is served; 400/404 else."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for key in body:
        if key not in known:
            raise bad_request(f"Unknown field '{key}' in the {route} request.", key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")
    ctx.check_model(model)
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean.", name)
    return value


def _encode_texts(tm: TokenizerManager, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text; a text too large for any route is refused
    before tokenizing (as `TokenizerManager.encode` does), but not one that
    merely exceeds the context."""
    out = []
    for text in texts:
        if len(text) > tm.max_prompt_chars:
            raise bad_request(
                f"the prompt is {len(text)} characters long; this server tokenizes at most {tm.max_prompt_chars}",
                "prompt",
            )
        try:
            out.append(list(tm.tokenizer.encode(text, add_special_tokens=add_special_tokens)))
        except UnicodeEncodeError:
            raise bad_request("the prompt holds a lone surrogate, which is not a Unicode character", "prompt") from None
    return out


def _chat_ids(body: dict, ctx: ServerContext) -> list[int]:
    """The prompt ids ``/v1/chat/completions`` computes for these messages
    (its own request model and spec builder)."""
    from radixrt.server import openai_api
    from radixrt.server.protocol import ChatCompletionRequest

    fields = {
        k: body[k]
        for k in ("messages", "tools", "tool_choice", "chat_template_kwargs", "continue_final_message")
        if body.get(k) is not None
    }
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    if body.get("add_generation_prompt") is not None:
        fields["add_generation_prompt"] = add_generation_prompt  # true with continue_final_message: a 400 there
    elif fields.get("continue_final_message"):
        fields["add_generation_prompt"] = False  # the chat route's (vLLM's): not with continue_final_message
    try:
        req = ChatCompletionRequest.model_validate({**fields, "model": ctx.served_model_name})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"Invalid value for '{where}': {first.get('msg')}", where or "messages") from None
    tm = ctx.tm
    parser = openai_api.get_parser(
        ctx.server_args.get("tool_call_parser"), getattr(tm.tokenizer, "chat_template", None)
    )
    tools = openai_api._chat_tools(req, parser, ctx.server_args)
    return list(openai_api._chat_spec(req, tm, parser, tools).input_ids)


def tokenize_body(body: dict, ctx: ServerContext) -> dict:
    """The /tokenize answer for a checked ``body`` (blocking: tokenizes)."""
    tm = ctx.tm
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("Give exactly one of 'prompt' or 'messages'.", "prompt")
    want_strs = _flag(body, "return_token_strs", False)
    batch = False
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of messages.", "messages")
        ids = [_chat_ids(body, ctx)]
    else:
        add_special = _flag(body, "add_special_tokens", True)
        if isinstance(prompt, str):
            texts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts, batch = list(prompt), True
        else:
            raise bad_request("'prompt' must be a string or a non-empty list of strings.", "prompt")
        with as_bad_request():  # as many prompts as /generate takes: the tokenizer threads are shared
            check_prompt_count(len(texts), tm.limits, "prompt")
        ids = _encode_texts(tm, texts, add_special)
    strs = [list(tm.tokenizer.convert_ids_to_tokens(x)) for x in ids] if want_strs else None
    out: dict[str, Any] = {
        "tokens": ids if batch else ids[0],
        "count": [len(x) for x in ids] if batch else len(ids[0]),
        "max_model_len": tm.context_length,
    }
    if strs is not None:
        out["token_strs"] = strs if batch else strs[0]
    return out


def _token_lists(tokens: Any, tm: TokenizerManager) -> tuple[list[list[int]], bool]:
    """(id lists, is_batch) from a list of ids or a list of such lists; 400 else, and for more
    lists than a /generate call takes or more ids in all than the KV pool holds (the answer's
    text is several times the size of the ids: a bound on what one call makes the server write)."""
    vocab_size = tm.vocab_size
    if isinstance(tokens, list) and all(is_int(t) for t in tokens):
        lists, batch = [tokens], False
    elif isinstance(tokens, list) and tokens and all(isinstance(x, list) and all(is_int(t) for t in x) for x in tokens):
        lists, batch = tokens, True
    else:
        raise bad_request("'tokens' must be a list of integers or a non-empty list of such lists.", "tokens")
    with as_bad_request():
        check_prompt_count(len(lists), tm.limits, "tokens")
    bound = max(tm.kv_total_slots, tm.context_length)
    if sum(map(len, lists)) > bound:
        raise bad_request(f"'tokens' holds more than {bound} ids in all, the most this server holds at once", "tokens")
    for x in lists:
        bad = bad_token_ids(x, vocab_size)
        if bad:
            raise bad_request(f"'tokens' holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", "tokens")
    return [[int(t) for t in x] for x in lists], batch


def detokenize_body(body: dict, ctx: ServerContext) -> dict:
    """The /detokenize answer for a checked ``body`` (blocking: decodes)."""
    tm = ctx.tm
    if "tokens" not in body:
        raise bad_request("'tokens' is required.", "tokens")
    lists, batch = _token_lists(body["tokens"], tm)
    if not has_text(tm.tokenizer):
        raise bad_request(f"{SKIPPED}: it cannot turn token ids into text", "tokens")
    texts = [tm.tokenizer.decode(x) for x in lists]
    text: Optional[Any] = texts if batch else texts[0]
    return {"prompt": text, "text": text}


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    body = _body(await read_json(request), _TOKENIZE_KEYS, "/tokenize", ctx)
    return JSON(await ctx.tm.run_tokenize(tokenize_body, body, ctx))


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    body = _body(await read_json(request), _DETOKENIZE_KEYS, "/detokenize", ctx)
    return JSON(await ctx.tm.run_tokenize(detokenize_body, body, ctx))
