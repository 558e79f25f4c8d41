"""Tools and tool turns of a chat into what the chat template renders.

Two ways, chosen per model:

* native: the template renders tools itself (Qwen2.5/Qwen3, Llama 3.x,
  Mistral...). The tools go to ``apply_chat_template(tools=...)``; assistant
  ``tool_calls`` get their ``function.arguments`` as objects (templates
  ``tojson`` them) and ``role: "tool"`` messages pass through.
* generic (templates without tools, e.g. the embedded SmolLM2): the tools are
  described at the end of the system message (one is added when the chat has
  none), an assistant turn's calls are written in the parser's format after
  its content, and a tool result becomes a user turn
  ``<tool_response>\\n...\\n</tool_response>``.

Both are pure functions of the request's messages, so an agent loop that
sends back its earlier turns unchanged gets a byte-identical prefix: the
radix cache then serves every earlier step's tokens.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from radixrt.sampling.json_schema_grammar import JSON_SEPARATORS
from radixrt.server.tools.conversation import call_arguments
from radixrt.server.tools.parsers import ToolCallParser
from radixrt.server.tools.spec import ToolError, ToolRequest

GENERIC_TOOLS_HEADER = (
    "# Tools\n\n"
    "You can call the functions below to help with the user's request. "
    "Their definitions, one JSON object per line:\n<tools>\n"
)
GENERIC_CALL_EXAMPLE = ("<function name>", "<the arguments as a JSON object>")


def generic_tools_text(tr: ToolRequest, parser: ToolCallParser) -> str:
    """The generic format's description of the tools (appended to the system message), with
    an example call in ``parser``'s format: the one the grammar enforces and the parser reads."""
    lines = "\n".join(json.dumps(t.raw, ensure_ascii=False, separators=JSON_SEPARATORS) for t in tr.tools)
    example = parser.render_calls([GENERIC_CALL_EXAMPLE])
    return (
        GENERIC_TOOLS_HEADER
        + lines
        + "\n</tools>\n\nTo call functions, answer with one block per call and nothing else:\n"
        + example
        + "\nEach result comes back in a <tool_response></tool_response> block."
    )


def _calls(i: int, msg: dict) -> list[tuple[str, str]]:
    """An assistant message's tool_calls as ``(name, arguments JSON text)``."""
    out = []
    for j, call in enumerate(msg.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ToolError(f"messages[{i}].tool_calls[{j}].function.name is missing.", "messages")
        args = fn.get("arguments", "{}") if isinstance(fn, dict) else "{}"
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False, separators=JSON_SEPARATORS)
        elif not isinstance(args, str):
            raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON string.", "messages")
        out.append((name, args))
    return out


def _native_message(i: int, msg: dict) -> dict:
    if not msg.get("tool_calls"):
        return msg
    calls = []
    for j, (name, args) in enumerate(_calls(i, msg)):
        parsed = call_arguments(args, f"messages[{i}].tool_calls[{j}].function.arguments")
        raw = msg["tool_calls"][j]
        calls.append({"id": raw.get("id"), "type": "function", "function": {"name": name, "arguments": parsed}})
    return {**msg, "tool_calls": calls}


def _generic_message(i: int, msg: dict, parser: ToolCallParser) -> dict:
    role = msg["role"]
    if role == "assistant" and msg.get("tool_calls"):
        calls = parser.render_calls(_calls(i, msg))
        content = msg.get("content") or ""
        return {"role": "assistant", "content": f"{content}\n{calls}" if content else calls}
    if role in ("tool", "function"):
        return {"role": "user", "content": f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"}
    return {k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id")}


def render_messages(
    messages: list[dict], tr: ToolRequest, parser: ToolCallParser, native: bool
) -> tuple[list[dict], Optional[list[dict[str, Any]]]]:
    """The messages to give the chat template, and the ``tools`` argument for it
    (None in the generic way, where the tools are in the system message)."""
    if native:
        return [_native_message(i, m) for i, m in enumerate(messages)], ([t.raw for t in tr.tools] or None)
    out = [_generic_message(i, m, parser) for i, m in enumerate(messages)]
    if tr.tools:
        text = generic_tools_text(tr, parser)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None
