"""Tool definitions and ``tool_choice`` of an OpenAI chat request, checked.

``check_tools(tools, tool_choice, parallel_tool_calls)`` turns the request's
raw fields into a ``ToolRequest`` or raises ``ToolError`` (a ValueError
carrying the OpenAI parameter name) with a message fit for a 400:

* every tool is ``{"type": "function", "function": {"name": ..., ...}}``
  (with ``flat``, the Responses API's shape: ``{"type": "function",
  "name": ..., "parameters": ...}``); names are 1-64 characters of
  ``[A-Za-z0-9_.-]`` and nothing else (OpenAI's rule, `is_tool_name`) and
  unique;
* with the server's limits given, at most ``max_tools`` tools of at most
  ``max_chars`` characters as compact JSON (counted before any tool is
  checked);
* ``parameters`` is a JSON schema that xgrammar can compile, since enforced
  calls are decoded against it; arguments are always an object (a schema
  without ``type`` gets ``"object"``), and none or ``{}`` is OpenAI's empty
  parameter list (arguments ``{}``);
* ``tool_choice`` is ``"auto"``, ``"none"``, ``"required"`` or
  ``{"type": "function", "function": {"name": <a tool's name>}}`` (with
  ``flat``: ``{"type": "function", "name": <a tool's name>}``);
  ``"required"`` or a named function without tools is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from radixrt.sampling.grammar import check_grammar

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # whole string: fullmatch (``$`` would pass a final "\n")
CHOICE_MODES = ("auto", "none", "required")


def is_tool_name(name: Any) -> bool:
    """``name`` is a valid function name: 1-64 of ``[A-Za-z0-9_.-]``, nothing more."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


class ToolError(ValueError):
    """A bad tool definition or tool_choice; ``param`` is the OpenAI field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """One function tool. ``parameters`` is its JSON schema (an object schema)."""

    name: str
    description: Optional[str]
    parameters: dict[str, Any]
    raw: dict[str, Any]  # the tool as the client sent it (what templates render)


@dataclass
class ToolRequest:
    """The tools of one request and how calls are to be made.

    ``mode`` is ``"auto"``, ``"none"``, ``"required"`` or ``"named"`` (then
    ``forced`` names the tool)."""

    tools: list[ToolSpec] = field(default_factory=list)
    mode: str = "auto"
    forced: Optional[str] = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Calls may be produced (and are parsed)."""
        return bool(self.tools) and self.mode != "none"

    @property
    def enforced(self) -> bool:
        """At least one call must be produced."""
        return self.active and self.mode in ("required", "named")

    def allowed(self) -> list[ToolSpec]:
        """The tools a call may name."""
        if self.mode == "named":
            return [t for t in self.tools if t.name == self.forced]
        return list(self.tools)


def _check_tool(i: int, tool: Any, flat: bool) -> ToolSpec:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolError(f"{where} must be an object.", "tools")
    if tool.get("type", "function") != "function":
        raise ToolError(f"{where}.type is {tool.get('type')!r}; only 'function' tools are supported.", "tools")
    if flat:
        fn = {k: v for k, v in tool.items() if k != "type"}
    else:
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object with a 'name'.", "tools")
        where += ".function"
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.name is missing.", "tools")
    if not is_tool_name(name):
        raise ToolError(f"{where}.name {name!r} must be 1-64 characters of letters, digits, '_', '.' or '-'.", "tools")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ToolError(f"{where}.description must be a string.", "tools")
    params = fn.get("parameters")
    if params is None or params == {}:  # OpenAI: "omitting parameters defines an empty parameter list"
        params = {"type": "object", "properties": {}}
    if isinstance(params, dict) and "type" not in params:  # arguments are an object whatever the schema
        params = {"type": "object", **params}
    if not isinstance(params, dict):
        raise ToolError(f"{where}.parameters must be a JSON schema object.", "tools")
    if params.get("type", "object") != "object":
        raise ToolError(
            f"{where}.parameters must describe an object (type 'object'), got type {params.get('type')!r}.", "tools"
        )
    try:
        # a strict function is OpenAI's promise that calls match the schema: only what the grammar enforces
        check_grammar(("json_schema", json.dumps(params)), enforce_all=fn.get("strict") is True)
    except (ValueError, TypeError) as e:
        msg = str(e).split(": ", 1)[-1] if isinstance(e, ValueError) else str(e)
        raise ToolError(f"{where}.parameters is not a usable JSON schema: {msg}", "tools") from None
    return ToolSpec(name, desc, params, {"type": "function", "function": fn})


def _choice(tool_choice: Any, flat: bool) -> tuple[str, Optional[str]]:
    shape = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICE_MODES:
            raise ToolError(
                f"'tool_choice' is {tool_choice!r}; expected 'auto', 'none', 'required' or {shape}.", "tool_choice"
            )
        return tool_choice, None
    if isinstance(tool_choice, dict):
        fn = tool_choice if flat else tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ToolError(f"'tool_choice' as an object must be {shape} naming a tool.", "tool_choice")
        return "named", name
    raise ToolError("'tool_choice' must be a string or an object.", "tool_choice")


def _check_size(tools: list[Any], max_tools: Optional[int], max_chars: Optional[int]) -> None:
    if max_tools is not None and len(tools) > max_tools:
        raise ToolError(
            f"'tools' has {len(tools)} tools; this server accepts at most {max_tools} per request (--max-tools).",
            "tools",
        )
    if max_chars is not None:
        # tool by tool (the separating commas aside): one json.dumps call holds the GIL
        # throughout, and the event loop waits for it even from a worker thread
        size = 0
        for tool in tools:
            size += len(json.dumps(tool, ensure_ascii=False, separators=(",", ":"), default=str))
            if size > max_chars:
                raise ToolError(
                    f"'tools' is over {max_chars} characters long as JSON; this server accepts at most "
                    f"{max_chars} per request (--max-tools-chars).",
                    "tools",
                )


def check_tools(
    tools: Optional[list[Any]],
    tool_choice: Any,
    parallel_tool_calls: Optional[bool],
    flat: bool = False,
    *,
    max_tools: Optional[int] = None,
    max_chars: Optional[int] = None,
) -> ToolRequest:
    """The request's tools and choice, checked (raises ``ToolError``); ``flat``:
    in the Responses API's shapes. ``max_tools`` and ``max_chars`` are the
    server's limits (None: none). Blocking, and O(size of the tools): every
    schema is parsed into a grammar, so servers call it off the event loop."""
    mode, forced = _choice(tool_choice, flat)
    _check_size(tools or [], max_tools, max_chars)
    specs = [_check_tool(i, t, flat) for i, t in enumerate(tools or [])]
    seen: set[str] = set()
    for t in specs:
        if t.name in seen:
            raise ToolError(f"tool name {t.name!r} is defined more than once.", "tools")
        seen.add(t.name)
    if mode in ("required", "named") and not specs:
        raise ToolError(f"'tool_choice' {tool_choice!r} needs 'tools'.", "tool_choice")
    if mode == "named" and forced not in seen:
        raise ToolError(
            f"'tool_choice' names {forced!r}, which is not among the tools ({', '.join(sorted(seen))}).", "tool_choice"
        )
    return ToolRequest(specs, mode, forced, True if parallel_tool_calls is None else bool(parallel_tool_calls))
