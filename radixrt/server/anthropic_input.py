"""An Anthropic Messages request as the chat request that answers it.

`to_chat_request` makes the chat messages: ``system`` as a system message, then
each message in order:

* a user message's ``tool_result`` blocks become ``tool`` messages (in order,
  ``tool_use_id`` as their ``tool_call_id``), then its text blocks one user
  message;
* an assistant message's text blocks become its content and its ``tool_use``
  blocks its ``tool_calls`` (``input`` as the JSON ``arguments``);
* ``thinking`` blocks are left out (chat templates drop earlier reasoning).

A final assistant message of text is Anthropic's prefill: the answer continues it (chat's
``continue_final_message``), and, as Anthropic's API, it may not end with whitespace.

``tools`` become function tools (``input_schema`` as ``parameters``);
``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` becomes chat's ``auto`` /
``required`` / the named function / ``none``, ``disable_parallel_tool_use`` its
``parallel_tool_calls: false``; ``max_tokens``, ``stop_sequences``,
``temperature``, ``top_p`` and ``top_k`` the chat fields of the same meaning;
``thinking`` enabled asks for the reasoning split (``separate_reasoning``);
``output_config.format`` is chat's ``response_format`` of its JSON schema.
The chat path then checks and renders it all as ``/v1/chat/completions`` does;
its errors' ``messages[k]`` are renamed to the Anthropic message that made
chat message ``k`` (`Translation.renamed`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import ValidationError

from radixrt.server.anthropic_protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from radixrt.server.errors import ServerError, bad_request
from radixrt.server.protocol import ChatCompletionRequest, join_text_parts

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_MESSAGE_REF = re.compile(r"messages(?:\[(\d+)\]|\.(\d+))")
_TOOL_FIELD = re.compile(r"(?<=\])\.function\.(parameters|name|description)")  # tools[i].function.x
_STOP_FIELD = re.compile(r"(?<=')stop(?=')|^stop(?=$|[.\[])")  # chat's 'stop' (a message's, or the param)
# chat's words in the chat checks' messages, and Anthropic's for them
_CHAT_WORDS = (
    (".tool_call_id", ".tool_use_id"),
    ("'tool_choice' 'required'", "'tool_choice' 'any'"),
    (
        ".role' is 'tool', but a tool message must answer a preceding assistant message with 'tool_calls' "
        "(only tool messages between them)",
        "' is a tool_result block, but a tool_result must answer a tool_use block of the preceding assistant message",
    ),
)


@dataclass
class Translation:
    """The chat messages made so far, and the Anthropic field each came from."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)

    def add(self, origin: str, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.origins.append(origin)

    def rename(self, text: str) -> str:
        """``text`` with each ``messages[k]`` (or ``messages.k``) naming its Anthropic origin."""

        def origin(m: re.Match) -> str:
            k = int(m.group(1) or m.group(2))
            return self.origins[k] if k < len(self.origins) else m.group(0)

        text = _MESSAGE_REF.sub(origin, text).replace("response_format", "output_config.format")
        text = _STOP_FIELD.sub("stop_sequences", text)
        for chat, anthropic in _CHAT_WORDS:
            text = text.replace(chat, anthropic)
        return _TOOL_FIELD.sub(lambda m: ".input_schema" if m.group(1) == "parameters" else "." + m.group(1), text)

    def renamed(self, e: ServerError) -> ServerError:
        param = self.rename(e.param).replace("[", ".").replace("]", "") if e.param else e.param
        return ServerError(e.status, self.rename(e.message), param, e.err_type)


_READ = ("text", "tool_use", "tool_result")  # the block types read (a malformed one is named as such)


def _block_error(where: str, kind: str, role: str = "") -> ServerError:
    """The 400 for a block at ``where`` that cannot be served: malformed, out of place, or unsupported."""
    if kind in _READ or kind in ("thinking", "redacted_thinking"):
        what = f"a {role} message cannot hold a '{kind}' block" if role else f"not a valid '{kind}' block"
    else:
        what = (
            f"'{kind}' blocks are not supported: this server runs a text-only model without "
            "server tools; send text, tool_use and tool_result blocks"
        )
    return bad_request(f"{where}: {what}.", where.replace("[", ".").replace("]", ""))


def _text_of(blocks: Union[str, list[Any], None], where: str) -> str:
    """The text of a string or of text blocks (dicts or models); any other block is refused."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else getattr(b, "type", None)
        text = b.get("text") if isinstance(b, dict) else getattr(b, "text", None)
        if kind != "text" or not isinstance(text, str):
            raise _block_error(f"{where}[{j}]", str(kind))
        parts.append(text)
    return join_text_parts(parts)


def _user(t: Translation, m: Message, where: str) -> None:
    param = f"{where}.content".replace("[", ".").replace("]", "")
    if not m.content:
        raise bad_request(f"{where}: user messages must have non-empty content.", param)
    if isinstance(m.content, str):
        t.add(where, {"role": "user", "content": m.content})
        return
    texts: list[str] = []
    for j, b in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if isinstance(b, ToolResultBlock):
            content = _text_of(b.content, f"{at}.content")
            content = f"Error: {content}" if b.is_error else content  # a chat template has no field for it
            t.add(at, {"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif isinstance(b, TextBlock):
            if not b.text:  # as Anthropic's API
                raise bad_request(f"{at}: text content blocks must be non-empty.", f"{param}.{j}")
            texts.append(b.text)
        else:
            raise _block_error(at, b.type, "user" if isinstance(b, (ToolUseBlock, ThinkingBlock)) else "")
    if texts or not any(isinstance(b, ToolResultBlock) for b in m.content):
        t.add(where, {"role": "user", "content": join_text_parts(texts)})


def _assistant(t: Translation, m: Message, where: str) -> None:
    if isinstance(m.content, str):
        t.add(where, {"role": "assistant", "content": m.content})
        return
    texts, calls = [], []
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            args = json.dumps(b.input, ensure_ascii=False)
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}})
        elif not isinstance(b, ThinkingBlock):  # earlier reasoning is not shown again
            raise _block_error(f"{where}.content[{j}]", b.type, "assistant" if isinstance(b, ToolResultBlock) else "")
    message: dict[str, Any] = {"role": "assistant", "content": join_text_parts(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    t.add(where, message)


def _tools(req: CountTokensRequest) -> Optional[list[dict[str, Any]]]:
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise bad_request(
                f"tools[{i}]: the server tool '{tool.type}' is not supported; declare client tools "
                "(name, description, input_schema).",
                f"tools.{i}.type",
            )
        fn = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(req: CountTokensRequest) -> tuple[Any, Optional[bool]]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls``."""
    tc = req.tool_choice
    if tc is None:
        return None, None
    parallel = False if tc.disable_parallel_tool_use else None
    if tc.type == "tool":
        if not tc.name:
            raise bad_request("tool_choice: type 'tool' needs the tool's 'name'.", "tool_choice.name")
        return {"type": "function", "function": {"name": tc.name}}, parallel
    return _TOOL_CHOICES[tc.type], parallel


def to_chat_request(req: CountTokensRequest) -> tuple[ChatCompletionRequest, Translation]:
    """The chat request answering ``req`` (a `MessagesRequest`, or a `CountTokensRequest`: no
    sampling fields), and the translation that renames its errors; ServerError 400 where a
    block or tool cannot be served."""
    t = Translation()
    if req.system is not None:
        system = _text_of(req.system, "system")
        if system:
            t.add("system", {"role": "system", "content": system})
    if not req.messages:
        raise bad_request("messages: at least one message is required.", "messages")
    for i, m in enumerate(req.messages):
        (_user if m.role == "user" else _assistant)(t, m, f"messages[{i}]")
    tool_choice, parallel = _tool_choice(req)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": t.messages,
        "tools": _tools(req),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    last = t.messages[-1]
    if last["role"] == "assistant" and not last["content"] and not last.get("tool_calls") and len(t.messages) > 1:
        t.messages.pop()  # an empty final assistant message (Anthropic allows it): no prefill
        t.origins.pop()
    elif last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):
        # Anthropic's prefill: the answer continues the final assistant message's text
        if last["content"] != last["content"].rstrip():
            where = t.origins[-1]
            param = where.replace("[", ".").replace("]", "")
            raise bad_request(f"{where}: final assistant content cannot end with trailing whitespace.", param)
        fields.update(continue_final_message=True, add_generation_prompt=False)
    if req.thinking is not None:
        thinking = req.thinking.type != "disabled"
        # disabled: no split whatever the server's parser (the template closed the block: all is the answer)
        fields.update(separate_reasoning=thinking, chat_template_kwargs={"enable_thinking": thinking})
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        fields.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k or None,
        )
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = t.rename(".".join(str(p) for p in err.get("loc", ())))
        raise bad_request(f"Invalid value for '{where}': {err.get('msg')}", where) from None
    return chat, t
