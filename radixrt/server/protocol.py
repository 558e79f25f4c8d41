"""Request models of the OpenAI-compatible routes (pydantic v2).

Unknown fields are ignored (clients send vendor extras); known fields are
type- and range-checked so that a bad value is a 400 naming the field.
Integer and boolean fields are strict: ``true`` or ``"5"`` is a 400, not read as
1 or 5, and ``"yes"`` is not true (pydantic's lax mode would coerce them;
``/generate`` refuses them too). OpenAI documents its fields as nullable
("boolean or null"): an explicit ``null`` means the field's default. The
extra sampling fields that SGLang accepts (top_k, min_p, regex, json_schema,
stop_regex, ...) are accepted here too.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Literal, Optional, Union, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)


@functools.cache
def _nullable_fields(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, f in cls.model_fields.items() if type(None) in get_args(f.annotation))


# a union's branch in a pydantic error's loc ("messages.0.content.str"): not a field's name
UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|(list|dict|literal|function-\w+|json-or-python)\[.*\])$")


def field_path(loc: Any) -> Optional[str]:
    """A pydantic error's loc as the request field's dotted name, without the body and
    the unions' branches (None for the body as a whole)."""
    parts = [str(p) for p in loc if p != "body" and not UNION_BRANCH.match(str(p))]
    return ".".join(parts) or None


class Lenient(BaseModel):
    """Unknown fields are ignored; a null on a field that cannot hold one is its default."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """A null on a field that cannot hold one is the field left out (its default)."""
        if isinstance(data, dict) and None in data.values():
            keep = _nullable_fields(cls)
            data = {k: v for k, v in data.items() if v is not None or k in keep}
        return data


class StreamOptions(Lenient):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # with include_usage: every chunk carries the usage so far


class JsonSchemaFormat(Lenient):
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    # SGLang's structural_tag type: xgrammar's tag (``format``) or the earlier form (``structures``, ``triggers``)
    format: Optional[Any] = None
    structures: Optional[Any] = None
    triggers: Optional[Any] = None


# fields of vLLM's and SGLang's OpenAI requests that change the answer and that these routes do not
# implement: a 400 saying so (`_SamplingExtras._refused`), not ignored as unknown fields are
UNIMPLEMENTED_FIELDS = {
    **dict.fromkeys(
        ("logits_processors",),
        "is vLLM's, and this server does not implement it",
    ),
    "custom_logit_processor": "is SGLang's, and this server does not implement it",
    **dict.fromkeys(
        ("functions", "function_call"), "is OpenAI's deprecated form of tools: send 'tools' and 'tool_choice'"
    ),
}


class _SamplingExtras(Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None  # as SGLang and vLLM: unset (or SGLang's "default") is the served model
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: StrictInt = Field(1, ge=1)  # at most --max-n (checked by the route)
    best_of: Optional[StrictInt] = Field(None, ge=1)  # vLLM's: n, or a beam width (check_limits)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None  # only with stream (`_stream_options_need_stream`)
    stop: Optional[Union[str, list[str]]] = None
    stop_regex: Optional[Union[str, list[str]]] = None  # SGLang's extra
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    seed: Optional[StrictInt] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # SGLang / vLLM extras
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    min_tokens: Optional[StrictInt] = Field(None, ge=0)
    ignore_eos: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None
    spaces_between_special_tokens: Optional[StrictBool] = None
    no_stop_trim: Optional[StrictBool] = None
    # vLLM's: served as no_stop_trim (the stop string stays, and the rest of the token that completed it)
    include_stop_str_in_output: Optional[StrictBool] = None
    speculative: Optional[StrictBool] = None  # radixrt's: false opts out of speculative decoding
    # radixrt's: the KV the request attends at most (tokens or a fraction of its context) and the policy
    kv_budget: Optional[Union[StrictInt, StrictFloat]] = None
    kv_budget_policy: Optional[str] = None
    # beam search: vLLM's use_beam_search (its width is n, or best_of when larger), or SGLang's beam_width;
    # length_penalty and early_stopping as in transformers
    use_beam_search: Optional[StrictBool] = None
    beam_width: Optional[StrictInt] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[Union[StrictBool, Literal["never"]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    regex: Optional[str] = None
    json_schema: Optional[Union[str, dict[str, Any]]] = None
    ebnf: Optional[str] = None
    response_format: Optional[ResponseFormat] = None  # chat's; on completions as vLLM takes it
    # vLLM's structured outputs, read (and their kinds checked) by radixrt.server.vllm_structured
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    cache_salt: Optional[str] = None
    extra_key: Optional[str] = None  # SGLang's: a radix namespace with cache_salt (cache_fields.cache_namespace)
    # OpenAI's cache hint; here, with cache_salt, a radix namespace (cache_fields.cache_namespace)
    prompt_cache_key: Optional[str] = None
    rid: Optional[str] = None
    lora_path: Optional[str] = None  # SGLang's: the adapter, where ``model`` names none
    # SGLang's: waiting-queue order under --enable-priority-scheduling. Strict, as on /generate: "1" and
    # true are 400s, not coerced; the range (--max-client-priority) is checked at the front door.
    priority: Optional[StrictInt] = None
    # radixrt's: usage.cache_info explains each prompt's radix-cache match ("full": the admin's view)
    return_cache_info: Union[StrictBool, Literal["full"]] = False
    # vLLM's, for token-in token-out clients (RL rollouts): the prompt's token ids and each choice's
    # output ids (streamed: the prompt's in a choice's first chunk, then each chunk's new ids)
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False  # vLLM's: logprobs name tokens "token_id:<id>"
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds; `openai_checks.truncated`)
    truncate_prompt_tokens: Optional[StrictInt] = Field(None, ge=-1)
    # vLLM's: the prompt's logprobs with its k likeliest tokens a position (radixrt/server/prompt_logprobs.py)
    prompt_logprobs: Optional[StrictInt] = Field(None, ge=0)
    # vLLM's: only these tokens may be sampled; words the output must not contain (tokenized by the
    # route: `openai_checks.bad_words_sampling`); radixrt/sampling/token_filters.py
    allowed_token_ids: Optional[list[StrictInt]] = None
    bad_words: Optional[list[str]] = None
    # SGLang's (with --enable-return-hidden-states): each choice's ``hidden_states``, the model's last
    # hidden state at the position that produced the choice's last token ("last" says the same)
    return_hidden_states: Union[StrictBool, Literal["last"]] = False
    # UNIMPLEMENTED_FIELDS: refused when set
    logits_processors: Any = None
    custom_logit_processor: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator(*UNIMPLEMENTED_FIELDS)
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        asks_nothing = value is None or value is False or (isinstance(value, (list, dict)) and not value)
        if not asks_nothing:  # vLLM's bad_words: [] (its default) asks for nothing
            raise ValueError(UNIMPLEMENTED_FIELDS[str(info.field_name)])
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_are_not_streamed(cls, value: Optional[int], info: ValidationInfo) -> Any:
        if value is not None and info.data.get("stream"):
            raise ValueError("not available when 'stream' is true (as in vLLM)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Optional[StreamOptions], info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when 'stream' is true")
        return value

    def sampling_dict(self, max_new_tokens: Optional[int]) -> dict[str, Any]:
        """The SGLang sampling parameters this request asks for (None: default)."""
        js = self.json_schema
        if isinstance(js, dict):
            import json

            js = json.dumps(js)
        d = {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "stop_regex": self.stop_regex,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim if self.no_stop_trim is not None else self.include_stop_str_in_output,
            "speculative": self.speculative,
            "kv_budget": self.kv_budget,
            "kv_budget_policy": self.kv_budget_policy,
            "n": self.n,
            "seed": self.seed,
            "regex": self.regex,
            "json_schema": js,
            "ebnf": self.ebnf,
            "logit_bias": self.logit_bias or None,
            "allowed_token_ids": self.allowed_token_ids,
            "length_penalty": self.length_penalty,
            "early_stopping": self.early_stopping,
            "beam_width": self.beam_width,
        }
        if self.use_beam_search and self.beam_width is None:
            width = max(self.n, self.best_of or 0)
            d["beam_width"] = width
            if width == 1:  # a beam of one is greedy decoding
                d["temperature"] = 0.0
        return {k: v for k, v in d.items() if v is not None}


class CompletionRequest(_SamplingExtras):
    # a string, a list of strings, a list of token ids or a list of such lists: checked by the route
    # (`split_prompts`), where a token id is an int and never a bool (pydantic would read true as 1)
    prompt: Any
    max_tokens: StrictInt = Field(16, ge=0)  # OpenAI's default, also for an explicit null
    logprobs: Optional[StrictInt] = Field(None, ge=0)  # at most --max-top-logprobs-num (checked by the route)
    echo: StrictBool = False
    suffix: Optional[str] = None
    # SGLang's: one adapter for all prompts, or one per prompt (None: the base model)
    lora_path: Union[str, list[Optional[str]], None] = None  # type: ignore[assignment]


class TextPart(Lenient):
    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None  # an assistant's refusal part


def join_text_parts(parts: list[str]) -> str:
    """A message's text parts (chat's content parts, Responses' and Anthropic's text blocks) as
    the one text a chat template renders: one per line, as vLLM joins them, so that the last
    word of one part and the first of the next stay apart."""
    return "\n".join(parts)


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    function_call: Optional[dict[str, Any]] = None  # OpenAI's deprecated form of one tool call
    # an assistant turn's reasoning, for templates that render it back (SGLang's name; vLLM's newer one)
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class ChatCompletionRequest(_SamplingExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=0)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0)  # at most --max-top-logprobs-num (checked by the route)
    tools: Optional[list[Any]] = None  # checked by radixrt.server.tools.spec (400 naming the tool)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    separate_reasoning: Optional[StrictBool] = None  # SGLang's: reasoning_content split from content
    stream_reasoning: StrictBool = True  # SGLang's: false sends a choice's reasoning as one delta
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # OpenAI's; passed to the chat template as ``reasoning_effort`` (as vLLM and SGLang do: gpt-oss's reads it)
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    continue_final_message: StrictBool = False
    # vLLM's: false renders the conversation without the assistant turn's opening (the model writes it)
    add_generation_prompt: StrictBool = True
    # SGLang's (whole answers only): each choice's prompt ids, and its native /generate meta_info
    return_prompt_token_ids: StrictBool = False
    return_meta_info: StrictBool = False
    # True when built from a /v1/responses request: tools and tool_choice are in the Responses
    # API's flat shapes (never set from a request body)
    _flat_tools: bool = PrivateAttr(False)

    @field_validator("return_prompt_token_ids", "return_meta_info")
    @classmethod
    def _whole_answers_only(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("stream"):  # as SGLang: return_token_ids streams them instead
            raise ValueError("not supported with 'stream'; use return_token_ids to stream token ids")
        return value
