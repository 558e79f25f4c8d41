"""Scanning JSON in text that may still be growing (a streamed model output).

The parsers need to know, for a call object such as
``{"name": "f", "arguments": {"x": 1}}`` that may be cut anywhere, the name
once its string is complete and the raw text of the arguments seen so far.
Raw text (not a re-serialisation) keeps every streamed fragment a prefix of
the final arguments string, and keeps the model's own bytes, which is what
makes a re-rendered conversation byte-identical to what was generated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.server.tools.spec import is_tool_name

_WS = " \t\r\n"
ARG_KEYS = ("arguments", "parameters")
# a \uD800-\uDFFF escape: json.loads makes it a lone surrogate, which no UTF-8 encoder takes
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_json(text: str) -> Any:
    """``json.loads(text)``, with ValueError (as for any invalid JSON) where Python's own
    parser would raise RecursionError (arrays or objects nested about a thousand deep) or the
    value would hold a lone UTF-16 surrogate (``"\\ud800"``), which a response cannot encode.
    Text from clients and from the model (which a client can steer) both pass here."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("JSON holds a lone UTF-16 surrogate") from None
        except RecursionError:
            raise ValueError("JSON nested too deep") from None
    return value


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


class ScanMemo:
    """What earlier scans of a text that only grows (a streamed output) found, so that each
    new scan starts where the last one stopped instead of at the start: a stream's parses
    cost its length once, not once per chunk (the API server parses on its event loop).
    Valid for one text; `ChoiceOutput` starts a new one where the text's start moves."""

    def __init__(self) -> None:
        self.partial: dict[int, tuple[int, int, bool]] = {}  # value start -> (resume at, depth, in a string)
        self.ends: dict[int, int] = {}  # value start -> its end
        self.calls: dict[int, CallScan] = {}  # call start -> the finished call scanned there


def value_end(text: str, pos: int, memo: Optional[ScanMemo] = None) -> Optional[int]:
    """The end (exclusive) of the JSON value starting at ``pos`` (no leading
    whitespace), or None when the text ends inside it. Not a validator: it
    tracks strings and bracket depth only. ``memo``: see `ScanMemo`."""
    if pos >= len(text):
        return None
    if memo is not None and pos in memo.ends:
        return memo.ends[pos]
    end = _value_end(text, pos, memo.partial if memo is not None else None)
    if end is not None and memo is not None:
        memo.ends[pos] = end
        memo.partial.pop(pos, None)
    return end


def _value_end(text: str, pos: int, partial: Optional[dict[int, tuple[int, int, bool]]]) -> Optional[int]:
    c = text[pos]
    if c == '"':
        i = partial[pos][0] if partial and pos in partial else pos + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        if partial is not None:
            partial[pos] = (i, 0, True)
        return None
    if c in "{[":
        i, depth, in_str = partial[pos] if partial and pos in partial else (pos, 0, False)
        while i < len(text):
            ch = text[i]
            if in_str:
                if ch == "\\":
                    i += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        if partial is not None:
            partial[pos] = (i, depth, in_str)
        return None
    i = pos  # number, true, false, null: up to a delimiter
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None


@dataclass
class CallScan:
    """One call object as far as the text goes."""

    name: Optional[str] = None  # once its string is complete
    args: str = ""  # raw arguments text so far ("" until it starts; whole when a JSON string)
    args_done: bool = False
    end: Optional[int] = None  # end of the object (exclusive) once complete
    bad: bool = False  # not a call object (or not JSON) before its name was read


def scan_call(text: str, pos: int, memo: Optional[ScanMemo] = None) -> CallScan:
    """Scan ``{"name": ..., "arguments"|"parameters": ...}`` at ``pos`` (any key order,
    other keys ignored). ``bad`` when the text cannot be such an object."""
    if memo is not None and pos in memo.calls:
        return memo.calls[pos]
    out = _scan_call(text, pos, memo)
    if memo is not None and (out.end is not None or out.bad):  # finished: no later text changes it
        memo.calls[pos] = out
    return out


def _scan_call(text: str, pos: int, memo: Optional[ScanMemo]) -> CallScan:
    out = CallScan()
    if pos >= len(text):
        return out
    if text[pos] != "{":
        out.bad = True
        return out
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return out
        if text[i] == "}":
            out.end = i + 1
            out.bad = out.name is None
            return out
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return _malformed(out)
        kend = value_end(text, i, memo)
        if kend is None:
            return out
        try:
            key = load_json(text[i:kend])
        except ValueError:
            return _malformed(out)
        i = skip_ws(text, kend)
        if i >= len(text):
            return out
        if text[i] != ":":
            return _malformed(out)
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return out
        vend = value_end(text, i, memo)
        if key == "name":
            if vend is None:
                return out
            try:
                name = load_json(text[i:vend])
            except ValueError:
                out.bad = True
                return out
            if not is_tool_name(name):  # the rule every tool the client defines follows
                out.bad = True
                return out
            out.name = name
        elif key in ARG_KEYS:
            if text[i] == '"':  # arguments given as a JSON string: whole or nothing
                if vend is None:
                    return out
                try:
                    out.args = load_json(text[i:vend])
                except ValueError:
                    return _malformed(out)
            else:
                out.args = text[i:vend] if vend is not None else text[i:]
            if vend is None:
                return out
            out.args_done = True
        elif vend is None:
            return out
        i = vend


def _malformed(out: CallScan) -> CallScan:
    """The call object turned out malformed here: ``bad`` before its name was read; after
    it, the call stays (a client may already have been sent its name) and ends unfinished."""
    out.bad = out.name is None
    return out
