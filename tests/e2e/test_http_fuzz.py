"""A fuzz test of the HTTP API: hypothesis-made requests to every route of a
real `radixrt serve` (tiny random Llama, 127.0.0.1).

Every route the app serves is found from the app itself (so a new route is
fuzzed too, with generic JSON bodies until it gets its own strategy). Bodies
are built field by field from what each route takes, each field either a
plausible value or any JSON value (NaN and huge numbers included), plus raw
junk: bytes that are not JSON, wrong content types, wrong methods.

Tool calling gets its own run (`test_fuzz_tool_calling_and_responses`) on
a second server whose context holds the tools' description: chat bodies with
tools, tool_choice, assistant tool_calls and tool messages, and Responses
bodies with tools, function_call / function_call_output items and
continuations of the responses the fuzz stored (``previous_response_id``).

It checks that no request is answered with a 5xx, that none hangs (each has a
deadline), and afterwards that each server is healthy, still generates, and
holds no request's KV once idle (free + tree + private == total, private ==
0). Failures are collected over the whole run and reported together with the
requests that caused them; the counts of 2xx/4xx/5xx answers are printed.

Bounded: a fixed number of examples per route (derandomized, so CI sees the
same requests every run), a context of 64 tokens so that no generation is
long (the tools' server: every body bounds its output); about a minute and
a half on two CPU cores, the two servers' start-ups (together) included.
"""

from __future__ import annotations

import collections
import json
import math
import time
import urllib.parse
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from radixrt.bench.tiny_model import VOCAB_SIZE
from radixrt.server.local import LocalServer

pytestmark = pytest.mark.slow  # two server start-ups and ~950 requests: about a minute

REQUEST_TIMEOUT_S = 60
CONTEXT = 64  # no generation is long: a chat without max_tokens fills the context

# ---------------------------------------------------------------- value strategies
_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
ANY = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
EDGE_NUMBERS = st.sampled_from(
    [0, -1, 1, 511, 512, 513, 2**31, -(2**63), 2**64, 1e-40, 1e300, math.nan, math.inf, -math.inf, 0.5, True]
)

token_id = st.integers(0, VOCAB_SIZE - 1)
prompt_text = st.text(max_size=40) | st.sampled_from(["Hello", "x" * 3000, "\udcff", "<|im_start|>user\n", "🙂" * 5])
stops = st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3)
regexes = st.sampled_from(["[0-9]+", "abc", "a|b", "\\d{2}", ".", "^x$", "(?<=a)b", "\\s", "[a-z]{3}", "(a+)+$"])
grammars = st.one_of(
    st.fixed_dictionaries({"regex": st.sampled_from(["[a-c]{1,8}", "(yes|no)", "[0-9]{3}-[0-9]{2}", "a*"])}),
    st.fixed_dictionaries(
        {
            "json_schema": st.sampled_from(
                [
                    json.dumps(
                        {
                            "type": "object",
                            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["a"],
                        }
                    ),
                    json.dumps({"type": "string", "maxLength": 5}),
                    json.dumps({"type": "boolean"}),
                ]
            )
        }
    ),
    st.fixed_dictionaries({"ebnf": st.just('root ::= "a" | "b" "c"')}),
)


def _merge(parts: tuple) -> dict:
    out: dict = {}
    for p in parts:
        out.update(p)
    return out


def sampling(max_tokens: int = 24) -> st.SearchStrategy:
    """Valid SGLang sampling params (each field optional)."""
    plain = st.fixed_dictionaries(
        {},
        optional={
            "max_new_tokens": st.integers(0, max_tokens) | st.sampled_from([200]),  # 200: past the context
            "min_new_tokens": st.integers(0, 2),
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.05, 1),
            "top_k": st.sampled_from([-1, 1, 5, 100]),
            "min_p": st.floats(0, 0.5),
            "n": st.integers(1, 3),
            "frequency_penalty": st.floats(-2, 2),
            "presence_penalty": st.floats(-2, 2),
            "repetition_penalty": st.floats(0.5, 2),
            "stop": stops,
            "stop_regex": regexes | st.lists(regexes, max_size=3),
            "stop_token_ids": st.lists(token_id, max_size=3),
            "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(),
            "no_stop_trim": st.booleans(),
            "seed": st.integers(0, 2**32),
            "logit_bias": st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=3),
        },
    )
    return st.tuples(plain, st.just({}) | grammars).map(_merge)


def mutated(valid: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """A valid body with one field (a known one, or a new one) set to any JSON value or an edge number."""
    return st.tuples(valid, st.sampled_from(keys) | st.text(max_size=6), ANY | EDGE_NUMBERS).map(
        lambda t: {**t[0], t[1]: t[2]}
    )


def mutated_sampling(body_strategy: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """A valid /generate body with one sampling parameter set to any JSON value or an edge number."""

    def put(t: tuple) -> dict:
        body, key, value = t
        sp = body.get("sampling_params")
        return {**body, "sampling_params": {**(sp if isinstance(sp, dict) else {}), key: value}}

    return st.tuples(body_strategy, st.sampled_from(keys), ANY | EDGE_NUMBERS).map(put)


SAMPLING_KEYS = [
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_regex",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "seed",
    "regex",
    "json_schema",
    "ebnf",
    "logit_bias",
    "sampling_seed",
    "spaces_between_special_tokens",
]
_prompt = st.one_of(
    st.fixed_dictionaries({"text": prompt_text | st.lists(prompt_text, min_size=1, max_size=3)}),
    st.fixed_dictionaries(
        {
            "input_ids": st.lists(token_id, min_size=1, max_size=8)
            | st.lists(st.lists(token_id, min_size=1, max_size=4), min_size=1, max_size=3)
        }
    ),
)
GENERATE = st.tuples(
    _prompt,
    st.fixed_dictionaries(
        {},
        optional={
            "sampling_params": sampling(),
            "return_logprob": st.booleans(),
            "logprob_start_len": st.integers(-1, 3),
            "top_logprobs_num": st.integers(0, 3),
            "token_ids_logprob": st.lists(token_id, max_size=3),
            "return_text_in_logprobs": st.booleans(),
            "stream": st.booleans(),
            "rid": st.uuids().map(str),
            "cache_salt": st.text(max_size=4),
            "lora_path": st.none(),
            "session_id": st.none(),
            "log_metrics": st.booleans(),
        },
    ),
).map(_merge)
GENERATE_KEYS = [
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "rid",
    "cache_salt",
    "lora_path",
    "session_id",
    "image_data",
]

_openai_common = {
    "max_tokens": st.integers(0, 24),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": stops,
    "stop_regex": regexes,
    "seed": st.integers(0, 2**32),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "top_k": st.sampled_from([-1, 1, 5]),
    "min_p": st.floats(0, 0.5),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "user": st.text(max_size=4),
    "logit_bias": st.dictionaries(token_id.map(str), st.floats(-100, 100), max_size=2),
}
OPENAI_KEYS = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "stop_regex",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_k",
    "min_p",
    "regex",
    "json_schema",
    "ignore_eos",
    "min_tokens",
    "rid",
    "cache_salt",
    "logprobs",
    "echo",
    "best_of",
    "suffix",
    "prompt",
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    "continue_final_message",
]
COMPLETIONS = st.fixed_dictionaries(
    {
        "model": st.just("default"),
        "prompt": prompt_text
        | st.lists(prompt_text, min_size=1, max_size=3)
        | st.lists(token_id, min_size=1, max_size=6),
    },
    optional={**_openai_common, "logprobs": st.integers(0, 3), "echo": st.booleans()},
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer"]),
        "content": prompt_text
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": prompt_text}), min_size=1, max_size=2),
    }
)
CHAT = st.fixed_dictionaries(
    {
        "model": st.just("default"),
        "messages": st.lists(_message, min_size=1, max_size=3),
    },
    optional={
        **_openai_common,
        "logprobs": st.booleans(),
        "max_completion_tokens": st.integers(0, 24),
        "continue_final_message": st.booleans(),
        "response_format": st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]},
                    },
                },
            ]
        ),
    },
)

# ---------------------------------------------------------------- tool calling and the Responses API
# Tools, tool turns and Responses items, mostly valid (so that calls are enforced, parsed and streamed)
# and sometimes not: names OpenAI refuses, schemas that are unusable, recursive or a regex bomb (both must
# be 400s at once), arguments that are not JSON, results answering no call.
GOOD_FUNCTIONS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
    {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
        },
    },
    {"name": "f.x-1"},
]
GOOD_NAMES = [f["name"] for f in GOOD_FUNCTIONS]
bad_names = st.sampled_from(["bad name", "", "get_weather\n", "x" * 65, None])
bad_params = st.sampled_from(
    [
        {"type": "string"},
        {"type": "object", "properties": {"x": {"type": "no-such-type"}}},
        [],
        "{}",
        {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "a{3000000}"}}, "required": ["s"]},
    ]
)
tool_names = st.one_of(*[st.sampled_from(GOOD_NAMES)] * 6, bad_names)
# text without the lone surrogate that `prompt_text` holds (any body with it is refused at once)
clean_text = st.text(max_size=30) | st.sampled_from(["Hello", "What's the weather in Paris?", "Add 1 and 2.", ""])
_clean_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "user", "developer"]), "content": clean_text}
)
_function = st.one_of(
    *[st.sampled_from(GOOD_FUNCTIONS)] * 4,
    st.fixed_dictionaries(
        {"name": tool_names},
        optional={"description": st.text(max_size=8) | st.just(3), "parameters": bad_params, "strict": st.booleans()},
    ),
)
_functions = st.lists(_function, min_size=1, max_size=3, unique_by=lambda f: repr(f.get("name")))
# (tools that are not functions, and any other junk, come from `mutated`)
CHAT_TOOLS_LIST = _functions.map(lambda fs: [{"type": "function", "function": f} for f in fs])
FLAT_TOOLS_LIST = _functions.map(lambda fs: [{"type": "function", **f} for f in fs])
_modes = st.sampled_from(["required", "auto", "none", "required"])
CHAT_TOOL_CHOICE = st.one_of(
    _modes,
    _modes,
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": tool_names})}),
)
FLAT_TOOL_CHOICE = st.one_of(
    _modes, _modes, st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(GOOD_NAMES)})
)
call_ids = st.sampled_from(["call_1", "call_2", "call_3", "call_1", "call_2", ""])
call_arguments = st.one_of(
    *[st.sampled_from(['{"a": 1, "b": true}', '{"city": "Paris"}', "{}"])] * 3,
    st.sampled_from(["", "{", "[1]", "null"]),
)
_chat_call = st.fixed_dictionaries(
    {
        "id": call_ids,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": tool_names, "arguments": call_arguments | st.fixed_dictionaries({"a": st.integers(0, 9)})}
        ),
    }
)
_assistant_calls = st.fixed_dictionaries(
    {
        "role": st.just("assistant"),
        "content": st.none() | clean_text,
        "tool_calls": st.lists(_chat_call, min_size=1, max_size=2),
    }
)
_tool_message = st.fixed_dictionaries(
    {"role": st.just("tool"), "tool_call_id": call_ids, "content": st.none() | clean_text}
)


def _results(ids: list, result: st.SearchStrategy) -> st.SearchStrategy:
    """Results answering calls with ``ids`` (mostly one of them; sometimes another id)."""
    return st.lists(st.tuples(st.one_of(st.sampled_from(ids), st.sampled_from(ids), call_ids), result), max_size=2)


# an agent's turn (a question, the calls, their results) or any mix of messages
_chat_turn = st.tuples(_clean_message, _assistant_calls).flatmap(
    lambda t: _results([c["id"] for c in t[1]["tool_calls"]], clean_text).map(
        lambda rs: [t[0], t[1], *({"role": "tool", "tool_call_id": i, "content": c} for i, c in rs)]
    )
)
_chat_turns = st.one_of(
    _chat_turn,
    _chat_turn,
    st.lists(_clean_message, min_size=1, max_size=2),
    st.lists(_message | _assistant_calls | _tool_message, min_size=1, max_size=4),
)
CHAT_TOOLS = st.fixed_dictionaries(
    {
        "model": st.just("default"),
        "messages": _chat_turns,
        "tools": CHAT_TOOLS_LIST,
        "max_tokens": st.integers(0, 24),
    },
    optional={
        "tool_choice": CHAT_TOOL_CHOICE,
        "parallel_tool_calls": st.booleans(),
        "stream": st.booleans(),
        "temperature": st.floats(0, 2),
        "n": st.integers(1, 2),
        "separate_reasoning": st.booleans(),
        "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
    },
)

_part_types = st.sampled_from(["input_text", "output_text", "text"])  # (an image part is a 400: tests elsewhere)
_parts = st.lists(st.fixed_dictionaries({"type": _part_types, "text": clean_text}), min_size=1, max_size=2)
_item_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "system", "developer", "assistant"]),
        "content": clean_text | clean_text | _parts,
    },
    optional={"type": st.just("message")},
)
_item_call = st.fixed_dictionaries(
    {"type": st.just("function_call"), "call_id": call_ids, "name": tool_names, "arguments": call_arguments}
)
_item_output = st.fixed_dictionaries(
    {"type": st.just("function_call_output"), "call_id": call_ids, "output": clean_text | _parts}
)
_item_odd = st.sampled_from(
    [
        {"type": "reasoning", "summary": []},
        {"type": "item_reference", "id": "msg_1"},
        {"type": "bogus"},
        {"type": 5},
        5,
        None,
        [],
    ]
)
# an agent's turn as items (a question, the calls, their outputs), a question, or any mix of items
_item_turn = st.tuples(_item_message, st.lists(_item_call, min_size=1, max_size=2)).flatmap(
    lambda t: _results([c["call_id"] for c in t[1]], clean_text | _parts).map(
        lambda rs: [t[0], *t[1], *({"type": "function_call_output", "call_id": i, "output": o} for i, o in rs)]
    )
)
_items = st.one_of(
    _item_turn,
    _item_turn,
    st.lists(_item_message, min_size=1, max_size=2),
    st.lists(_item_message | _item_call | _item_output | _item_odd, max_size=4),
)
LAST_RESPONSE = "<the last response the fuzz made>"  # `Continuations` puts a real id there
_text_format = st.sampled_from(
    [
        {"format": {"type": "text"}},
        {"format": {"type": "json_object"}},
        {},
        {"format": None},
        {
            "format": {
                "type": "json_schema",
                "name": "x",
                "schema": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]},
            }
        },
    ]
)
_responses_common = {
    "instructions": clean_text,
    "stream": st.booleans(),
    "store": st.booleans(),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "previous_response_id": st.sampled_from([LAST_RESPONSE, LAST_RESPONSE, LAST_RESPONSE, "resp_nope"]),
    "text": _text_format,
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    "truncation": st.just("disabled"),
    "user": st.text(max_size=4),
    "top_k": st.sampled_from([-1, 1, 5]),
}
RESPONSES = st.fixed_dictionaries(
    {"model": st.just("default"), "input": prompt_text | _items},
    optional={**_responses_common, "max_output_tokens": st.integers(1, 24)},
)
RESPONSES_TOOLS = st.fixed_dictionaries(
    {
        "model": st.just("default"),
        "input": clean_text | _items,
        "tools": FLAT_TOOLS_LIST,
        "max_output_tokens": st.integers(1, 24),
    },
    optional={**_responses_common, "tool_choice": FLAT_TOOL_CHOICE, "parallel_tool_calls": st.booleans()},
)
# (the values refused on purpose, background: true and truncation: "auto" among them, come from `mutated`)
RESPONSES_KEYS = [
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "store",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "truncation",
    "metadata",
    "user",
    "background",
    "prompt_cache_key",
    "priority",
    "top_k",
]

ABORT = st.fixed_dictionaries({}, optional={"rid": st.text(max_size=8), "abort_all": st.booleans()})
CONCAT = st.fixed_dictionaries({"src_rids": st.lists(st.text(max_size=6), max_size=3), "dst_rid": st.text(max_size=6)})
GENERIC = st.one_of(st.just(None), ANY)
_text_or_ids = st.one_of(
    st.tuples(st.text(max_size=12), st.one_of(st.text(max_size=6), st.lists(st.text(max_size=6), max_size=3))),
    st.tuples(st.lists(token_id, max_size=6), st.lists(st.lists(token_id, max_size=4), max_size=3)),
)
SCORE = st.tuples(
    _text_or_ids,
    st.fixed_dictionaries(
        {"label_token_ids": st.lists(token_id, min_size=1, max_size=4)},
        optional={"apply_softmax": st.booleans(), "item_first": st.booleans()},
    ),
).map(lambda t: {"query": t[0][0], "items": t[0][1], **t[1]})
SCORE_KEYS = ["query", "items", "label_token_ids", "apply_softmax", "item_first", "model"]

# (method, path) -> [(strategy of JSON bodies, examples), ...]
BODIES: dict[tuple[str, str], list[tuple[st.SearchStrategy, int]]] = {
    ("POST", "/generate"): [
        (GENERATE, 50),
        (mutated(GENERATE, GENERATE_KEYS), 25),
        (mutated_sampling(GENERATE, SAMPLING_KEYS), 40),
    ],
    ("POST", "/v1/completions"): [(COMPLETIONS, 25), (mutated(COMPLETIONS, OPENAI_KEYS), 25)],
    ("POST", "/v1/chat/completions"): [(CHAT, 25), (mutated(CHAT, OPENAI_KEYS), 25)],
    ("POST", "/v1/responses"): [(RESPONSES, 20), (mutated(RESPONSES, RESPONSES_KEYS), 15)],
    ("POST", "/abort_request"): [(ABORT, 10), (mutated(ABORT, ["rid", "abort_all"]), 10)],
    ("POST", "/concate_and_append_request"): [(CONCAT, 10), (mutated(CONCAT, ["src_rids", "dst_rid"]), 10)],
    ("POST", "/v1/score"): [(SCORE, 10), (mutated(SCORE, SCORE_KEYS), 10)],
}
GENERIC_EXAMPLES = 8
# the bodies with tools, on a server whose context holds the tools' description (every body bounds its output)
TOOL_BODIES: dict[tuple[str, str], list[tuple[st.SearchStrategy, int]]] = {
    ("POST", "/v1/chat/completions"): [(CHAT_TOOLS, 35), (mutated(CHAT_TOOLS, OPENAI_KEYS), 20)],
    ("POST", "/v1/responses"): [(RESPONSES_TOOLS, 35), (mutated(RESPONSES_TOOLS, RESPONSES_KEYS), 20)],
}
# raw bodies that are not (valid) JSON objects, sent to every POST route
JUNK = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b'{"text": "a"',
            b"\xff\xfe",
            b"NaN",
            b'"text"',
            b"1e999",
            b'{"text": "a", "text": "b"}',
            b'{"a": ' * 2000,
            b'{"text": "\\ud800"}',
        ]
    ),
).map(lambda b: ("application/json", b)) | st.tuples(
    st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""]),
    st.binary(max_size=32),
)


# ---------------------------------------------------------------- the run
def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route the server's app serves."""
    from radixrt.server.http_server import build_app

    out: list[tuple[str, str]] = []

    def walk(routes: Any) -> None:
        for route in routes:
            inner = getattr(route, "original_router", None)  # an included router (newer FastAPI)
            if inner is not None:
                walk(inner.routes)
                continue
            for method in sorted(getattr(route, "methods", None) or ()):
                if method != "HEAD":
                    out.append((method, route.path))

    walk(build_app(None).routes)  # building the app reads no context
    return out


class Recorder:
    """Sends requests; counts statuses; keeps 5xx answers and hangs as failures."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.counts: collections.Counter = collections.Counter()
        self.by_route: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.failures: list[str] = []
        self.seconds: collections.Counter = collections.Counter()
        self.refusals: collections.Counter = collections.Counter()  # 4xx answers by route and message
        self.slowest: list[tuple[float, str]] = []

    def send(
        self, method: str, path: str, *, body: Any = None, raw: tuple[str, bytes] | None = None
    ) -> httpx.Response | None:
        """Send one request; its answer (None when none came)."""
        kwargs: dict[str, Any] = {}
        if raw is not None:
            ctype, content = raw
            kwargs["content"] = content
            kwargs["headers"] = {"content-type": ctype} if ctype else {}
        elif body is not None:
            kwargs["content"] = json.dumps(body, allow_nan=True).encode()
            kwargs["headers"] = {"content-type": "application/json"}
        t0 = time.monotonic()
        r = None
        try:
            r = self.client.request(method, path, **kwargs)
            status = r.status_code
            text = r.text[:300]
        except httpx.TimeoutException:
            status, text = "timeout", f"no answer in {REQUEST_TIMEOUT_S} s"
        except httpx.HTTPError as e:
            status, text = "error", f"{type(e).__name__}: {e}"
        cls = f"{status // 100}xx" if isinstance(status, int) else status
        took = time.monotonic() - t0
        self.seconds[f"{method} {path}"] += took
        self.slowest = sorted(self.slowest + [(took, f"{status} {method} {path} {str(body)[:300]}")])[-5:]
        self.counts[cls] += 1
        if cls == "4xx" and r is not None:
            try:
                message = str(r.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                message = text
            self.refusals[f"{method} {path.split('/v1/responses/')[0]}: {message[:70]}"] += 1
        self.by_route[f"{method} {path}"][cls] += 1
        if not isinstance(status, int) or status >= 500:
            sent = raw if raw is not None else json.dumps(body, allow_nan=True)[:500]
            self.failures.append(
                f"{method} {path} -> {status} after {time.monotonic() - t0:.1f}s: {text}\n    sent: {sent!r}"
            )
        return r


class Continuations:
    """Sends /v1/responses bodies, putting the id of the last stored response the fuzz made where a body
    holds `LAST_RESPONSE` (so continuations reach the stored conversation), and reads each new one back."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.last = "resp_none_yet"
        self.last_calls: list[str] = []  # the call ids of the last stored response
        self.continued = 0  # continuations of a real response that were answered 200

    def _answering(self, items: Any) -> Any:
        """``items`` with the placeholder call ids (call_1, call_2, ...) of their call outputs replaced by the
        last response's call ids, as an agent loop answers its calls."""
        if not isinstance(items, list):
            return items
        real = dict(zip(["call_1", "call_2", "call_3"], self.last_calls))
        return [
            {**it, "call_id": real.get(it.get("call_id"), it.get("call_id"))}
            if isinstance(it, dict) and it.get("type") == "function_call_output"
            else it
            for it in items
        ]

    def send(self, body: Any) -> None:
        cont = isinstance(body, dict) and body.get("previous_response_id") == LAST_RESPONSE
        if cont:
            body = {**body, "previous_response_id": self.last, "input": self._answering(body.get("input"))}
        r = self.rec.send("POST", "/v1/responses", body=body)
        if r is None or r.status_code != 200:
            return
        self.continued += cont
        if r.headers.get("content-type", "").startswith("text/event-stream"):  # the last event holds the response
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
            made = events[-1].get("response", {}) if events else {}
        else:
            made = r.json()
        if made.get("store") and made.get("status") != "failed":
            self.last = made["id"]
            self.last_calls = [o["call_id"] for o in made["output"] if o["type"] == "function_call"]
            self.rec.send("GET", f"/v1/responses/{made['id']}")


def _fuzz(strategy: st.SearchStrategy, examples: int, send) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(value: Any) -> None:
        send(value)

    run()


def _wait_idle(client: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        d = client.get("/debug/kv").json()
        if (d["running"], d["waiting"], d["inflight"]) == (0, 0, 0) or time.monotonic() > deadline:
            return d
        time.sleep(0.2)


TOOLS_CONTEXT = 512  # the generic tools description alone is about 100 tokens


@pytest.fixture(scope="module")
def fuzz_servers(tiny_llama, tmp_path_factory):
    """Two servers on the tiny model, started together: a 64-token context for every route, and one
    whose context holds tools for the bodies with tools. The traces of the profiles the fuzz starts go
    to a temporary folder, not the system's."""
    common = ("--max-total-tokens", "4096", "--debug-check-invariants", "--served-model-name", "default")
    env = {"RADIXRT_PROFILE_DIR": str(tmp_path_factory.mktemp("profiles")), "SGLANG_TORCH_PROFILER_DIR": ""}
    servers = [
        LocalServer("--context-length", str(CONTEXT), *common, model=tiny_llama, env=env),
        LocalServer("--context-length", str(TOOLS_CONTEXT), *common, model=tiny_llama, env=env),
    ]
    try:
        for srv in servers:
            srv.wait_ready()
        yield servers
        for srv in servers:
            assert srv.stop() == 0, srv.log_tail()
    finally:
        for srv in servers:
            srv.cleanup()


def _report_and_check(rec: Recorder, client: httpx.Client) -> None:
    """Print the counts; assert no 5xx or hang, and that the server is idle, healthy, still generates and
    holds no request's KV."""
    idle = _wait_idle(client)
    health = client.get("/health").status_code
    after = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    kv = _wait_idle(client)["kv_slots"]

    summary = ", ".join(f"{k}: {v}" for k, v in sorted(rec.counts.items()))
    per_route = "\n".join(f"  {r}: {dict(c)}" for r, c in sorted(rec.by_route.items()))
    print(f"\nfuzzed {sum(rec.counts.values())} requests ({summary})\n{per_route}")
    print("seconds by route:", {k: round(v, 1) for k, v in rec.seconds.most_common(6)})
    print("slowest:\n" + "\n".join(f"  {t:.2f}s {what}" for t, what in rec.slowest))
    print("most frequent refusals:\n" + "\n".join(f"  {n} x {what}" for what, n in rec.refusals.most_common(8)))
    assert not rec.failures, f"{len(rec.failures)} failures ({summary}):\n" + "\n".join(rec.failures[:40])
    assert (idle["running"], idle["waiting"], idle["inflight"]) == (0, 0, 0), idle
    assert health == 200
    assert after.status_code == 200 and len(after.json()["output_ids"]) == 4
    assert kv["private_slots"] == 0, kv
    assert kv["free_slots"] + kv["tree_slots"] + kv["private_slots"] == kv["total_slots"], kv


def _send_then_resume(rec: Recorder, method: str, path: str, **body: Any) -> None:
    """Send one request; after a pause (``/pause_generation`` with any body it takes), continue
    generating, so the requests that follow are served."""
    rec.send(method, path, **body)
    if path == "/pause_generation":
        rec.send("POST", "/continue_generation")


def test_fuzz_every_route(fuzz_servers):
    routes = _routes()
    assert ("POST", "/generate") in routes and ("POST", "/concate_and_append_request") in routes
    with httpx.Client(base_url=fuzz_servers[0].url, timeout=REQUEST_TIMEOUT_S) as client:
        rec = Recorder(client)
        responses = Continuations(rec)
        for method, path in routes:
            if "{" in path:  # a path parameter: fill it
                head = path.split("{")[0]
                _fuzz(
                    st.text(max_size=20),
                    GENERIC_EXAMPLES,
                    lambda v, m=method, h=head: rec.send(m, h + urllib.parse.quote(v, safe="/:")),
                )
                continue
            if method == "GET":
                # the debug streams run until told to stop (an open dashboard): two events each
                query = "?limit=2" if path in ("/debug/stream", "/debug/events") else ""
                _fuzz(st.just(None), 2, lambda _, p=path + query: rec.send("GET", p))
            else:
                for strategy, n in BODIES.get((method, path), [(GENERIC, GENERIC_EXAMPLES)]):
                    send = (
                        responses.send
                        if path == "/v1/responses"
                        else (lambda v, m=method, p=path: _send_then_resume(rec, m, p, body=v))
                    )
                    _fuzz(strategy, n, send)
                _fuzz(JUNK, 12, lambda raw, m=method, p=path: _send_then_resume(rec, m, p, raw=raw))
            for wrong in {"GET", "POST", "PUT", "DELETE"} - {m for m, p in routes if p == path}:
                rec.send(wrong, path.split("{")[0])
        rec.send("GET", "/no/such/route")
        _report_and_check(rec, client)


def test_fuzz_tool_calling_and_responses(fuzz_servers):
    """Chat and Responses bodies with tools, tool_choice, assistant calls and tool results (chat messages
    or Responses items), and Responses continuations of stored responses, on a context that holds the
    tools: calls are enforced, parsed and streamed, or the body is refused with a 4xx."""
    with httpx.Client(base_url=fuzz_servers[1].url, timeout=REQUEST_TIMEOUT_S) as client:
        rec = Recorder(client)
        responses = Continuations(rec)
        for (method, path), strategies in TOOL_BODIES.items():
            for strategy, n in strategies:
                send = (
                    responses.send if path == "/v1/responses" else (lambda v, m=method, p=path: rec.send(m, p, body=v))
                )
                _fuzz(strategy, n, send)
        print(f"\n{responses.continued} continuations of a stored response answered")
        assert rec.by_route["POST /v1/chat/completions"]["2xx"] > 0 and rec.by_route["POST /v1/responses"]["2xx"] > 0
        _report_and_check(rec, client)
