"""One chat choice's output as an OpenAI message: content, ``tool_calls`` and
the reasoning (`reasoning_fields`), whole (``message``) or as stream deltas (``deltas``).

``ChoiceOutput`` reads the choice's whole text each time (outputs are short;
the parsers are linear), splits it (reasoning, then content and calls) and,
when streaming, sends what is new since the last chunk:

* reasoning and content as text deltas; content that may still turn into a
  call marker, and whitespace before a call, are held back;
* a call's first delta carries its ``index``, ``id``, ``type`` and
  ``function.name`` (with empty arguments), sent once the name is complete;
  later deltas carry argument fragments, the raw text as it is generated, so
  the client's concatenation equals the final ``arguments`` string.

The streamed pieces add up to the whole message: same content, same calls
(ids included), same reasoning. So the whole message reports every call
whose name was read, as the stream announced it: a call cut off by the token
limit (``finish_reason`` "length") or malformed after its name keeps its
arguments as far as they go (as OpenAI's do; a client checks them). Where
calls began but none got a name, the whole text is the content.
"""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from radixrt.requests.reasoning import opened_by_prompt, split_reasoning
from radixrt.server.tools.parsers import ParseResult, ToolCallParser
from radixrt.server.tools.scan import CallScan, ScanMemo


def reasoning_fields(text: Optional[str]) -> dict[str, Optional[str]]:
    """A chat message's or delta's reasoning under SGLang's name (``reasoning_content``) and
    vLLM's (``reasoning``, its only one since 0.17), null where there is none."""
    return {"reasoning_content": text, "reasoning": text}


def new_call_id(short: bool = False) -> str:
    """OpenAI's ``call_<24 hex>``, or ``short``: 9 letters and digits (what Mistral's chat
    templates accept, as vLLM makes them)."""
    if short:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class _Sent:
    reasoning: int = 0
    content: int = 0
    call_ids: list[str] = field(default_factory=list)  # calls whose header was sent
    call_args: list[int] = field(default_factory=list)  # argument characters sent per call


class ChoiceOutput:
    """Parses one choice; ``parser`` None means no tool calls are read."""

    def __init__(self, parser: Optional[ToolCallParser], reasoning: str) -> None:
        """``reasoning``: `reasoning_mode` ("" for no split)."""
        self.parser = parser
        self.reasoning = reasoning
        self._opened_by_prompt = opened_by_prompt(reasoning)
        self._memo, self._memo_offset, self._memo_len = ScanMemo(), -1, 0  # scans of the text after the reasoning
        self.sent = _Sent()
        self.ids: list[str] = []  # call ids, stable between stream and final message
        self.held: list[str] = []  # reasoning not streamed yet (`hold_reasoning`)

    def _split(self, text: str, final: bool) -> tuple[str, ParseResult]:
        reasoning, rest = split_reasoning(text, final, self._opened_by_prompt) if self.reasoning else ("", text)
        if self.parser is None:
            return reasoning, ParseResult(rest)
        # the memo holds for a text that grew since: not where the text after the reasoning starts
        # elsewhere now, nor for a shorter text (a stream after the whole message)
        if len(text) - len(rest) != self._memo_offset or len(rest) < self._memo_len:
            self._memo, self._memo_offset = ScanMemo(), len(text) - len(rest)
        self._memo_len = len(rest)
        return reasoning, self.parser.parse(rest, final, self._memo)

    def _id(self, i: int) -> str:
        while len(self.ids) <= i:
            self.ids.append(new_call_id(self.parser is not None and self.parser.short_call_ids))
        return self.ids[i]

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The finished choice's message, and whether it holds tool calls."""
        reasoning, parsed = self._split(text, True)
        calls = parsed.named_calls()
        msg: dict[str, Any] = {"role": "assistant"}
        msg["content"] = self._content(text, parsed, True) or (None if calls else "")
        if calls:
            msg["tool_calls"] = [
                {"id": self._id(i), "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
                for i, c in enumerate(calls)
            ]
        msg.update(reasoning_fields(reasoning or None))  # keys even without a split (SGLang's message)
        return msg, bool(calls)

    def _content(self, text: str, parsed: ParseResult, final: bool) -> str:
        """The content as far as it may be sent: the text before the calls (its trailing
        whitespace held while calls may follow); once final, where calls began but none
        was named, all text after the reasoning."""
        if parsed.calls and not parsed.named_calls():
            if final:
                return split_reasoning(text, True, self._opened_by_prompt)[1] if self.reasoning else text
            return parsed.content.rstrip()
        return parsed.content.rstrip() if (parsed.calls or not final) else parsed.content

    def hold_reasoning(self, deltas: list[dict[str, Any]], final: bool) -> list[dict[str, Any]]:
        """``deltas`` with the reasoning held back and sent as one delta, before the first delta
        of anything else (or at the end): SGLang's ``stream_reasoning: false``."""
        out: list[dict[str, Any]] = []
        for d in deltas:
            if "reasoning_content" in d:
                self.held.append(d["reasoning_content"])
                continue
            if self.held:
                out.append({"reasoning_content": "".join(self.held)})
                self.held.clear()
            out.append(d)
        if final and self.held:
            out.append({"reasoning_content": "".join(self.held)})
            self.held.clear()
        return out

    def has_whole_calls(self, text: str) -> bool:
        """Whether the finished ``text`` made calls and each closed (a stop string or token
        can cut one short: its ``finish_reason`` is then ``"stop"``, not ``"tool_calls"``)."""
        calls = self._split(text, True)[1].named_calls()
        return bool(calls) and all(c.end is not None for c in calls)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas that bring the client from what was sent to ``text``. Nothing sent is
        ever taken back: every piece is a prefix of what `message` reports for the whole."""
        reasoning, parsed = self._split(text, final)
        out: list[dict[str, Any]] = []
        s = self.sent
        if len(reasoning) > s.reasoning:
            out.append({"reasoning_content": reasoning[s.reasoning :]})
            s.reasoning = len(reasoning)
        content = self._content(text, parsed, final)
        if len(content) > s.content:
            out.append({"content": content[s.content :]})
            s.content = len(content)
        for i, c in enumerate(parsed.named_calls()):
            if i >= len(s.call_ids):
                s.call_ids.append(self._id(i))
                s.call_args.append(0)
                header = {
                    "index": i,
                    "id": self._id(i),
                    "type": "function",
                    "function": {"name": c.name, "arguments": ""},
                }
                out.append({"tool_calls": [header]})
            args = _arguments(c)
            if len(args) > s.call_args[i]:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[s.call_args[i] :]}}]})
                s.call_args[i] = len(args)
        return out


def _arguments(call: CallScan) -> str:
    """A call's ``arguments`` string: its raw text so far, or ``{}`` for a call object
    that closed without any."""
    return "{}" if call.end is not None and not call.args else call.args
