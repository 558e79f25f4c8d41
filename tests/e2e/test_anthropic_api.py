"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) against the
session tiny server, with the official ``anthropic`` SDK: answers equal to the chat route's
(same prompt, same greedy tokens, same counts), streams that add up to the whole answer, tool
use enforced by its grammar and answered with tool results, stop sequences, structured output,
and bad requests refused in Anthropic's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.support.servers import TINY_SERVER_ADMIN_KEY, TINY_SERVER_KEY
from tests.support.tools import ADD_FUNCTION, SCHEMAS, WEATHER_FUNCTION

TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (WEATHER_FUNCTION, ADD_FUNCTION)
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the current SDK has no sampling arguments: extra_body carries them


@pytest.fixture(scope="module")
def sdk():
    """The ``anthropic`` package, imported when a test of this module runs: importing it takes
    2.5 s, which every pytest-xdist worker would spend collecting, also on the fast path."""
    import anthropic

    return anthropic


@pytest.fixture(scope="module")
def client(tiny_server, sdk):
    c = sdk.Anthropic(base_url=tiny_server.url, api_key=TINY_SERVER_KEY, max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(tiny_server):
    headers = {"x-api-key": TINY_SERVER_KEY}
    with httpx.Client(base_url=tiny_server.url, headers=headers, timeout=120) as c:
        yield c


def _create(client, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("messages", QUESTION)
    return client.messages.create(model="default", extra_body=GREEDY, **kw)


def test_text_answer_equals_the_chat_route(client, http):
    msg = _create(client, system="Answer briefly.")
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": "default",
            "messages": [{"role": "system", "content": "Answer briefly."}, *QUESTION],
            "max_tokens": 12,
            "temperature": 0,
        },
    ).json()
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.role == "assistant" and msg.type == "message" and msg.id.startswith("msg_")
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    u, cu = msg.usage, chat["usage"]
    assert (
        u.input_tokens + u.cache_read_input_tokens == cu["prompt_tokens"] and u.output_tokens == cu["completion_tokens"]
    )
    assert cu["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt: the Messages request's
    count = client.messages.count_tokens(model="default", system="Answer briefly.", messages=QUESTION)
    assert count.input_tokens == cu["prompt_tokens"]


def test_stream_adds_up_to_the_whole_answer(client, http):
    whole = _create(client, max_tokens=16)
    with client.messages.stream(model="default", max_tokens=16, messages=QUESTION, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    body = {"model": "default", "max_tokens": 4, "messages": QUESTION, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/messages", json=body) as r:
        kinds = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_is_answered_with_a_tool_result(client, stream):
    choice = {"type": "tool", "name": "add"}  # integers below 1,000: a short call whatever the model
    kw = dict(model="default", max_tokens=64, messages=QUESTION, tools=TOOLS, tool_choice=choice, extra_body=GREEDY)
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1, msg
    use = uses[0]
    assert use.name == "add" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMAS["add"])
    result = [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]
    turn = [*QUESTION, {"role": "assistant", "content": msg.content}, {"role": "user", "content": result}]
    answer = _create(client, messages=turn, tools=TOOLS, tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.cache_read_input_tokens > 0  # the first turn's prompt and call came from the cache


def test_stop_sequences_and_structured_output(client):
    free = _create(client, max_tokens=16).content[0].text
    stop = free[4:7]
    assert len(stop) == 3, free
    cut = _create(client, max_tokens=16, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free[: free.index(stop)]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    shaped = _create(client, max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(shaped.content[0].text), schema)


def test_a_final_assistant_message_is_continued(client, http):
    """Anthropic's prefill: the answer goes on from the assistant's text, as the chat route's
    ``continue_final_message`` does, and is only the continuation."""
    prefill = [*QUESTION, {"role": "assistant", "content": "The weather in Paris is"}]
    msg = _create(client, messages=prefill)
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": "default",
            "messages": prefill,
            "max_tokens": 12,
            "temperature": 0,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ).json()
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert (
        client.messages.count_tokens(model="default", messages=prefill).input_tokens == chat["usage"]["prompt_tokens"]
    )


@pytest.mark.parametrize(
    "body,where",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "tools.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0"),
        ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice.name"),
        ({"max_tokens": 0}, None),
        ({"temperature": 1.5}, "temperature"),  # Anthropic's range is 0-1
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages.0.content"),  # as Anthropic's API
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "messages.0.content"),
        ({"stop_sequences": [""]}, "stop_sequences"),  # the Anthropic field, not the chat one
        ({"messages": [*QUESTION, {"role": "assistant", "content": "It is "}]}, "messages.1"),  # trailing space
    ],
)
def test_bad_requests_are_400s_in_anthropics_shape(http, body, where):
    r = http.post("/v1/messages", json={"model": "default", "max_tokens": 4, "messages": QUESTION, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    if where is not None:
        assert where.split(".")[0] in err["error"]["message"], err


def test_a_wrong_key_and_an_unknown_model_in_anthropics_shape(tiny_server, client, sdk):
    bad = sdk.Anthropic(base_url=tiny_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(sdk.AuthenticationError):
        bad.messages.create(model="default", max_tokens=4, messages=QUESTION)
    with pytest.raises(sdk.NotFoundError) as e:
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=QUESTION)
    assert e.value.body["type"] == "error" and "claude-nonexistent" in e.value.body["error"]["message"]


def test_errors_before_the_route_and_aborts_come_in_anthropics_shape(tiny_server, http):
    """The key check and the body parser answer before the route, in Anthropic's shape too; a tool
    schema's error names ``input_schema``; an aborted stream ends with an ``error`` event."""
    r = httpx.post(tiny_server.url + "/v1/messages", headers={"x-api-key": "wrong"}, json={}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and "x-api-key" in r.text
    r = http.post("/v1/messages", content=b'{"model": "default",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    bad_tool = [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}]
    r = http.post("/v1/messages", json={"model": "default", "max_tokens": 4, "messages": QUESTION, "tools": bad_tool})
    assert r.status_code == 400 and "tools[0].input_schema" in r.json()["error"]["message"], r.text
    body = {"model": "default", "max_tokens": 6000, "messages": QUESTION, "stream": True, "temperature": 0}
    admin = {"Authorization": f"Bearer {TINY_SERVER_ADMIN_KEY}"}
    with http.stream("POST", "/v1/messages", json={**body, "ignore_eos": True}) as s:
        kinds = []
        for line in s.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
                if kinds[-1] == "content_block_delta" and kinds.count("content_block_delta") == 1:
                    assert (
                        httpx.post(
                            tiny_server.url + "/abort_request", headers=admin, json={"abort_all": True}
                        ).status_code
                        == 200
                    )
    assert kinds[-1] == "error" and "message_stop" not in kinds, kinds[-3:]
