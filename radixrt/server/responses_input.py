"""A /v1/responses request as the chat request that answers it.

`to_chat_request` makes the chat messages: ``instructions`` as a system
message, then the conversation of ``previous_response_id`` (its input and
output items), then the new ``input`` items:

* a ``message`` item is a message of its role, its text parts joined;
* a ``function_call`` item is a call in the ``tool_calls`` of the assistant
  message right before it (the text the model wrote before its calls), or
  of a new assistant message; a call cut by the token limit (``status``
  ``incomplete``) whose arguments are not a JSON object yet has ``{}``;
* a ``function_call_output`` item is a ``tool`` message;
* ``reasoning`` items are left out (chat templates drop earlier reasoning).

``max_output_tokens``, ``text.format`` and the sampling fields become the
chat fields of the same meaning; ``tools`` and ``tool_choice`` pass as they
are, checked in their flat Responses shapes.

`Conversation.rename` turns the chat path's error messages and fields back
into the Responses request's words: ``messages[3].tool_call_id`` becomes
``input[1].call_id`` (the item that made message 3), ``response_format``
becomes ``text.format``, ``max_tokens`` ``max_output_tokens``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from pydantic import ValidationError

from radixrt.server.errors import ServerError, bad_request
from radixrt.server.openai_checks import check_schema_name
from radixrt.server.protocol import ChatCompletionRequest, join_text_parts
from radixrt.server.responses_protocol import LOGPROBS_INCLUDE, InputError, ResponsesRequest, parse_input

TEXT_PARTS = ("input_text", "output_text", "text")
HISTORY = "previous_response_id"  # what errors in the stored conversation name

# chat field -> Responses field, per item kind (after "messages[i]" / "messages[i].tool_calls[j]")
_CALL_FIELDS = {
    ".function.name": ".name",
    ".function.arguments": ".arguments",
    ".function": "",
    ".id": ".call_id",
    ".type": ".type",
}
_TOOL_FIELDS = {".tool_call_id": ".call_id", ".content": ".output", ".role": ""}
_MESSAGE_REF = re.compile(r"messages(?:\[(\d+)\]|\.(\d+))(?:\.tool_calls(?:\[(\d+)\]|\.(\d+)))?((?:\.[A-Za-z_]+)*)")
_FIELD_NAMES = [
    (re.compile(r"\bmessages\b"), "input"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
]


def as_param(where: str) -> str:
    """``input[3].content[1]`` -> ``input.3.content.1`` (an error's ``param``)."""
    return where.replace("[", ".").replace("]", "")


def content_text(content: Any, where: str) -> str:
    """A message's (or a call output's) content as text; only text parts."""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in TEXT_PARTS or part.get("text") is None:
            why = "has no 'text'" if kind in TEXT_PARTS else "is not supported by this model (text only)"
            raise bad_request(f"{where}.content[{j}]: a {kind!r} part {why}.", as_param(f"{where}.content[{j}]"))
        parts.append(part["text"])
    return join_text_parts(parts)


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as item dicts (`parse_input`; a 400 naming the field)."""
    try:
        return parse_input(req.input)
    except InputError as e:
        raise bad_request(str(e), as_param(e.where)) from None


def _json_object(text: Any) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def drop_unanswered_cuts(history: list[dict[str, Any]], new_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored conversation without its calls cut by the token limit that ``new_items`` do not
    answer: a continuation may answer every call of the response before (as OpenAI requires), or
    go on without the cut one."""
    answered = {i.get("call_id") for i in new_items if i.get("type") == "function_call_output"}
    return [
        i
        for i in history
        if not (i.get("type") == "function_call" and i.get("status") == "incomplete" and i["call_id"] not in answered)
    ]


class Conversation:
    """Chat messages made of Responses items, and which item made each."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.origins: list[str] = []  # per message: the item that made it ("input[2]", "instructions")
        self.call_origins: dict[tuple[int, int], str] = {}  # (message, call) -> its function_call item

    def add(self, origin: str, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.origins.append(origin)

    def add_item(self, where: str, item: dict[str, Any]) -> None:
        kind = item.get("type", "message")
        if kind == "message":
            self.add(where, {"role": item["role"], "content": content_text(item["content"], where)})
        elif kind == "function_call":
            arguments = item["arguments"]
            if item.get("status") == "incomplete" and not _json_object(arguments):
                arguments = "{}"  # cut by the token limit: what it wrote is no call's arguments
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            }
            last = self.messages[-1] if self.messages else None
            if last is None or last["role"] != "assistant":
                self.add(where, {"role": "assistant", "content": None})
                last = self.messages[-1]
            calls = last.setdefault("tool_calls", [])
            self.call_origins[(len(self.messages) - 1, len(calls))] = where
            calls.append(call)
            last["content"] = last["content"] or None
        elif kind == "function_call_output":
            self.add(
                where, {"role": "tool", "tool_call_id": item["call_id"], "content": content_text(item["output"], where)}
            )
        elif kind == "item_reference":
            raise bad_request(
                f"{where}: 'item_reference' items are not supported; send the item itself, or "
                f"continue a stored response with 'previous_response_id'.",
                as_param(where),
            )

    def _ref(self, m: re.Match) -> str:
        i = int(m.group(1) or m.group(2))
        call = m.group(3) or m.group(4)
        rest = m.group(5)
        if i >= len(self.origins):
            return m.group(0)
        origin = self.origins[i] if call is None else self.call_origins.get((i, int(call)), self.origins[i])
        if not origin.startswith("input"):  # instructions, the stored conversation: a field, no item to name
            return origin
        if call is not None:
            return origin + _CALL_FIELDS.get(rest, rest)
        return origin + (_TOOL_FIELDS.get(rest, rest) if self.messages[i]["role"] == "tool" else rest)

    def rename(self, text: str) -> str:
        """A chat error message or field in the Responses request's words (module docstring)."""
        text = _MESSAGE_REF.sub(self._ref, text)
        for pattern, name in _FIELD_NAMES:
            text = pattern.sub(name, text)
        return text

    def renamed(self, e: ServerError) -> ServerError:
        """``e`` (a 400 of the chat path) in the Responses request's words."""
        param = as_param(self.rename(e.param)) if e.param else None
        return bad_request(self.rename(e.message), param)


def _text_format(req: ResponsesRequest) -> Optional[dict[str, Any]]:
    """``text.format`` as the chat route's ``response_format``."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("'text.format' of type 'json_schema' needs a 'schema'.", "text.format")
    check_schema_name(fmt.name, "text.format.name")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


def to_chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], new_items: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, Conversation]:
    """The chat request that answers ``req`` after the stored conversation
    ``history``, and its conversation (for `Conversation.renamed`)."""
    conv = Conversation()
    if req.instructions:
        conv.add("instructions", {"role": "system", "content": req.instructions})
    for item in history:
        conv.add_item(HISTORY, item)
    for i, item in enumerate(new_items):
        conv.add_item(f"input[{i}]", item)
    if not conv.messages:
        raise bad_request("'input' must not be empty.", "input")
    fields = {
        "model": req.model,
        "messages": conv.messages,
        "tools": req.tools,
        "tool_choice": req.tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "kv_budget": req.kv_budget,
        "kv_budget_policy": req.kv_budget_policy,
        "cache_salt": req.cache_salt,
        "prompt_cache_key": req.prompt_cache_key,
        "priority": req.priority,
        "user": req.user,
        "response_format": _text_format(req),
    }
    if LOGPROBS_INCLUDE in (req.include or []):
        fields.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        field = conv.rename(".".join(str(p) for p in err.get("loc", ())))
        raise bad_request(f"Invalid value for '{field}': {err.get('msg')}", as_param(field)) from None
    chat._flat_tools = True
    return chat, conv
