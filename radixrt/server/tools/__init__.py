"""OpenAI tool calling: tool definitions and tool_choice (spec), the output
formats (parsers), prompt rendering of tools and tool turns (render), the
grammar that enforces calls (grammar), reasoning separation (reasoning) and
a choice's message or stream deltas (output). docs/tool_calling.md is the
user's guide."""

from radixrt.server.tools.output import ChoiceOutput, reasoning_fields
from radixrt.server.tools.parsers import PARSER_CHOICES, ToolCallParser, get_parser, template_renders_tools
from radixrt.server.tools.spec import ToolError, ToolRequest, check_tools

__all__ = [
    "ChoiceOutput",
    "PARSER_CHOICES",
    "ToolCallParser",
    "ToolError",
    "ToolRequest",
    "check_tools",
    "get_parser",
    "reasoning_fields",
    "template_renders_tools",
]
