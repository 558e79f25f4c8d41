"""Request models of the OpenAI-compatible routes (pydantic v2).

Unknown fields are ignored (clients send vendor extras); known fields are
type- and range-checked so that a bad value is a 400 naming the field.
Integer fields are strict: ``true`` or ``"5"`` is a 400, not read as 1 or 5
(pydantic's lax mode would coerce them; ``/generate`` refuses them too). The
extra sampling fields that SGLang accepts (top_k, min_p, regex, json_schema,
stop_regex, ...) are accepted here too.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingExtras(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: StrictInt = Field(1, ge=1)  # at most --max-n (checked by the route)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
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
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
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
    cache_salt: Optional[str] = None
    # OpenAI's cache hint; here, with cache_salt, a radix namespace (intake.cache_namespace)
    prompt_cache_key: Optional[str] = None
    rid: Optional[str] = None
    # SGLang's: waiting-queue order under --enable-priority-scheduling. Strict, as on /generate: "1" and
    # true are 400s, not coerced; the range (--max-client-priority) is checked at the front door.
    priority: Optional[StrictInt] = None
    # radixrt's: usage.cache_info explains each prompt's radix-cache match ("full": the admin's view)
    return_cache_info: Union[StrictBool, Literal["full"]] = False

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
            "no_stop_trim": self.no_stop_trim,
            "speculative": self.speculative,
            "kv_budget": self.kv_budget,
            "kv_budget_policy": self.kv_budget_policy,
            "n": self.n,
            "seed": self.seed,
            "regex": self.regex,
            "json_schema": js,
            "ebnf": self.ebnf,
            "logit_bias": self.logit_bias or None,
            "length_penalty": self.length_penalty,
            "early_stopping": self.early_stopping,
            "beam_width": self.beam_width,
        }
        if self.use_beam_search and self.beam_width is None:
            width = max(self.n, getattr(self, "best_of", None) or 0)
            d["beam_width"] = width
            if width == 1:  # a beam of one is greedy decoding
                d["temperature"] = 0.0
        return {k: v for k, v in d.items() if v is not None}


class CompletionRequest(_SamplingExtras):
    # a string, a list of strings, a list of token ids or a list of such lists: checked by the route
    # (`split_prompts`), where a token id is an int and never a bool (pydantic would read true as 1)
    prompt: Any
    max_tokens: Optional[StrictInt] = Field(16, ge=0)
    logprobs: Optional[StrictInt] = Field(None, ge=0)  # at most --max-top-logprobs-num (checked by the route)
    echo: bool = False
    best_of: Optional[StrictInt] = Field(None, ge=1)
    suffix: Optional[str] = None


class TextPart(_Lenient):
    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class JsonSchemaFormat(_Lenient):
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class ChatCompletionRequest(_SamplingExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=0)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0)  # at most --max-top-logprobs-num (checked by the route)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Any]] = None  # checked by radixrt.server.tools.spec (400 naming the tool)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    separate_reasoning: Optional[bool] = None  # SGLang's: reasoning_content split from content
    chat_template_kwargs: Optional[dict[str, Any]] = None
    continue_final_message: bool = False
    # True when built from a /v1/responses request: tools and tool_choice are in the Responses
    # API's flat shapes (never set from a request body)
    _flat_tools: bool = PrivateAttr(False)
