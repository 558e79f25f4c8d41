"""SGLang's text utilities: parse a model's output as the chat routes do, without generating.

* ``POST /parse_function_call`` ``{"text", "tools"?, "tool_call_parser"?}``: the tool calls in
  ``text`` in the format of ``tool_call_parser`` (``--tool-call-parser``'s names; unset: the
  server's parser). Answer: ``{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}``:
  the text before the calls, and each complete call to one of ``tools`` (OpenAI's function
  tools), ``parameters`` its arguments as a JSON string. A call to a function not in ``tools``
  is left out, as SGLang does; with no ``tools`` nothing is parsed.
* ``POST /separate_reasoning`` ``{"text", "reasoning_parser", "return_blocks"?}``: ``text`` split
  into its ``<think>`` block and the answer under the parser's rule (radixrt/requests/
  reasoning.py). Answer: ``{"reasoning_text", "text"}``, and with ``return_blocks`` SGLang's
  ``reasoning_blocks``, ``text_blocks`` and ``blocks`` (``{"type", "text"}`` in order).

Both are pure functions of the body (no model runs); a field of the wrong type is a 400.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from radixrt.requests.reasoning import REASONING_PARSERS, opened_by_prompt, split_reasoning
from radixrt.server.context import ServerContext, server_context
from radixrt.server.errors import bad_request
from radixrt.server.http_utils import JSON, read_json
from radixrt.server.tools.parsers import PARSER_CHOICES, get_parser
from radixrt.server.tools.scan import CallScan

router = APIRouter()


async def _body(request: Request, known: set[str]) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if not isinstance(body.get("text"), str):
        raise bad_request("'text' must be a string.", "text")
    unknown = sorted(set(body) - known - {"text"})
    if unknown:
        raise bad_request(f"Unknown field(s): {', '.join(unknown)}.", unknown[0])
    return body


def _tool_names(tools: Any) -> list[str]:
    """The function names of OpenAI's ``tools`` list, in order; a 400 for another shape."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools.", "tools")
    names = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("each of 'tools' must be {'type': 'function', 'function': {'name', ...}}.", "tools")
        names.append(fn["name"])
    return names


def _parameters(call: CallScan) -> str:
    """A call's arguments as compact JSON (SGLang's ``json.dumps``), or their text when not JSON."""
    try:
        return json.dumps(json.loads(call.args or "{}"), ensure_ascii=False)
    except ValueError:
        return call.args


@router.post("/parse_function_call")
async def parse_function_call(request: Request, ctx: ServerContext = Depends(server_context)) -> Response:
    body = await _body(request, {"tools", "tool_call_parser"})
    names = _tool_names(body.get("tools"))
    name = body.get("tool_call_parser") or ctx.server_args.get("tool_call_parser")
    if name is not None and name not in PARSER_CHOICES:
        raise bad_request(f"'tool_call_parser' must be one of {', '.join(PARSER_CHOICES)}.", "tool_call_parser")
    text: str = body["text"]
    if not names:
        return JSON({"normal_text": text, "calls": []})
    parsed = get_parser(name, getattr(ctx.tm.tokenizer, "chat_template", None)).parse(text, final=True)
    index = {n: i for i, n in reversed(list(enumerate(names)))}  # the first tool of a name
    calls = [
        {"tool_index": index[c.name], "name": c.name, "parameters": _parameters(c)}
        for c in parsed.named_calls()
        if c.end is not None and c.name in index
    ]
    return JSON({"normal_text": parsed.content if parsed.named_calls() else text, "calls": calls})


@router.post("/separate_reasoning")
async def separate_reasoning(request: Request) -> Response:
    body = await _body(request, {"reasoning_parser", "return_blocks"})
    parser = body.get("reasoning_parser")
    if parser not in REASONING_PARSERS:
        raise bad_request(f"'reasoning_parser' must be one of {', '.join(REASONING_PARSERS)}.", "reasoning_parser")
    if not isinstance(body.get("return_blocks", False), bool):
        raise bad_request("'return_blocks' must be a boolean.", "return_blocks")
    reasoning, text = split_reasoning(body["text"], final=True, opened_by_prompt=opened_by_prompt(parser))
    out: dict[str, Any] = {"reasoning_text": reasoning, "text": text}
    if body.get("return_blocks"):
        blocks = ([{"type": "reasoning", "text": reasoning}] if reasoning else []) + [{"type": "text", "text": text}]
        out["reasoning_blocks"] = [b["text"] for b in blocks if b["type"] == "reasoning"]
        out["text_blocks"] = [text]
        out["blocks"] = blocks
    return JSON(out)
