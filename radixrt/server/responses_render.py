"""Response objects of ``/v1/responses``, whole or streamed as the Responses
API's typed server-sent events.

The output is read as on chat (`radixrt.server.tools.ChoiceOutput`: content,
tool calls, reasoning) and written as output items:

* ``reasoning`` (with ``--reasoning-parser``): the ``<think>`` text as one
  ``reasoning_text`` part;
* ``message``: the text, one ``output_text`` part;
* ``function_call`` per call: ``call_id``, ``name``, ``arguments`` (JSON text).

A response without calls always has a message (maybe with empty text).

Streamed, each item is announced (``response.output_item.added``), filled
(``response.content_part.added``, ``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``)
and closed (``...done`` events, then ``response.output_item.done``) in
order, between ``response.created`` / ``response.in_progress`` and the last
event: ``response.completed``, ``response.incomplete`` (the token limit was
reached) or ``response.failed``. Every event carries its ``type`` and a
``sequence_number``, and is sent with an SSE ``event:`` line of its type. The
deltas add up to the final items, ids included.

Status: ``completed``; ``incomplete`` with ``incomplete_details.reason``
``"max_output_tokens"`` when the output was cut by the token limit (or the
context); ``failed`` with an ``error`` when the engine ended the request.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from radixrt.requests.finish import LENGTH, STOP
from radixrt.requests.router import ReqGroup, ReqState
from radixrt.server.http_utils import dumps
from radixrt.server.openai_render import logprob_entries, reasoning_tokens, usage
from radixrt.server.openai_stream import choice_updates, output_deltas
from radixrt.server.token_texts import TokenTexts
from radixrt.server.tools import ChoiceOutput, ToolCallParser


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(group: ReqGroup, prompt_len: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's usage object (input / output tokens, cached input tokens, and
    ``reasoning_tokens`` of the output's)."""
    u = usage(group, 1, [prompt_len])
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u["total_tokens"],
    }


def outcome(st: ReqState) -> tuple[str, Optional[dict], Optional[dict]]:
    """(status, incomplete_details, error) of a finished request."""
    fr = st.acc.finish_reason
    if st.error is not None:
        return "failed", None, {"code": "server_error", "message": st.error}
    if fr is None or fr.type == STOP:
        return "completed", None, None
    if fr.type == LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}, None
    return "failed", None, {"code": "server_error", "message": fr.message or "the request was aborted"}


def _text_part(text: str, logprobs: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def message_item(
    item_id: str, text: str, status: str, logprobs: Optional[list[dict[str, Any]]] = None
) -> dict[str, Any]:
    part = _text_part(text, logprobs)
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [_reasoning_part(text)], "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponseView:
    """The answer to one /v1/responses request (one sample), whole or streamed.

    ``skeleton`` is the response object without its outcome (id, model, the
    request's settings); ``on_done`` gets the finished response object
    (stores it) before it is answered. ``tokenizer`` counts the reasoning tokens;
    with ``logprobs`` (``include`` of
    ``message.output_text.logprobs``) the message's ``output_text`` carries the
    logprobs of the output's tokens, as chat's ``logprobs.content`` (with tool calls
    or reasoning, of the whole output, which the message is a part of)."""

    def __init__(
        self,
        skeleton: dict[str, Any],
        group: ReqGroup,
        prompt_len: int,
        parser: Optional[ToolCallParser],
        reasoning: str,
        remember: Optional[Callable[[str, list[int]], None]],
        on_done: Callable[[dict[str, Any]], None],
        tokenizer: Any = None,
        logprobs: bool = False,
    ) -> None:
        self.skeleton, self.group, self.prompt_len = skeleton, group, prompt_len
        self.tt = TokenTexts(tokenizer) if logprobs else None
        self.tokenizer, self.reasoning = tokenizer, reasoning
        self.out = ChoiceOutput(parser, reasoning)
        self.plain = parser is None and not reasoning
        self.remember, self.on_done = remember, on_done

    @property
    def state(self) -> ReqState:
        return self.group.states[0]

    def _finished(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        st = self.state
        if self.remember is not None and st.acc.finish_reason is not None:
            self.remember(st.acc.text, list(st.acc.output_ids))
        status, incomplete, error = outcome(st)
        body = {
            **self.skeleton,
            "status": status,
            "incomplete_details": incomplete,
            "error": error,
            "output": output,
            "usage": responses_usage(self.group, self.prompt_len, self._reasoning_tokens()),
        }
        if status == "completed":
            body["completed_at"] = int(time.time())
        self.on_done(body)  # a failed one too: OpenAI keeps a response whatever its status
        return body

    def _reasoning_tokens(self) -> int:
        if not self.reasoning or self.tokenizer is None:
            return 0
        return reasoning_tokens(self.group, self.reasoning, self.tokenizer, None)

    def response(self) -> dict[str, Any]:
        """The whole response object, once the request finished."""
        text = self.state.acc.text
        item_status = "completed" if outcome(self.state)[0] == "completed" else "incomplete"  # as streamed
        output: list[dict[str, Any]] = []
        lps = logprob_entries(self.tt, self.state, 0) if self.tt is not None else None
        if self.plain:
            output.append(message_item(new_id("msg"), text, item_status, lps))
            return self._finished(output)
        message, _ = self.out.message(text)
        calls = message.get("tool_calls") or []
        if message.get("reasoning_content"):
            # nothing after the thinking block: if the limit cut the answer, it cut the reasoning (as streamed)
            status = item_status if not message.get("content") and not calls else "completed"
            output.append(reasoning_item(new_id("rs"), message["reasoning_content"], status))
        if message.get("content") or not calls:
            output.append(message_item(new_id("msg"), message.get("content") or "", "completed", lps))
        for c in calls:
            output.append(
                call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
            )
        # As in the stream: items before the last were closed when the next began; only
        # the last can have been cut by the token budget.
        output[-1]["status"] = item_status
        return self._finished(output)

    async def stream(self) -> AsyncIterator[bytes]:
        """The SSE body (module docstring)."""
        ev = _Events(self.skeleton)
        yield ev.emit("response.created", response=ev.snapshot()) + ev.emit(
            "response.in_progress", response=ev.snapshot()
        )
        async for updates in choice_updates(self.group):
            out: list[bytes] = []
            for u in updates:
                if self.tt is not None:
                    ev.logprobs += logprob_entries(self.tt, u.state, u.start_lp)
                for d in output_deltas(self.out, self.plain, u):
                    out += ev.feed(d)
            if out:
                yield b"".join(out)
        status = outcome(self.state)[0]
        closing = ev.finish("completed" if status == "completed" else "incomplete")
        body = self._finished(ev.items)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        yield b"".join(closing) + ev.emit(kind, response=body)


class _Events:
    """Output items built from chat deltas, and the events that announce them."""

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.skeleton = skeleton
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: Optional[int] = None  # the message or reasoning item being written
        self.calls: dict[int, int] = {}  # a call's index -> its item's output index
        self.calls_done: set[int] = set()
        self.logprobs: list[dict[str, Any]] = []  # of tokens whose text no message delta carried yet

    def emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

    def snapshot(self) -> dict[str, Any]:
        return {**self.skeleton, "status": "in_progress", "output": [], "usage": None}

    def _open(self, item: dict[str, Any], part: Optional[dict[str, Any]]) -> list[bytes]:
        out = self._close_open()
        index = len(self.items)
        self.items.append(item)
        out.append(
            self.emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "content": []} if part is not None else dict(item),
            )
        )
        if part is not None:
            out.append(
                self.emit(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        self.open = index if part is not None else None
        return out

    def _close_open(self) -> list[bytes]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        return self._close_text(index, "completed")

    def _close_text(self, index: int, status: str) -> list[bytes]:
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra: dict[str, Any] = {}
        if item["type"] == "message":
            part["logprobs"] += self.logprobs
            self.logprobs = []
            extra["logprobs"] = list(part["logprobs"])
        return [
            self.emit(kind, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
            self.emit(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=dict(part)
            ),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]

    def _text(self, kind: str, delta: str) -> list[bytes]:
        out: list[bytes] = []
        if self.open is None or self.items[self.open]["type"] != kind:
            if kind == "message":
                item = message_item(new_id("msg"), "", "in_progress")
            else:
                item = reasoning_item(new_id("rs"), "", "in_progress")
            out += self._open(item, item["content"][0])
        index = self.open
        assert index is not None
        item = self.items[index]
        item["content"][0]["text"] += delta
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {}
        if kind == "message":  # the logprobs of the tokens that brought this text
            extra["logprobs"], self.logprobs = self.logprobs, []
            item["content"][0]["logprobs"] += extra["logprobs"]
        out.append(self.emit(event, item_id=item["id"], output_index=index, content_index=0, delta=delta, **extra))
        return out

    def _close_call(self, i: int, status: str) -> list[bytes]:
        index = self.calls[i]
        self.calls_done.add(i)
        item = self.items[index]
        item["status"] = status
        return [
            self.emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]

    def feed(self, delta: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta (radixrt.server.tools.output.ChoiceOutput.deltas)."""
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._text("message", delta["content"])
        out: list[bytes] = []
        for call in delta.get("tool_calls", []):
            i = call["index"]
            fn = call.get("function", {})
            if i not in self.calls:  # a call's first delta: its id and name
                for j in sorted(set(self.calls) - self.calls_done):
                    out += self._close_call(j, "completed")
                out += self._open(call_item(new_id("fc"), call["id"], fn.get("name", ""), "", "in_progress"), None)
                self.calls[i] = len(self.items) - 1
            args = fn.get("arguments") or ""
            if args:
                index = self.calls[i]
                self.items[index]["arguments"] += args
                out.append(
                    self.emit(
                        "response.function_call_arguments.delta",
                        item_id=self.items[index]["id"],
                        output_index=index,
                        delta=args,
                    )
                )
        return out

    def finish(self, status: str) -> list[bytes]:
        """Close every open item (``status``: completed or incomplete); a response with
        neither text nor calls gets an empty message."""
        out: list[bytes] = []
        if self.open is not None:
            index, self.open = self.open, None
            out += self._close_text(index, status)
        for i in sorted(set(self.calls) - self.calls_done):
            out += self._close_call(i, status)
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            item = message_item(new_id("msg"), "", "in_progress")
            out += self._open(item, item["content"][0])
            index, self.open = len(self.items) - 1, None
            out += self._close_text(index, status)
        return out
