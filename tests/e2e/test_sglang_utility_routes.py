"""SGLang's smaller routes on the session's tiny server (tests/e2e/conftest.py): the weights'
label (``/update_weight_version``, ``meta_info.weight_version``), the text parsers
(``/parse_function_call``, ``/separate_reasoning``) and SageMaker's ``/ping`` and ``/invocations``."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.support.servers import TINY_SERVER_ADMIN_KEY

GREEDY = {"max_new_tokens": 6, "temperature": 0}
ADMIN = {"Authorization": f"Bearer {TINY_SERVER_ADMIN_KEY}"}


@pytest.fixture
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=120) as c:
        yield c


def test_the_weights_label_changes_without_the_weights_and_every_answer_names_it(client):
    body = {"text": "The label of the weights", "sampling_params": GREEDY}
    before = client.post("/generate", json=body).json()
    assert before["meta_info"]["weight_version"] == "default" and before["meta_info"]["num_retractions"] == 0
    label = {"new_version": "step-9", "abort_all_requests": False}
    assert client.post("/update_weight_version", json=label).status_code == 403  # the admin key's
    try:
        r = client.post("/update_weight_version", json=label, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "message": "Weight version updated to step-9", "new_version": "step-9"}
        after = client.post("/generate", json=body).json()
        assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "step-9"
        with client.stream("POST", "/generate", json={**body, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks and all(c["meta_info"]["weight_version"] == "step-9" for c in chunks)
        assert client.get("/get_weight_version").json() == {"weight_version": "step-9"}
        assert client.get("/get_model_info").json()["weight_version"] == "step-9"
        for bad, field in (
            ({}, "new_version"),
            ({"new_version": 7}, "new_version"),
            ({"new_version": "x" * 257}, "new_version"),
            ({"new_version": "x", "abort_all_requests": "yes"}, "abort_all_requests"),
            ({"new_version": "x", "surprise": 1}, "surprise"),
        ):
            r = client.post("/update_weight_version", json=bad, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    finally:
        r = client.post(
            "/update_weight_version", json={"new_version": "default", "abort_all_requests": False}, headers=ADMIN
        )
        assert r.status_code == 200


def test_a_new_label_ends_the_running_requests_unless_told_not_to(client):
    """SGLang's default ``abort_all_requests`` is true: a long request in flight ends with an abort."""
    long = {"text": "A long one", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}, "stream": True}
    started, box = threading.Event(), {}

    def run() -> None:
        with client.stream("POST", "/generate", json=long) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    box["last"] = json.loads(line[6:])

    t = threading.Thread(target=run)
    t.start()
    try:
        assert started.wait(60)
        r = client.post("/update_weight_version", json={"new_version": "step-10"}, headers=ADMIN)
        assert r.status_code == 200, r.text
        t.join(60)
        meta = box["last"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 3000
    finally:
        t.join(60)
        client.post("/update_weight_version", json={"new_version": "default"}, headers=ADMIN)


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("add", "mul")]


def test_function_calls_are_parsed_as_the_chat_routes_read_them(client):
    text = 'Let me add.\n<tool_call>\n{"name": "mul", "arguments": {"a": 1, "b": "é"}}\n</tool_call>'
    r = client.post("/parse_function_call", json={"text": text, "tool_call_parser": "qwen25", "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "normal_text": "Let me add.\n",
        "calls": [{"tool_index": 1, "name": "mul", "parameters": '{"a": 1, "b": "é"}'}],
    }
    llama = '{"name": "add", "parameters": {"x": 2}}; {"name": "nope", "parameters": {}}'
    r = client.post("/parse_function_call", json={"text": llama, "tool_call_parser": "llama3", "tools": TOOLS})
    assert r.json()["calls"] == [{"tool_index": 0, "name": "add", "parameters": '{"x": 2}'}]  # unknown: left out
    plain = client.post("/parse_function_call", json={"text": "no calls here", "tools": TOOLS}).json()
    assert plain == {"normal_text": "no calls here", "calls": []}
    assert client.post("/parse_function_call", json={"text": text}).json() == {"normal_text": text, "calls": []}
    for bad, field in (
        ({"text": 3}, "text"),
        ({"text": "x", "tool_call_parser": "nonsense"}, "tool_call_parser"),
        ({"text": "x", "tools": [{"type": "function"}]}, "tools"),
        ({"text": "x", "other": 1}, "other"),
    ):
        r = client.post("/parse_function_call", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_reasoning_is_separated_under_each_parser_s_rule(client):
    def split(text: str, parser: str, **more) -> dict:
        r = client.post("/separate_reasoning", json={"text": text, "reasoning_parser": parser, **more})
        assert r.status_code == 200, r.text
        return r.json()

    assert split("<think>\nhmm\n</think>\n\n42", "qwen3") == {"reasoning_text": "hmm", "text": "42"}
    assert split("no block </think> here", "qwen3") == {"reasoning_text": "", "text": "no block </think> here"}
    assert split("opened by the prompt</think>42", "deepseek-r1") == {
        "reasoning_text": "opened by the prompt",
        "text": "42",
    }
    assert split("<think>a</think>b", "qwen3", return_blocks=True) == {
        "reasoning_text": "a",
        "text": "b",
        "reasoning_blocks": ["a"],
        "text_blocks": ["b"],
        "blocks": [{"type": "reasoning", "text": "a"}, {"type": "text", "text": "b"}],
    }
    r = client.post("/separate_reasoning", json={"text": "x", "reasoning_parser": "kimi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_parser"


def test_sagemaker_s_routes(client, tiny_server):
    assert client.get("/ping").status_code == 200
    assert httpx.get(tiny_server.url + "/ping").status_code == 401  # the key, as SGLang asks for it there
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    via_sagemaker = client.post("/invocations", json=chat)
    assert via_sagemaker.status_code == 200, via_sagemaker.text
    assert (
        via_sagemaker.json()["choices"][0]["message"]
        == client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
    )


def test_the_load_probes_routers_poll(client, tiny_server):
    """SGLang's ``/v1/loads`` (JSON and Prometheus) and ``/get_load``, as the KV pool and queues stand:
    cache that no request holds is not load (an idle server with a warm cache is not full)."""
    prompt = list(range(300, 420))
    assert (
        client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}).status_code
        == 200
    )
    info = client.get("/get_server_info").json()
    body = client.get("/v1/loads").json()
    assert body["version"] == info["version"] and body["accelerator"] == "cpu"
    (load,) = body["loads"]
    assert load["dp_rank"] == 0 and load["max_total_num_tokens"] == info["max_total_num_tokens"]
    kv = client.get("/get_server_info").json()["kv_slots"]
    assert kv["evictable_slots"] >= len(prompt)  # the prompt stays cached, unheld
    assert load["num_used_tokens"] == info["max_total_num_tokens"] - kv["free_slots"] - kv["evictable_slots"]
    assert load["num_running_reqs"] >= 0 and 0 <= load["token_usage"] <= 1
    assert client.get("/v1/loads", params={"dp_rank": 1}).json()["loads"] == []
    text = client.get("/v1/loads", params={"format": "prometheus"}).text
    assert 'sglang_max_total_num_tokens{dp_rank="0"} ' + str(info["max_total_num_tokens"]) in text
    for bad, field in (({"include": "gpu"}, "include"), ({"format": "xml"}, "format"), ({"dp_rank": "-1"}, "dp_rank")):
        r = client.get("/v1/loads", params=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    (old,) = client.get("/get_load").json()
    assert old["dp_rank"] == 0 and old["num_reqs"] >= old["num_waiting_reqs"] >= 0 and old["num_tokens"] >= 0
    assert httpx.get(tiny_server.url + "/v1/loads").status_code == 401  # the key, as every route but health
