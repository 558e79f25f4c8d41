"""The xgrammar structural tag that constrains a request's tool calls.

* ``"required"``: the output is one or more calls (one with
  ``parallel_tool_calls: false``), each naming a tool and carrying arguments
  that match its schema, and nothing else.
* a named function: exactly one call of that tool.
* ``"auto"``: free text; once the format's trigger appears (``<tool_call>``,
  ``[TOOL_CALLS]``, ``{"name": ``) the call is constrained like the above.
* ``"none"``: no grammar.

With ``reasoning`` (a ``<think>`` model whose reasoning is separated), an
enforced call may be preceded by one ``<think>...</think>`` block; under the
``deepseek-r1`` rule, whose prompt opens the block, it must be: the output
thinks up to ``</think>``, then calls.

The arguments' grammar is xgrammar's JSON-schema grammar with radixrt's fixed
separators (``", "``, ``": "``, no free whitespace, as for ``json_schema``
requests): a small model cannot wander into whitespace, the punctuation and
keys become forced text for jump-forward, and the layout matches what chat
templates' ``tojson`` writes when the call is rendered back.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Optional

from radixrt.requests.reasoning import opened_by_prompt
from radixrt.sampling.json_schema_grammar import json_schema_ebnf
from radixrt.server.tools.parsers import ToolCallParser
from radixrt.server.tools.spec import ToolRequest, ToolSpec


@functools.lru_cache(maxsize=256)
def _schema_ebnf(schema_json: str) -> str:
    return json_schema_ebnf(schema_json)


def _tags(parser: ToolCallParser, tools: list[ToolSpec]) -> list[Any]:
    from xgrammar.structural_tag import GrammarFormat, TagFormat

    return [
        TagFormat(
            begin=parser.call_begin(t.name),
            # the schema's key order is the arguments' (OpenAI's structured outputs keep it)
            content=GrammarFormat(grammar=_schema_ebnf(json.dumps(t.parameters))),
            end=parser.call_end,
        )
        for t in tools
    ]


def tool_call_structural_tag(parser: ToolCallParser, tr: ToolRequest, reasoning: str = "") -> Optional[str]:
    """The structural tag (JSON text, for the ``structural_tag`` sampling
    parameter) that enforces ``tr``'s calls in ``parser``'s format; None when
    calls are off."""
    from xgrammar.structural_tag import (
        AnyTextFormat,
        ConstStringFormat,
        OptionalFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    if not tr.active:
        return None
    tags = _tags(parser, tr.allowed())
    single = tr.mode == "named" or not tr.parallel
    calls = TagsWithSeparatorFormat(tags=tags, separator=parser.separator, at_least_one=True, stop_after_first=single)
    fmt: Any
    if tr.enforced:
        if parser.block_begin or parser.block_end:
            fmt = SequenceFormat(
                elements=[ConstStringFormat(value=parser.block_begin), calls, ConstStringFormat(value=parser.block_end)]
            )
        elif single or parser.separator.strip():
            fmt = calls
        else:
            # after its last call the output may end with the separator (a newline): a model that
            # writes one there is not then held to write another call. (One call ends right after
            # it, as a template renders it back: a newline there would cost the turn's cache hit.)
            fmt = SequenceFormat(elements=[calls, OptionalFormat(content=ConstStringFormat(value=parser.separator))])
    elif parser.block_begin or parser.block_end:
        fmt = TriggeredTagsFormat(
            triggers=[parser.trigger],
            stop_after_first=True,
            tags=[TagFormat(begin=parser.block_begin, content=calls, end=parser.block_end)],
        )
    else:
        fmt = TriggeredTagsFormat(triggers=[parser.trigger], tags=tags, stop_after_first=single)
    if reasoning and tr.enforced:  # the calls follow the thinking block (a call inside it is no call)
        ends = ["</think>\n\n", "</think>\n", "</think>"]
        if opened_by_prompt(reasoning):  # the output starts inside the block: it must close first
            fmt = SequenceFormat(elements=[TagFormat(begin="", content=AnyTextFormat(), end=ends), fmt])
        else:
            think = TagFormat(begin="<think>", content=AnyTextFormat(), end=ends)
            fmt = SequenceFormat(elements=[OptionalFormat(content=think), fmt])
    return StructuralTag(format=fmt).model_dump_json()
