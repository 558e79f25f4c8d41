"""The tool turns of a chat conversation, checked as OpenAI checks them.

``check_tool_turns(messages)`` takes the conversation as plain dicts in the
chat message shape (``role``, ``content``, ``tool_calls``, ``tool_call_id``)
and raises ``ToolError`` whose ``param`` names the field at fault
(``messages[3].tool_call_id``):

* each of an assistant message's ``tool_calls`` is an object with a
  ``function`` whose ``name`` is a valid tool name (`is_tool_name`: a name
  with a trailing newline is not) and whose ``arguments`` is the JSON text of
  an object (an object itself is taken too; an empty or blank string counts as
  ``{}``, as some servers send for a call without arguments); ``id``, when
  present, is a string;
* a ``tool`` message has content (not null) and a ``tool_call_id`` string,
  and answers a call of the assistant message it follows: only other
  ``tool`` messages may stand between them (OpenAI: "messages with role
  'tool' must be a response to a preceding message with 'tool_calls'"), and
  its id is one of that message's call ids.

Accepted on purpose:

* several ``tool`` messages answering the parallel calls of one assistant
  message, in any order;
* a call naming a tool that is not in the request's ``tools`` (or a
  conversation with calls and no ``tools``): agents change their tool set
  between requests, and OpenAI accepts such histories (the OpenAI Agents SDK
  by default hands the receiving agent the whole history, the handoff call
  included, with that agent's own tools; summarizing a conversation is often
  asked with its calls and no ``tools``, which only Anthropic's API refuses).
  The name must still be a valid name;
* a call that no ``tool`` message answers (OpenAI refuses it; refusing it
  here would refuse conversations that SGLang and vLLM serve, so it is left
  to the model).

Pure and linear in the conversation's size; no tokenizer needed.
"""

from __future__ import annotations

from typing import Any, Optional

from radixrt.server.tools.scan import load_json
from radixrt.server.tools.spec import ToolError, is_tool_name


def call_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """A call's ``arguments`` (JSON text, or an object) as an object; ToolError
    naming ``where`` when it is not JSON or not an object."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None:
        return {}
    if not isinstance(arguments, str):
        raise ToolError(f"'{where}' must be a string holding a JSON object, got {type(arguments).__name__}.", where)
    if not arguments.strip():
        return {}
    try:
        value = load_json(arguments)
    except ValueError as e:
        raise ToolError(f"'{where}' is not valid JSON ({e}).", where) from None
    if not isinstance(value, dict):
        raise ToolError(f"'{where}' must be a JSON object, got a JSON {type(value).__name__}.", where)
    return value


def _check_calls(i: int, calls: Any) -> list[Optional[str]]:
    """The call ids of assistant message ``i`` (None for a call without one)."""
    if not isinstance(calls, list):
        raise ToolError(f"'messages[{i}].tool_calls' must be a list of calls.", f"messages[{i}].tool_calls")
    ids: list[Optional[str]] = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise ToolError(f"'{where}' must be an object.", where)
        if call.get("type", "function") != "function":
            raise ToolError(
                f"'{where}.type' is {call.get('type')!r}; only 'function' calls are supported.", f"{where}.type"
            )
        cid = call.get("id")
        if cid is not None and not isinstance(cid, str):
            raise ToolError(f"'{where}.id' must be a string.", f"{where}.id")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"'{where}.function' must be an object with 'name' and 'arguments'.", f"{where}.function")
        name = fn.get("name")
        if not is_tool_name(name):
            raise ToolError(
                f"'{where}.function.name' is {name!r}; a tool name is 1-64 characters of letters, "
                f"digits, '_', '.' or '-'.",
                f"{where}.function.name",
            )
        call_arguments(fn.get("arguments"), f"{where}.function.arguments")
        ids.append(cid)
    return ids


def check_tool_turns(messages: list[dict[str, Any]]) -> None:
    """Raise ToolError (``param``: the field) unless every tool call and tool
    message of ``messages`` is well formed and every tool message answers a
    call of the assistant message before it (see the module's docstring)."""
    open_calls: Optional[list[Optional[str]]] = None  # call ids of the assistant message tool messages answer
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            if m.get("content") is None:
                raise ToolError(
                    f"'messages[{i}].content' must be a string for a 'tool' message, got null.",
                    f"messages[{i}].content",
                )
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise ToolError(
                    f"'messages[{i}].tool_call_id' is missing: a 'tool' message answers a call by its id.",
                    f"messages[{i}].tool_call_id",
                )
            if open_calls is None:
                raise ToolError(
                    f"'messages[{i}].role' is 'tool', but a tool message must answer a preceding "
                    f"assistant message with 'tool_calls' (only tool messages between them).",
                    f"messages[{i}].role",
                )
            if cid not in open_calls:
                known = ", ".join(repr(c) for c in open_calls if c) or "none with an id"
                raise ToolError(
                    f"'messages[{i}].tool_call_id' {cid!r} matches no call of the preceding assistant "
                    f"message (its call ids: {known}).",
                    f"messages[{i}].tool_call_id",
                )
            continue
        open_calls = None
        if role == "assistant" and m.get("tool_calls") is not None:
            open_calls = _check_calls(i, m["tool_calls"]) or None
