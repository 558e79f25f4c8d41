"""The input items of a stored response, as ``GET /v1/responses/{id}/input_items``
lists them (the official client's ``responses.input_items.list``).

`listed_inputs` turns a request's parsed ``input`` items into the item objects
OpenAI lists: each with an ``id`` and a ``status``, message content as
``input_text`` parts (``output_text`` for an assistant's), a call output's
content as text. Reasoning items and item references, which the prompt does
not use, are not listed. `page` cuts one page of them, in OpenAI's order
(newest first by default) and with its cursor (``after``, ``limit``).
"""

from __future__ import annotations

from typing import Any, Optional

from radixrt.server.errors import bad_request
from radixrt.server.responses_input import content_text
from radixrt.server.responses_render import new_id

MAX_PAGE = 100  # OpenAI's: limit is 1 to 100 (default 20)
DEFAULT_PAGE = 20


def _parts(content: Any, part_type: str) -> list[dict[str, Any]]:
    texts = [content] if isinstance(content, str) else [p.get("text") or "" for p in content]
    out: list[dict[str, Any]] = [{"type": part_type, "text": t} for t in texts]
    if part_type == "output_text":
        for part in out:
            part["annotations"] = []
    return out


def listed_inputs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parsed input items (`responses_protocol.parse_input`) as listed items, in input order."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            assistant = item["role"] == "assistant"
            parts = _parts(item["content"], "output_text" if assistant else "input_text")
            out.append(
                {"id": new_id("msg"), "type": "message", "role": item["role"], "status": "completed", "content": parts}
            )
        elif kind == "function_call":
            fields = {k: item[k] for k in ("call_id", "name", "arguments")}
            out.append({"id": new_id("fc"), "type": "function_call", "status": "completed", **fields})
        elif kind == "function_call_output":
            out.append(
                {
                    "id": new_id("fco"),
                    "type": "function_call_output",
                    "call_id": item["call_id"],
                    "output": content_text(item["output"], "input"),  # checked when the request came
                    "status": "completed",
                }
            )
    return out


def page(items: list[dict[str, Any]], order: str, after: Optional[str], limit: Any) -> dict[str, Any]:
    """One page of ``items`` (input order) as OpenAI's list object; ServerError 400 on a bad
    ``order`` or ``limit``, or an ``after`` that names no item of this response."""
    if order not in ("asc", "desc"):
        raise bad_request(f"'order' is {order!r}; it is 'asc' or 'desc'.", "order")
    try:
        n = DEFAULT_PAGE if limit is None else int(limit)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_PAGE:
        raise bad_request(f"'limit' is {limit!r}; it is an integer from 1 to {MAX_PAGE}.", "limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise bad_request(f"'after' is {after!r}, which is not an input item of this response.", "after")
        start = ids.index(after) + 1
    data = ordered[start : start + n]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + n < len(ordered),
    }
