"""SGLang's own client against `radixrt serve`.

SGLang's program language (``sglang.function``, ``gen``, ``select``, forks)
with its HTTP backend ``sglang.RuntimeEndpoint``, unchanged, driving a real
radixrt server on 127.0.0.1. ``scripts/setup.sh`` installs SGLang's package
(pinned to its current release, 0.5.23, without its GPU server dependencies);
without it this module is skipped.

Most programs run on a tiny random Llama (SmolLM2's tokenizer and chat
template): what is checked there holds for any weights, as outputs whose text
is checked are pinned with a ``regex`` constraint. The embedded model's
server runs the programs whose answers come from the model; it streams
incrementally (``--incremental-streaming-output``, as SGLang's own CI serves
its ``test_stream_logprobs`` program), the tiny model's server cumulatively
(SGLang's default). The module is
slow (two server start-ups); ``tests/unit/test_sglang_wire.py`` checks the
request bodies SGLang's client sends on the fast path.

Every program runs under a deadline: SGLang's interpreter runs each program in
worker threads and waits for them, so a request that fails inside one (such as
the ``concate_and_append`` join's POST to a route that is missing) used to
hang the caller forever."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest

from radixrt.server.local import LocalServer
from tests.support.servers import serving

pytestmark = pytest.mark.slow  # two server start-ups: ~45 s on two busy cores

sgl = pytest.importorskip(
    "sglang", reason="SGLang's client is not installed (scripts/setup.sh installs it: sglang --no-deps, pinned)"
)

DEADLINE_S = 120
IP = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


def _serve(model: str, *flags: str):
    yield from serving("--max-total-tokens", "16384", "--debug-check-invariants", *flags, model=model)


@pytest.fixture(scope="module")
def tiny_server(tiny_llama):
    yield from _serve(tiny_llama)


@pytest.fixture(scope="module")
def embedded_server():
    yield from _serve("default", "--incremental-streaming-output")


@pytest.fixture(scope="module")
def tiny(tiny_server):
    return sgl.RuntimeEndpoint(tiny_server.url, chat_template_name="chatml")


@pytest.fixture(scope="module")
def embedded(embedded_server):
    return sgl.RuntimeEndpoint(embedded_server.url, chat_template_name="chatml")


def within_deadline(fn, timeout: float = DEADLINE_S):
    """``fn()`` on a worker thread, failing (not hanging) past ``timeout``."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the SGLang program did not finish in {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def run(program, backend, timeout: float = DEADLINE_S, **kwargs):
    """``program.run(backend=backend, **kwargs)``, failing (not hanging) past ``timeout``."""

    def target():
        state = program.run(backend=backend, **kwargs)
        if not kwargs.get("stream"):
            state.sync()
        return state

    return within_deadline(target, timeout)


def assert_kv_idle(srv: LocalServer) -> None:
    """No request holds KV: every slot is free or cached (free + tree == total)."""
    kv = httpx.get(srv.url + "/debug/kv", timeout=30).json()["kv_slots"]
    assert kv["private_slots"] == 0, kv
    assert kv["free_slots"] + kv["tree_slots"] + kv["private_slots"] == kv["total_slots"], kv


# ---------------------------------------------------------------- programs (any model)
def test_gen_stop_and_stop_regex(tiny):
    @sgl.function
    def prog(s):
        s += sgl.user("Spell it.")
        s += sgl.assistant(sgl.gen("a", max_tokens=24, regex="abc def ghi", stop="de"))
        s += sgl.user("Count.")
        s += sgl.assistant(sgl.gen("b", max_tokens=24, regex="abc 123 xyz", stop_regex=r"\d{2}"))
        s += sgl.user("Once more.")
        s += sgl.assistant(sgl.gen("c", max_tokens=24, regex="abc 123 xyz", stop_regex=["nope", r"\s"]))

    state = run(prog, tiny, temperature=0)
    assert state["a"] == "abc "
    assert state.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": "de"}
    assert state["b"].startswith("abc 12") and "xyz" not in state["b"]  # SGLang keeps a regex's match
    assert state.get_meta_info("b")["finish_reason"] == {"type": "stop", "matched": r"\d{2}"}
    assert state["c"].startswith("abc") and "123" not in state["c"]
    assert state.get_meta_info("c")["finish_reason"]["matched"] == r"\s"
    assert "<|im_start|>assistant\nabc <|im_end|>" in state.text()  # SGLang's chatml template


def test_regex_json_and_typed_gens(tiny):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
    }

    @sgl.function
    def prog(s):
        s += "DNS: " + sgl.gen("ip", max_tokens=32, regex=IP) + "\n"
        s += "Person: " + sgl.gen("person", max_tokens=128, json_schema=json.dumps(schema)) + "\n"
        s += "Hours: " + sgl.gen_int("hours") + "\n"
        s += "Name: " + sgl.gen_string("name", max_tokens=32) + "\n"
        s += "Pi: " + sgl.gen("pi", dtype=float, max_tokens=16) + "\n"
        s += "Blue: " + sgl.gen("blue", dtype=bool, max_tokens=8) + "\n"

    state = run(prog, tiny, temperature=0)
    assert re.fullmatch(IP, state["ip"]), state["ip"]
    person = json.loads(state["person"])
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    int(state["hours"])
    float(state["pi"])
    assert state["blue"].strip() in ("True", "False")
    assert state["name"].startswith('"')  # SGLang's string regex (unbounded: a random model may not close it)


def test_select(tiny):
    choices = ["True", "False", "Unknown"]

    @sgl.function
    def prog(s, statement):
        s += "Statement: " + statement + "\nAnswer:" + sgl.select("answer", choices)
        s += "\nWhy:" + sgl.gen("why", max_tokens=4)

    states = [run(prog, tiny, statement=st) for st in ("Paris is in France.", "Cats are dogs.")]
    for state in states:
        assert state["answer"] in choices
        meta = state.get_meta_info("answer")
        assert len(meta["normalized_prompt_logprobs"]) == len(choices)


@pytest.mark.parametrize("mode", ["gather_variable", "concate_and_append"])
def test_fork_and_join(tiny, tiny_server, mode):
    @sgl.function
    def prog(s):
        s += "Here are three tips.\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}: " + sgl.gen("tip", max_tokens=16, regex=f"tip-{i} [a-z]{{3}}") + "\n"
        forks.join(mode)
        s += "Summary: " + sgl.gen("summary", max_tokens=4)

    state = run(prog, tiny, temperature=0)
    if mode == "gather_variable":
        tips = state["tip"]  # the forks' variables come back as a list
        assert [t[:5] for t in tips] == ["tip-0", "tip-1", "tip-2"]
        assert "Tip 1:" not in state.text()
    else:
        # the forks' text is appended to the parent's; the server was told (and answered success)
        text = state.text()
        assert text.index("Tip 1: tip-0") < text.index("Tip 2: tip-1") < text.index("Tip 3: tip-2")
        assert text.index("Tip 3: tip-2") < text.index("Summary: ")
    assert state.get_meta_info("summary")["completion_tokens"] == 4
    assert_kv_idle(tiny_server)


def test_concate_and_append_route_shape(tiny_server):
    url = tiny_server.url + "/concate_and_append_request"
    r = httpx.post(url, json={"src_rids": ["a", "b"], "dst_rid": "c"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True}
    bad = httpx.post(url, json={"src_rids": "a", "dst_rid": "c"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "src_rids"


def test_openai_routes_take_stop_regex(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 24, "temperature": 0, "regex": "abc 123 xyz", "stop_regex": r"\d{2}"}
        r = c.post("/v1/completions", json={**body, "prompt": "Hi"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "abc 12" and r.json()["choices"][0]["finish_reason"] == "stop"
        r = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "abc 12"
        bad = c.post("/v1/completions", json={**body, "prompt": "Hi", "stop_regex": "("})
        assert bad.status_code == 400 and "stop_regex" in bad.json()["error"]["message"]


def test_runaway_stop_regex_fails_only_its_request(tiny_server):
    sp = {"max_new_tokens": 200, "temperature": 0, "regex": "a{150}", "stop_regex": r"(a|aa)+b"}
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        r = c.post("/generate", json={"text": "Hi", "sampling_params": sp})
        assert r.status_code == 400 and "took the request over" in r.json()["error"]["message"], r.text
        assert c.get("/health").status_code == 200
    assert_kv_idle(tiny_server)


def test_streaming_with_logprobs(tiny):
    @sgl.function
    def prog(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("Tell me a story.")
        s += sgl.assistant(
            sgl.gen("answer", max_tokens=12, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
        )

    state = run(prog, tiny, temperature=0, stream=True)
    chunks = list(state.text_iter("answer"))
    assert len(chunks) > 1
    answer = "".join(chunks)
    assert answer == state["answer"]
    meta = state.get_meta_info("answer")
    lps = meta["output_token_logprobs"]  # all of them: the last event's are cumulative
    assert len(lps) == meta["completion_tokens"] == meta["output_token_logprobs_length"] == 12
    assert all(len(t) == 3 and isinstance(t[2], str) for t in lps)
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert "".join(t[2] for t in lps) == answer
    # and the same program without streaming agrees
    plain = run(prog, tiny, temperature=0)
    assert plain["answer"] == answer
    assert [t[1] for t in plain.get_meta_info("answer")["output_token_logprobs"]] == [t[1] for t in lps]


def test_run_batch_and_server_calls(tiny, tiny_server):
    @sgl.function
    def prog(s, topic):
        s += sgl.user(f"Write about {topic}.")
        s += sgl.assistant(sgl.gen("text", max_tokens=6))

    box: dict = {}

    def target() -> None:
        box["states"] = prog.run_batch(
            [{"topic": t} for t in ("cats", "dogs", "owls", "bees")], backend=tiny, temperature=0.7, num_threads=4
        )
        for st in box["states"]:
            st.sync()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive()
    assert len(box["states"]) == 4
    assert all(st.get_meta_info("text")["completion_tokens"] == 6 for st in box["states"])
    tiny.flush_cache()
    assert tiny.get_model_name()  # /get_model_info's model_path
    assert_kv_idle(tiny_server)


def test_unsupported_request_fails_cleanly(tiny):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", max_tokens=4, stop_regex="(unclosed")

    with pytest.warns(UserWarning, match="stop_regex"):  # SGLang's interpreter reports it as a warning
        state = run(prog, tiny)
    assert isinstance(state.error(), RuntimeError)
    assert "invalid regex '(unclosed'" in str(state.error())  # the server's 400, as the client raised it


# ---------------------------------------------------------------- the embedded model's answers
def test_embedded_model_programs(embedded, embedded_server):
    @sgl.function
    def qa(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, stop_regex=r"[.!?]"))

    state = run(qa, embedded, question="What is the capital of France? Answer in one sentence.", temperature=0)
    assert "Paris" in state["answer"]
    assert state.get_meta_info("answer")["finish_reason"] == {"type": "stop", "matched": "[.!?]"}
    assert re.search(r"[.!?]$", state["answer"])  # the match stays in the text, as in SGLang

    @sgl.function
    def parallel_encoding(s, question, contexts):
        s += sgl.user("Please memorize these statements.")
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += sgl.user("Question: " + question + " Answer with a name.")
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, stop="\n"))

    state = run(
        parallel_encoding,
        embedded,
        question="Who is the father of Julian?",
        contexts=["Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Carlos."],
        temperature=0,
    )
    assert "Statement 1: Noah is the father of Julian." in state.text()
    assert state.get_meta_info("answer")["completion_tokens"] > 0
    assert_kv_idle(embedded_server)


def assert_same_logprobs(got: list, want: list) -> None:
    """``[logprob, token_id, text]`` lists: the same tokens, logprobs within 1e-3."""
    assert [t[1:] for t in got] == [t[1:] for t in want]
    assert all((a[0] is None and b[0] is None) or abs(a[0] - b[0]) < 1e-3 for a, b in zip(got, want)), (got, want)


def test_sglang_stream_logprobs_program(embedded):
    """SGLang's own ``test_stream_logprobs`` (sglang/test/test_programs.py) against a
    server streaming incrementally: each event's ``output_token_logprobs`` holds
    only its new tokens, ``output_token_logprobs_length`` the running count."""
    programs = pytest.importorskip("sglang.test.test_programs")
    if not hasattr(programs, "test_stream_logprobs"):
        pytest.skip(f"SGLang {sgl.__version__} has no test_stream_logprobs (scripts/setup.sh installs 0.5.23)")
    old = sgl.global_config.default_backend
    sgl.set_default_backend(embedded)
    try:
        within_deadline(programs.test_stream_logprobs)
    finally:
        sgl.global_config.default_backend = old


def test_incremental_stream_wire_format(embedded_server):
    """``--incremental-streaming-output``: each event holds only what is new (text,
    output ids, output logprobs and top logprobs); ``completion_tokens`` and
    ``output_token_logprobs_length`` are running counts; the prompt's logprobs come
    in every event; the events add up to the non-streamed result."""
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    with httpx.Client(base_url=embedded_server.url, timeout=120) as c:
        whole = c.post("/generate", json=body).json()
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(ln) for ln in lines[:-1]]
    assert len(events) > 1
    metas = [e["meta_info"] for e in events]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [i for e in events for i in e["output_ids"]] == whole["output_ids"]
    counts = [m["completion_tokens"] for m in metas]
    assert counts == [m["output_token_logprobs_length"] for m in metas] == sorted(counts)
    assert [len(e["output_ids"]) for e in events] == [b - a for a, b in zip([0] + counts, counts)]
    # the second request reads the prompt from the cache: values may differ in the last bits
    assert_same_logprobs(
        [lp for m in metas for lp in m["output_token_logprobs"]], whole["meta_info"]["output_token_logprobs"]
    )
    tops = [t for m in metas for t in m["output_top_logprobs"]]
    assert len(tops) == len(whole["meta_info"]["output_top_logprobs"]) == counts[-1]
    for got, want in zip(tops, whole["meta_info"]["output_top_logprobs"]):
        assert_same_logprobs(got, want)
    for m in metas:
        assert_same_logprobs(m["input_token_logprobs"], whole["meta_info"]["input_token_logprobs"])
    assert whole["meta_info"]["output_token_logprobs_length"] == whole["meta_info"]["completion_tokens"]
