"""Tool-call parsers: one small class per output format, behind one ABC.

A parser knows its format both ways:

* reading: ``parse(text, final)`` splits a model output (possibly still
  growing) into the content before the calls and the calls scanned so far;
* writing: ``render_calls`` writes calls back in the format (assistant turns
  of the generic rendering), and ``call_begin``/``call_end``/``separator``/
  ``block_begin``/``block_end``/``trigger`` describe it for the grammar that
  enforces calls (radixrt/server/tools/grammar.py).

Formats:

* ``qwen`` (Qwen2.5, Qwen3, Hermes-style templates)::

      <tool_call>
      {"name": "f", "arguments": {...}}
      </tool_call>

  one block per call, blocks separated by a newline.
* ``generic``: the same text, used with any model whose chat template does
  not render tools; the tools are then described in the system message
  (radixrt/server/tools/render.py). docs/tool_calling.md documents it.
* ``llama3`` (Llama 3.1/3.2/3.3 JSON tool calling):
  ``{"name": "f", "parameters": {...}}``, optionally after ``<|python_tag|>``,
  several calls separated by ``;``.
* ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from radixrt.requests.reasoning import partial_suffix
from radixrt.server.tools.scan import CallScan, ScanMemo, scan_call, skip_ws


@dataclass
class ParseResult:
    """A model output split into content and calls.

    ``content`` is the text before the first call (all of the text when there
    is none); while the output grows (``final`` False), a tail that may still
    turn into a call marker is held back from it. ``calls`` are the scanned
    call objects in order, the last possibly incomplete."""

    content: str
    calls: list[CallScan] = field(default_factory=list)

    def named_calls(self) -> list[CallScan]:
        """Calls whose name has been read (a valid tool name): what a stream announces as
        soon as it can, so what the whole message reports too, finished or not (cut off by
        the token limit, or malformed after the name: arguments as far as they go, as
        OpenAI's models' own may be; clients check them)."""
        return [c for c in self.calls if c.name]


class ToolCallParser(ABC):
    """One tool-call output format."""

    name: ClassVar[str]
    trigger: ClassVar[str]  # text that opens the calls (the grammar's trigger under "auto")
    markers: ClassVar[tuple[str, ...]]  # texts that start the calls when read
    args_key: ClassVar[str] = "arguments"
    call_end: ClassVar[str] = "}"
    separator: ClassVar[str] = "\n"
    block_begin: ClassVar[str] = ""  # text around all calls (Mistral's list)
    block_end: ClassVar[str] = ""
    # the calls' ids: OpenAI's "call_<24 hex>", or (Mistral's templates refuse any other) 9 letters and digits
    short_call_ids: ClassVar[bool] = False

    def call_begin(self, name: str) -> str:
        """The text of a call up to its arguments' value."""
        return '{"name": ' + json.dumps(name) + f', "{self.args_key}": '

    def render_call(self, name: str, arguments: str) -> str:
        return self.call_begin(name) + (arguments or "{}") + self.call_end

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """``(name, arguments JSON text)`` pairs as the model would write them."""
        return self.block_begin + self.separator.join(self.render_call(n, a) for n, a in calls) + self.block_end

    def parse(self, text: str, final: bool = True, memo: Optional[ScanMemo] = None) -> ParseResult:
        """``text`` split into content and calls; ``memo``: what earlier parses of a
        shorter ``text`` (the same output, streamed) found (see `ScanMemo`)."""
        start = self._find_start(text)
        if start is None:
            hold = 0 if final else max(partial_suffix(text, m) for m in self.markers)
            return ParseResult(text[: len(text) - hold])
        calls, bad = self._scan_block(text, start, memo)
        if bad:
            return ParseResult(text)
        return ParseResult(text[:start], calls)

    def _find_start(self, text: str) -> Optional[int]:
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None

    @abstractmethod
    def _scan_block(self, text: str, start: int, memo: Optional[ScanMemo]) -> tuple[list[CallScan], bool]:
        """The calls from ``start`` (where a marker begins) and whether the text
        there turned out not to be calls."""


class QwenParser(ToolCallParser):
    """``<tool_call>\\n{json}\\n</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes)."""

    name = "qwen"
    trigger = "<tool_call>"
    markers = ("<tool_call>",)
    call_end = "}\n</tool_call>"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def call_begin(self, name: str) -> str:
        return self.OPEN + "\n" + super().call_begin(name)

    def _scan_block(self, text: str, start: int, memo: Optional[ScanMemo]) -> tuple[list[CallScan], bool]:
        return scan_calls(text, start, self.OPEN, self.CLOSE, memo)


class GenericParser(QwenParser):
    """The documented generic format (the same text as ``qwen``), for models
    whose chat template does not render tools."""

    name = "generic"


class Llama3Parser(ToolCallParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": ...}``, optionally after
    ``<|python_tag|>``, separated by ``;``."""

    name = "llama3"
    trigger = '{"name": '
    markers = ("<|python_tag|>", '{"name"')
    args_key = "parameters"
    separator = "; "
    TAG = "<|python_tag|>"

    def _scan_block(self, text: str, start: int, memo: Optional[ScanMemo]) -> tuple[list[CallScan], bool]:
        pos = start + len(self.TAG) if text.startswith(self.TAG, start) else start
        return scan_calls(text, pos, "", ";", memo)


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]``."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]",)
    separator = ", "
    block_begin = "[TOOL_CALLS]["
    block_end = "]"
    short_call_ids = True

    def _scan_block(self, text: str, start: int, memo: Optional[ScanMemo]) -> tuple[list[CallScan], bool]:
        pos = skip_ws(text, start + len(self.trigger))
        if pos >= len(text):
            return [], False
        if text[pos] != "[":
            return [], True
        return scan_calls(text, pos + 1, "", ",", memo)


def scan_calls(
    text: str, pos: int, opener: str, separator: str, memo: Optional[ScanMemo] = None
) -> tuple[list[CallScan], bool]:
    """The calls from ``pos``: each JSON call after ``opener`` (may be empty),
    the next one only after ``separator``. Returns (calls, bad): ``bad`` when
    the first call is malformed; a later malformed one ends the block."""
    calls: list[CallScan] = []
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text) or not text.startswith(opener, pos):
            return calls, False
        c = scan_call(text, skip_ws(text, pos + len(opener)), memo)
        if c.bad:
            return calls, not calls
        calls.append(c)
        if c.end is None:
            return calls, False
        pos = skip_ws(text, c.end)
        if not text.startswith(separator, pos):
            return calls, False
        pos += len(separator)


PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen": QwenParser,
    "generic": GenericParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}
ALIASES = {
    "qwen25": "qwen",
    "qwen2": "qwen",
    "qwen3": "qwen",
    "hermes": "qwen",
    "llama": "llama3",
    "llama31": "llama3",
    "llama32": "llama3",
    "llama3_json": "llama3",  # vLLM's name
}
PARSER_CHOICES = ("auto", *PARSERS, *ALIASES)


def template_renders_tools(chat_template: Optional[str]) -> bool:
    """The chat template reads a ``tools`` variable (so it renders tool definitions)."""
    return chat_template is not None and "tools" in chat_template


def detect_parser(chat_template: Optional[str]) -> str:
    """The parser that fits a chat template's tool format; ``generic`` when it has none."""
    t = chat_template or ""
    if not template_renders_tools(t):
        return "generic"
    if "<tool_call>" in t:
        return "qwen"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "generic"


def get_parser(name: Optional[str], chat_template: Optional[str]) -> ToolCallParser:
    """The parser named by ``--tool-call-parser`` (``auto``/None: from the template)."""
    if not name or name == "auto":
        name = detect_parser(chat_template)
    name = ALIASES.get(name, name)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_CHOICES)}")
    return PARSERS[name]()
