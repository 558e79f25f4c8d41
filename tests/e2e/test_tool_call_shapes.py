"""The shape of enforced tool calls on /v1/chat/completions, on the session tiny server (the
grammar decides the call whatever the model): a tool without parameters is called with ``{}``,
arguments keep the schema's key order, and a call cut short by a stop string is no call to run
(``finish_reason`` "stop", streamed too; Anthropic's ``stop_sequence``)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.servers import TINY_SERVER_KEY

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ORDERED = {"type": "object", "properties": {"zeta": DIGIT, "alpha": DIGIT}, "required": ["zeta", "alpha"]}
ASK = [{"role": "user", "content": "Call the tool."}]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers={"x-api-key": TINY_SERVER_KEY}, timeout=120) as c:
        yield c


def _forced(http, parameters, **kw):
    fn = {"name": "f", "description": "a tool"}
    if parameters is not None:
        fn["parameters"] = parameters
    body = {"model": "default", "messages": ASK, "tools": [{"type": "function", "function": fn}], "max_tokens": 48}
    body.update(tool_choice={"type": "function", "function": {"name": "f"}}, temperature=0, **kw)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("parameters", [None, {}, {"type": "object", "properties": {}}])
def test_a_tool_without_parameters_is_called_with_an_empty_object(http, parameters):
    choice = _forced(http, parameters)
    assert choice["finish_reason"] == "tool_calls", choice
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ["{}"]


def test_arguments_keep_the_schemas_key_order(http):
    choice = _forced(http, ORDERED)
    assert list(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])) == ["zeta", "alpha"]


def test_a_call_cut_by_a_stop_string_is_not_a_call_to_run(http):
    whole = _forced(http, ORDERED)
    assert whole["finish_reason"] == "tool_calls"
    cut = _forced(http, ORDERED, stop=['"alpha"'])
    assert cut["finish_reason"] == "stop", cut
    body = {
        "model": "default",
        "messages": ASK,
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stop": ['"alpha"'],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": ORDERED}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]
    anthropic_body = {
        "model": "default",
        "max_tokens": 48,
        "messages": ASK,
        "temperature": 0,
        "stop_sequences": ['"alpha"'],
        "tools": [{"name": "f", "input_schema": ORDERED}],
        "tool_choice": {"type": "tool", "name": "f"},
    }
    msg = http.post("/v1/messages", json=anthropic_body).json()
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == '"alpha"', msg


def test_an_enforced_tool_choice_with_a_response_format_makes_its_call(http):
    """OpenAI takes the pair (agent frameworks send their output type on every turn): the format
    shapes a text answer, which the enforced choice rules out; a regex with it stays a 400."""
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}}
    choice = _forced(http, ORDERED, response_format=fmt)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "f"
    body = {"model": "default", "messages": ASK, "max_tokens": 8, "regex": "[a-z]+", "tool_choice": "required"}
    body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": ORDERED}}]
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
