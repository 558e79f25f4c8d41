"""Request model of the OpenAI Responses API (``POST /v1/responses``, pydantic v2).

``input`` is a string (one user message) or a list of items, each told
apart by its ``type`` (a message may leave it out):

* ``message``: ``role`` (user, system, developer, assistant) and
  ``content``, a string or a list of text parts (``input_text``,
  ``output_text``, ``text``);
* ``function_call``: a call the model made (``call_id``, ``name``,
  ``arguments`` as a JSON string), as the previous response gave it;
* ``function_call_output``: the result of a call (``call_id``, ``output``);
* ``reasoning``: accepted (clients send back what they received) and not
  shown to the model again, as chat templates drop earlier reasoning;
* ``item_reference``: refused (send the item itself, or continue with
  ``previous_response_id``).

An item of another type, or a field of the wrong type, is a 400 naming it
(``input.2.call_id``). Unknown top-level fields are ignored, as on the other
OpenAI routes; integer fields are strict (``"5"`` and ``true`` are 400s),
as on chat; ``tools`` and ``tool_choice`` are checked by the chat path
(radixrt.server.tools.spec, in their flat Responses shapes).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, StrictBool, StrictInt, Tag, TypeAdapter, ValidationError

from radixrt.server.protocol import UNION_BRANCH, Lenient

# OpenAI's limits on metadata: at most 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class ContentPart(Lenient):
    """A part of a message's content; only text parts can be given to the model."""

    type: str
    text: Optional[str] = None


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ContentPart]]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    status: Optional[str] = None  # "incomplete": cut by the token limit, its arguments as far as they went


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, list[ContentPart]]


class ReasoningItem(Lenient):
    type: Literal["reasoning"]


class ItemReference(Lenient):
    type: Literal["item_reference"]
    id: Optional[str] = None


def _item_type(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[ReasoningItem, Tag("reasoning")],
        Annotated[ItemReference, Tag("item_reference")],
    ],
    Discriminator(_item_type),
]


class TextFormat(Lenient):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(Lenient):
    format: Optional[TextFormat] = None


# OpenAI's ``include`` values. Only the logprobs change an answer here; the others name output this
# server never makes (hosted tools' results, images, encrypted reasoning), so there is nothing to add.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = (
    LOGPROBS_INCLUDE,
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)


class ResponsesRequest(Lenient):
    model: str
    input: Any  # a string or a list of items: checked by `parse_input` (400 naming the item's field)
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = Field(None, min_length=1)
    store: StrictBool = True
    stream: StrictBool = False
    background: StrictBool = False  # only False: a response is answered (or streamed) on its request
    conversation: Any = None  # OpenAI's stored conversations: not kept here (a 400 when set)
    tools: Optional[list[Any]] = None  # checked by radixrt.server.tools.spec (400 naming the tool)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    max_output_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    text: Optional[TextConfig] = None
    truncation: Optional[Literal["disabled", "auto"]] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    include: Optional[list[str]] = None  # of INCLUDABLE; "message.output_text.logprobs" asks for logprobs
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    prompt_cache_key: Optional[str] = None  # as on chat: a radix-cache namespace
    # SGLang / radixrt extras, as on the chat route
    cache_salt: Optional[str] = None
    priority: Any = None  # checked by the chat request it becomes (the same rules as on chat)
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    seed: Optional[StrictInt] = None
    kv_budget: Any = None  # checked by the chat request it becomes
    kv_budget_policy: Any = None


_ITEMS = TypeAdapter(list[InputItem])


def _where(loc: tuple) -> str:
    """A pydantic loc inside ``input`` as the field's name: ``input[2].call_id``
    (without the item's tag and the unions' branches)."""
    head, *rest = loc
    out = f"input[{head}]"
    if rest and rest[0] in ITEM_TYPES:
        rest = rest[1:]
    for p in rest:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not UNION_BRANCH.match(str(p)):
            out += f".{p}"
    return out


class InputError(ValueError):
    """A bad ``input``; ``where`` names the field (``input[2].call_id``)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def parse_input(value: Any) -> list[dict[str, Any]]:
    """``input`` as item dicts (a string is one user message); InputError
    naming the field when it is not a string or a list of valid items."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise InputError(f"'input' must be a string or a list of input items, got {type(value).__name__}.", "input")
    try:
        items = _ITEMS.validate_python(value)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        err = max(errors, key=lambda x: len(x["loc"]))  # the deepest: inside the union branch that fits best
        where = _where(err["loc"])
        kind = err["type"]
        if kind == "union_tag_invalid":
            msg = (
                f"'{where}.type' is {err['input'].get('type')!r}; expected one of "
                f"{', '.join(repr(t) for t in ITEM_TYPES)}."
            )
        elif kind == "union_tag_not_found":
            msg = f"'{where}' must be an input item (an object), got {type(err['input']).__name__}."
        elif UNION_BRANCH.match(str(err["loc"][-1])):
            msg = f"'{where}' must be a string or a list of text parts."
        else:
            msg = f"Invalid value for '{where}': {err['msg']}"
        raise InputError(msg, where) from None
    return [item.model_dump(by_alias=True, exclude_none=True) for item in items]
