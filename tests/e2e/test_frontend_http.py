"""Frontend programs over HTTP: ``Runtime`` launches ``radixrt serve`` as a
subprocess; programs run through ``RuntimeEndpoint`` (SGLang's native
protocol) and through ``OpenAI`` (the official client) against its OpenAI
routes."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import radixrt.frontend as rt
from radixrt.frontend.errors import UnsupportedByBackendError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("radixrt.server") is None, reason="radixrt.server not available"),
]


@pytest.fixture(scope="module")
def runtime():
    r = rt.Runtime(model_path="default", startup_timeout=300, max_total_tokens=16384)
    yield r
    r.shutdown()
    assert not os.path.exists(r.log_path), "shutdown() leaves no server log behind"


@rt.function
def chat(s, question):
    s += rt.system("You are a helpful assistant.")
    s += rt.user(question)
    s += rt.assistant(rt.gen("answer", max_tokens=16))


def test_runtime_endpoint_runs_programs(runtime, tokenizer):
    backend = runtime.endpoint
    assert backend.get_role_markers()["user"][0] == "<|im_start|>user\n"  # from /get_model_info
    assert runtime.get_model_name() == backend.get_model_name() == backend.model_info["model_path"]  # SGLang's
    assert (Path(backend.get_model_name()) / "config.json").exists()  # a folder its tokenizer loads from
    st = chat.run(question="What is the capital of France?", temperature=0, backend=runtime)
    assert "Paris" in st["answer"]
    assert st.text() == tokenizer.apply_chat_template(st.messages(), tokenize=False)
    if backend.model_info.get("chat_default_system_prompt"):  # servers that report it render user-first chats

        @rt.function  # exactly like the template (and the Engine)
        def hi(s):
            s += rt.user("Hi") + rt.assistant_begin()

        expected = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
        )
        assert hi.run(backend=backend).text() == expected

    @rt.function
    def pick(s):
        s += "Q: What color is the sky on a clear day?\nA:" + rt.select("c", choices=[" blue", " green", " red"])

    st = pick.run(backend=backend)
    assert st["c"] == " blue"
    meta = st.get_meta_info("c")
    assert all(c >= meta["prompt_tokens"] - 3 for c in meta["cached_tokens"])

    st = chat.run(question="Say hello.", temperature=0, stream=True, backend=backend)
    chunks = list(st.text_iter("answer"))
    assert len(chunks) > 1 and "".join(chunks) == st["answer"]

    @rt.function
    def fan(s):
        s += "Three colors:\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"{i + 1}." + rt.gen("color", max_tokens=3, stop="\n")
        forks.join()

    st = fan.run(temperature=0, backend=backend)
    assert len(st["color"]) == 3 and st.error() is None

    assert rt.flush_cache(runtime) is True
    assert "model_path" in rt.get_server_info(runtime)


def test_openai_backend_against_radixrt_server(runtime):
    chat_backend = rt.OpenAI("default", base_url=runtime.url + "/v1")
    st = chat.run(question="What is the capital of France?", temperature=0, backend=chat_backend)
    assert st.error() is None and "Paris" in st["answer"]
    usage = chat_backend.token_usage  # SGLang's running count of the calls' tokens
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 16
    usage.reset()
    assert (usage.prompt_tokens, usage.completion_tokens) == (0, 0)

    @rt.function
    def pick(s):
        s += rt.user("Is the sky blue?")
        s += rt.assistant(rt.select("c", choices=["yes", "no"]))

    st = pick.run(backend=chat_backend)
    assert isinstance(st.error(), UnsupportedByBackendError)

    @rt.function
    def constrained(s):
        s += rt.user("Give a number.")
        s += rt.assistant(rt.gen("n", regex=r"\d+"))

    assert isinstance(constrained.run(backend=chat_backend).error(), UnsupportedByBackendError)

    @rt.function
    def tuned(s):
        s += rt.user("Say hi.")
        s += rt.assistant(rt.gen("hi", max_tokens=2, lora="support"))

    refused = tuned.run(backend=chat_backend).error()  # the OpenAI API has no field for an adapter
    assert isinstance(refused, UnsupportedByBackendError) and "LoRA adapter" in str(refused)

    @rt.function
    def typed(s):
        s += rt.user("How many legs does a dog have?")
        s += rt.assistant(rt.gen_int("n", max_tokens=4))

    assert isinstance(typed.run(backend=chat_backend).error(), UnsupportedByBackendError)  # as SGLang's backend

    completion_backend = rt.OpenAI("default", base_url=runtime.url + "/v1", is_chat_model=False)

    @rt.function
    def pick2(s):
        s += "Q: What color is the sky on a clear day?\nA:" + rt.select("c", choices=[" blue", " green", " red"])
        s += "\nQ: Name a fruit.\nA:" + rt.gen("fruit", max_tokens=4, stop="\n")

    st = pick2.run(temperature=0, backend=completion_backend)
    assert st.error() is None and st["c"] == " blue" and st["fruit"]

    def character(s):
        s += "Construct a character within the following format:\n"
        s += "Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n"
        s += "\nPlease generate new Name, Birthday and Job.\n"
        s += "Name:" + rt.gen("name", stop="\n") + "\nBirthday:" + rt.gen("birthday", stop="\n")
        s += "\nJob:" + rt.gen("job", stop="\n") + "\n"

    # SGLang's API speculative execution (its test_completion_speculative): one call for the three gens
    usage = completion_backend.token_usage
    runs = {}
    for spec in (None, 64):
        before = (usage.prompt_tokens, usage.completion_tokens)
        st = rt.function(num_api_spec_tokens=spec)(character).run(temperature=0, backend=completion_backend)
        assert st.error() is None, st.error()
        runs[spec] = (st, usage.prompt_tokens - before[0], usage.completion_tokens - before[1])
    (plain, plain_prompt, _), (spec, spec_prompt, spec_out) = runs[None], runs[64]
    assert spec_prompt < plain_prompt / 2 and spec_out > 0  # one call (one prompt) for the three gens
    assert all("\n" not in spec[name] for name in ("name", "birthday", "job")), spec.text()
    assert spec["name"] == plain["name"]  # greedy: the first gen is the same either way
    if spec["birthday"] == plain["birthday"]:  # the speculated text continued as the program's text
        assert spec.text().startswith(plain.text()[: plain.text().index("\nJob:")])

    @rt.function
    def pick_ja(s):
        s += "日本の首都はどこですか？答え：" + rt.select("c", choices=["東京", "大阪", "京都"])

    # byte-fragment tokens ("bytes:\\xe3...") are measured by their offsets, not their labels: the
    # prompt's tokens stayed in every choice's score
    scores = [
        pick_ja.run(temperature=0, backend=b).get_meta_info("c")["normalized_prompt_logprobs"]
        for b in (completion_backend, runtime.endpoint)
    ]
    assert scores[0] == pytest.approx(scores[1], abs=1e-3), scores
