"""Answers of ``/v1/messages`` in Anthropic's shapes, whole or streamed as its
server-sent events.

The output is read as on chat (`radixrt.server.tools.ChoiceOutput`: reasoning,
text, tool calls) and written as content blocks, in order: a ``thinking`` block
(when the output is split: ``thinking`` enabled or ``--reasoning-parser``), a
``text`` block, one ``tool_use`` block per call (``input``: the arguments as an
object; ``{}`` for a call cut off before its arguments closed). A message
without calls always has a text block (maybe empty).

``stop_reason``: ``max_tokens`` when the token limit (or the context) cut it (a call
too), ``tool_use`` when it made calls, ``stop_sequence`` (with ``stop_sequence``) when
one of its ``stop_sequences`` ended it, else ``end_turn``. ``usage``:
``input_tokens`` are the prompt tokens computed for it, ``cache_read_input_tokens``
those the radix cache served (their sum is the prompt), ``output_tokens``.

Streamed: ``message_start``, then per block ``content_block_start``, its deltas
(``text_delta``, ``thinking_delta``, ``input_json_delta`` pieces that join to the
call's JSON input), ``content_block_stop``; then ``message_delta`` (stop reason,
usage) and ``message_stop``. A failure, or an abort (a request timeout,
``/abort_request``), ends the stream with an ``error`` event (a whole answer:
that error).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from radixrt.requests.finish import LENGTH
from radixrt.requests.router import ReqGroup, ReqState
from radixrt.server.errors import ServerError, anthropic_error_body
from radixrt.server.http_utils import dumps, group_error
from radixrt.server.openai_stream import choice_updates, output_deltas
from radixrt.server.tools import ChoiceOutput, ToolCallParser


def tool_use_id(call_id: str) -> str:
    """A call's id in Anthropic's spelling (the chat path's ``call_<hex>`` as ``toolu_<hex>``)."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageView:
    """The answer to one /v1/messages request (one sample), whole or streamed."""

    def __init__(
        self,
        group: ReqGroup,
        prompt_len: int,
        model: str,
        parser: Optional[ToolCallParser],
        reasoning: str,
        stop_sequences: Optional[list[str]],
        remember: Optional[Callable[[str, list[int]], None]] = None,
    ) -> None:
        """``remember`` sees the finished output's text and ids (radixrt/server/tools/turns.py)."""
        self.group, self.prompt_len, self.model = group, prompt_len, model
        self.remember = remember
        self.out = ChoiceOutput(parser, reasoning)
        self.plain = parser is None and not reasoning
        self.stop_sequences = stop_sequences or []
        self.id = "msg_" + uuid.uuid4().hex[:24]

    @property
    def state(self) -> ReqState:
        return self.group.states[0]

    def usage(self) -> dict[str, int]:
        acc = self.state.acc
        cached = min(acc.cached_tokens, self.prompt_len)
        return {
            "input_tokens": self.prompt_len - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": acc.completion_tokens,
        }

    def stop(self, made_calls: bool) -> tuple[str, Optional[str]]:
        """(stop_reason, stop_sequence) of the finished output."""
        fr = self.state.acc.finish_reason
        if fr is not None and fr.type == LENGTH:  # a call cut off too: its input may be incomplete
            return "max_tokens", None
        if made_calls:
            return "tool_use", None
        matched = getattr(fr, "matched", None)
        if isinstance(matched, str) and matched in self.stop_sequences:
            return "stop_sequence", matched
        return "end_turn", None

    def aborted(self) -> Optional[tuple[int, str]]:
        """(status, message) where the request was aborted (a timeout, an admin's abort): an
        Anthropic answer has no stop reason for that, so it is an error."""
        fr = self.state.acc.finish_reason
        if fr is None or not fr.is_abort:
            return None
        return fr.status_code or 503, fr.message or "the request was aborted"

    def _finished(self) -> None:
        st = self.state
        if self.remember is not None and st.acc.finish_reason is not None:
            self.remember(st.acc.text, list(st.acc.output_ids))

    def _head(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content}

    def response(self) -> dict[str, Any]:
        """The whole message, once the request finished; ServerError where it was aborted."""
        aborted = self.aborted()
        if aborted is not None:
            raise ServerError(*aborted)
        self._finished()
        text = self.state.acc.text
        if self.plain:
            message: dict[str, Any] = {"content": text}
        else:
            message, _ = self.out.message(text)
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            content.append({"type": "text", "text": message.get("content") or ""})
        for c in calls:
            fn = c["function"]
            content.append(
                {"type": "tool_use", "id": tool_use_id(c["id"]), "name": fn["name"], "input": _input(fn["arguments"])}
            )
        reason, sequence = self.stop(bool(calls) and self.out.has_whole_calls(text))
        return {**self._head(content), "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage()}

    async def stream(self) -> AsyncIterator[bytes]:
        """The SSE body (module docstring)."""
        blocks = _Blocks()
        start = {**self._head([]), "stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": self.prompt_len, "output_tokens": 0}
        yield _event("message_start", {"type": "message_start", "message": start})
        async for updates in choice_updates(self.group):
            out: list[bytes] = []
            for u in updates:
                for d in output_deltas(self.out, self.plain, u):
                    out += blocks.feed(d)
            if out:
                yield b"".join(out)
        error = group_error(self.group)
        failed = (503, error) if error is not None else self.aborted()  # a server-side failure, or an abort
        if failed is not None:
            yield b"".join(blocks.finish()) + _event("error", anthropic_error_body(*failed))
            return
        self._finished()
        closing = blocks.finish()
        reason, sequence = self.stop(blocks.calls > 0 and self.out.has_whole_calls(self.state.acc.text))
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        yield (
            b"".join(closing)
            + _event("message_delta", {**delta, "usage": self.usage()})
            + _event("message_stop", {"type": "message_stop"})
        )


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class _Blocks:
    """Content blocks built from chat deltas, and the events that announce them."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened so far (the next block's index)
        self.open: Optional[str] = None  # the open block's kind: "text", "thinking" or "tool_use"
        self.calls = 0
        self.texts = 0  # text blocks opened
        self.call_block: dict[int, int] = {}  # a call's index -> its block's

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self.open = kind
        out.append(
            _event("content_block_start", {"type": "content_block_start", "index": self.count, "content_block": block})
        )
        self.count += 1
        return out

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        # Anthropic signs a thinking block before closing it; nothing is signed here (its signature is "")
        out = [self._delta({"type": "signature_delta", "signature": ""})] if self.open == "thinking" else []
        self.open = None
        return out + [_event("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.count - 1, "delta": delta})

    def feed(self, d: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta (`ChoiceOutput.deltas`)."""
        out: list[bytes] = []
        if "reasoning_content" in d:
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
        if "content" in d:
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
                self.texts += 1
            out.append(self._delta({"type": "text_delta", "text": d["content"]}))
        for call in d.get("tool_calls", []):
            fn = call.get("function", {})
            if call["index"] not in self.call_block:  # a call's first delta: its id and name
                block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn.get("name", ""), "input": {}}
                out += self._start("tool_use", block)
                self.call_block[call["index"]] = self.count - 1
                self.calls += 1
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def finish(self) -> list[bytes]:
        """Close the open block; a message without text or calls (nothing, or thinking only) gets an
        empty text block, as the whole answer has."""
        if self.texts or self.calls:
            return self._stop()
        return self._start("text", {"type": "text", "text": ""}) + self._stop()
