"""The Responses API's parts that need no server: the bounded store, the
``input`` items read and turned into chat messages, and chat errors renamed
into the Responses request's fields."""

from __future__ import annotations

import pytest

from radixrt.server.errors import ServerError, bad_request
from radixrt.server.responses_input import to_chat_request
from radixrt.server.responses_protocol import InputError, ResponsesRequest, parse_input
from radixrt.server.responses_store import ResponseStore


def _body(i: int) -> dict:
    return {"id": f"resp_{i}", "output": [{"type": "message", "content": [{"type": "output_text", "text": "x"}]}]}


def test_store_keeps_at_most_capacity_least_recently_used_out():
    store = ResponseStore(capacity=3, max_bytes=10**6)
    for i in range(3):
        assert store.put(f"r{i}", _body(i), [{"type": "message", "role": "user", "content": str(i)}])
    assert store.get("r0") is not None  # r0 is now the most recently used: r1 goes first
    store.put("r3", _body(3), [])
    assert len(store) == 3 and store.get("r1") is None
    assert [store.get(k) is not None for k in ("r0", "r2", "r3")] == [True, True, True]
    assert store.get("r0").conversation() == [{"type": "message", "role": "user", "content": "0"}]
    assert store.delete("r0") and not store.delete("r0") and len(store) == 2


def test_store_keeps_at_most_max_bytes():
    big = [{"type": "message", "role": "user", "content": "y" * 1000}]
    store = ResponseStore(capacity=100, max_bytes=2500)
    for i in range(5):
        assert store.put(f"r{i}", _body(i), big)
    assert len(store) == 2 and store.bytes <= 2500
    assert store.get("r4") is not None and store.get("r2") is None
    assert not store.put("huge", _body(9), [{"content": "z" * 3000}])  # larger than the whole store
    assert store.get("huge") is None and store.bytes == sum(store.get(k).size for k in ("r3", "r4"))
    store.delete("r3")
    store.delete("r4")
    assert store.bytes == 0


def test_store_of_size_zero_keeps_nothing():
    store = ResponseStore(capacity=0, max_bytes=10**6)
    assert not store.put("r", _body(0), []) and store.get("r") is None
    with pytest.raises(ValueError):
        ResponseStore(capacity=-1, max_bytes=0)


@pytest.mark.parametrize(
    "value,where",
    [
        ({"role": "user"}, "input"),
        ([{"type": "bogus"}], "input[0]"),
        ([5], "input[0]"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}], "input[1].role"),
        ([{"role": "user", "content": 5}], "input[0].content"),
        ([{"role": "user", "content": [{"text": "x"}]}], "input[0].content[0].type"),
        ([{"type": "function_call_output", "call_id": "c", "output": None}], "input[0].output"),
    ],
)
def test_bad_input_names_the_field(value, where):
    with pytest.raises(InputError) as e:
        parse_input(value)
    assert e.value.where == where and where in str(e.value)


def _chat(fields: dict, history: list | None = None):
    req = ResponsesRequest.model_validate({"model": "m", **fields})
    return to_chat_request(req, history or [], parse_input(req.input))


def test_items_become_chat_messages():
    history = [
        {"type": "message", "role": "user", "content": "weather?"},
        {"type": "reasoning"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    chat, _ = _chat(
        {
            "instructions": "Be brief.",
            "max_output_tokens": 7,
            "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "input": [
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
            ],
        },
        history,
    )
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rain", "tool_call_id": "c2"},
    ]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0 and chat._flat_tools
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}


def test_a_call_without_text_before_it_starts_an_assistant_message():
    chat, _ = _chat(
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            ]
        }
    )
    assert [(m.role, m.content, len(m.tool_calls or [])) for m in chat.messages] == [
        ("user", "hi", 0),
        ("assistant", None, 1),
        ("tool", "ok", 0),
        ("assistant", None, 1),
    ]


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        # OpenAI requires a name of 1-64 [A-Za-z0-9_-]
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name"),
    ],
)
def test_requests_refused_before_the_chat_path(fields, param):
    with pytest.raises(ServerError) as e:
        _chat(fields)
    assert e.value.status == 400 and e.value.param == param


def test_chat_errors_name_the_responses_fields():
    history = [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    _, conv = _chat(
        {
            "instructions": "sys",
            "input": [
                {"type": "function_call_output", "call_id": "c9", "output": "x"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{"},
            ],
        },
        history,
    )
    # messages: 0 instructions, 1 user (history), 2 assistant + call (history), 3 tool (input[0]), 4 input[1]
    cases = {
        ("'messages[3].tool_call_id' 'c9' matches no call", "messages[3].tool_call_id"): (
            "'input[0].call_id' 'c9' matches no call",
            "input.0.call_id",
        ),
        (
            "'messages[4].tool_calls[0].function.arguments' is not valid JSON",
            "messages[4].tool_calls[0].function.arguments",
        ): ("'input[1].arguments' is not valid JSON", "input.1.arguments"),
        ("messages[2].tool_calls[0].function.name is bad", "messages.2"): (
            "previous_response_id is bad",
            "previous_response_id",
        ),
        ("'messages[0]' is bad", "messages.0.content"): ("'instructions' is bad", "instructions"),
        ("'response_format' holds an unusable JSON schema", "response_format"): (
            "'text.format' holds an unusable JSON schema",
            "text.format",
        ),
        ("'max_tokens' must be at most 10", "max_tokens"): (
            "'max_output_tokens' must be at most 10",
            "max_output_tokens",
        ),
        ("The prompt is too long for messages", "messages"): ("The prompt is too long for input", "input"),
    }
    for (message, param), (want_message, want_param) in cases.items():
        e = conv.renamed(bad_request(message, param))
        assert (e.message, e.param) == (want_message, want_param)
