"""Request bodies of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``), as the ``anthropic`` SDK and agents built on it
(Claude Code's ``ANTHROPIC_BASE_URL``) send them.

Content blocks radixrt reads: ``text``; ``tool_use`` (an assistant's call) and
``tool_result`` (its answer, text or text blocks); ``thinking`` and
``redacted_thinking`` are accepted and not shown to the model again (chat
templates drop earlier reasoning). ``image``, ``document`` and the server tools
(web search, code execution, computer use) are refused with a 400: this
runtime serves text models. Unknown request fields are ignored, as the SDK and
Claude Code attach beta fields (``betas``, ``container``, ``cache_control``...)
whatever the backend. ``output_config.format`` (a JSON schema) is structured output.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Union[StrictStr, list[dict[str, Any]], None] = None  # text, or blocks (text read; others refused)
    is_error: Optional[StrictBool] = None


class ThinkingBlock(_Lenient):
    type: Literal["thinking", "redacted_thinking"]


class OtherBlock(_Lenient):
    """Any other block type (image, document, server tool results...): refused by name."""

    type: StrictStr


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, OtherBlock]


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: Union[StrictStr, list[Block]]


class Tool(_Lenient):
    """A client tool (``type`` absent or ``custom``); a server tool's type is refused."""

    name: StrictStr = Field(min_length=1, max_length=128)
    description: Optional[StrictStr] = None
    input_schema: dict[str, Any]
    type: Optional[StrictStr] = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[StrictStr] = None
    disable_parallel_tool_use: Optional[StrictBool] = None


class Thinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[StrictInt] = Field(None, ge=1)  # accepted; the output's max_tokens bounds thinking


class OutputFormat(_Lenient):
    """Structured output: the answer's text is JSON valid for ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    format: Optional[OutputFormat] = None
    effort: Optional[StrictStr] = None  # accepted, not used


class CountTokensRequest(_Lenient):
    model: StrictStr
    messages: list[Message]
    system: Union[StrictStr, list[TextBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: Optional[list[StrictStr]] = None
    stream: Optional[StrictBool] = None
    # the current SDK sends no sampling fields (extra_body does); older ones and raw clients do
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(None, ge=0)
    metadata: Optional[dict[str, Any]] = None  # user_id: accepted, not used
