"""The frontend language end to end (in-process Engine).

Programs whose checks hold for any model (templates, forks sharing the
prefix, streaming, errors, regex-shaped output) run on a tiny random Llama
(fast) and on the embedded model (slow); programs whose answers are checked
run on the embedded model alone (``@embedded_only``, slow).

Greedy decoding (temperature 0) wherever an answer is checked. One engine per
model is shared by the module; generations are kept short so that the module
runs in well under three minutes on two CPU cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest

import radixrt.frontend as rt
from tests.support.frontend_helpers import assert_request_failure_surfaces, multi_turn_question

CAPITALS_FEW_SHOT = (
    "Q: What is the capital of Germany?\nA: Berlin\n"
    "Q: What is the capital of Spain?\nA: Madrid\n"
    "Q: What is the capital of Japan?\nA: Tokyo\n"
)


@contextlib.contextmanager
def _engine(*args):
    import radixrt

    eng = radixrt.Engine(*args, max_total_tokens=16384)  # not a share of the machine's memory
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    with _engine(tiny_llama) as eng:
        yield eng


@pytest.fixture(scope="module")
def embedded_engine():
    with _engine() as eng:
        yield eng


@pytest.fixture(params=["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def engine(request):
    """The model's engine, the default backend while the test runs."""
    eng = request.getfixturevalue(f"{request.param}_engine")
    old = rt.get_default_backend()
    rt.set_default_backend(eng)
    yield eng
    rt.set_default_backend(old)


# a test that checks the embedded model's answers
embedded_only = pytest.mark.parametrize("engine", [pytest.param("embedded", marks=pytest.mark.slow)], indirect=True)


def ntok(engine, text: str) -> int:
    return len(engine.tokenizer.encode(text))


# ---------------------------------------------------------------------------


@embedded_only
def test_few_shot_qa_batch_shares_the_prefix(engine):
    @rt.function
    def few_shot(s, country):
        s += CAPITALS_FEW_SHOT
        s += "Q: What is the capital of " + country + "?\nA:" + rt.gen("answer", max_tokens=6, stop="\n")

    rt.flush_cache()
    countries = {"France": "Paris", "Italy": "Rome", "England": "London", "Russia": "Moscow", "China": "Beijing"}
    states = few_shot.run_batch([{"country": c} for c in countries], temperature=0, progress_bar=True)
    assert [st["answer"].strip() for st in states] == list(countries.values())
    shared = ntok(engine, CAPITALS_FEW_SHOT + "Q: What is the capital of")
    for st in states:
        assert st.error() is None
        # the shared prefix was prefilled once before the batch: every program hits it
        assert st.get_meta_info("answer")["cached_tokens"] >= shared - 2


@embedded_only
def test_multi_turn_chat_uses_the_models_chat_template(engine):
    @rt.function
    def chat(s, q1, q2):
        s += rt.system("You are a helpful assistant.")
        s += rt.user(q1)
        s += rt.assistant(rt.gen("a1", max_tokens=16))
        with s.user():
            s += q2
        s += rt.assistant(rt.gen("a2", max_tokens=16))

    st = chat.run(q1="What is the capital of France?", q2="And what is the capital of Italy?", temperature=0)
    assert "Paris" in st["a1"] and "Rome" in st["a2"]
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == st["a1"]
    # the program's text is exactly what the tokenizer's own template renders
    assert st.text() == engine.tokenizer.apply_chat_template(msgs, tokenize=False)
    # the second turn reuses the first turn's KV
    m1, m2 = st.get_meta_info("a1"), st.get_meta_info("a2")
    assert m2["cached_tokens"] >= m1["prompt_tokens"]


def test_default_system_prompt_matches_template(engine):
    @rt.function
    def chat(s):
        s += rt.user("Hi")
        s += rt.assistant_begin()

    st = chat.run()
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert st.text() == expected


@embedded_only
@pytest.mark.parametrize(
    "method", [rt.token_length_normalized, rt.greedy_token_selection, rt.unconditional_likelihood_normalized]
)
def test_select_scores_choices_from_the_cached_prefix(engine, method):
    @rt.function
    def pick(s, question, choices):
        s += CAPITALS_FEW_SHOT + "Q: " + question + "\nA:"
        s += rt.select("choice", choices=choices, choices_method=method)

    st = pick.run(question="What color is the sky on a clear day?", choices=[" blue", " green", " red"])
    assert st["choice"] == " blue"
    assert st.text().endswith("A: blue")
    meta = st.get_meta_info("choice")
    assert len(meta["normalized_prompt_logprobs"]) == 3
    # the scoring requests are prefill-only requests that hit the radix tree:
    # all but the last few prompt tokens come from the cache
    assert all(c >= meta["prompt_tokens"] - 3 for c in meta["cached_tokens"])

    # gen(choices=...) is select
    @rt.function
    def pick2(s):
        s += "Q: Is fire hot or cold?\nA:" + rt.gen("c", choices=[" hot", " cold"])

    assert pick2.run()["c"] == " hot"


def test_separate_reasoning_moves_the_thinking_block_out_of_the_variable_and_the_text(engine):
    """SGLang's ``separate_reasoning`` (the output pinned by a regex: a random model thinks too)."""

    @rt.function
    def think(s):
        s += rt.user("Say hi")
        answer = rt.gen("a", max_tokens=24, regex=r"<think>[a-z]{3,8}</think>[a-z ]{3,12}")
        s += rt.assistant(rt.separate_reasoning(answer, model_type="qwen3"))

    st = think.run(temperature=0)
    assert st["a_reasoning_content"] and "<think>" not in st["a"] and "</think>" not in st["a"]
    assert "<think>" not in st.text() and st.messages()[-1]["content"] == st["a"].lstrip()
    with pytest.raises(ValueError, match="model_type"):
        rt.separate_reasoning(rt.gen("x"), model_type="kimi")


def test_select_scores_a_choice_only_by_the_logprobs_it_has(engine):
    """After the one-token prompt "I", the choice "t" makes the single token "It", which has no
    logprob (nothing precedes it): an unknown is no evidence (it counted as 0.0 and always won)."""
    choices = [" am", "'m", "t"]

    @rt.function
    def pick(s):
        s += "I" + rt.select("c", choices=choices)

    st = pick.run()
    scores = st.get_meta_info("c")["normalized_prompt_logprobs"]
    assert len(engine.tokenizer.encode("It")) == 1 and scores[2] == float("-inf")
    assert st["c"] == choices[max(range(3), key=lambda i: scores[i])] != "t"


@embedded_only
def test_gen_int(engine):
    @rt.function
    def arithmetic(s, a, b):
        s += "Q: What is 3 + 4?\nA: 7\nQ: What is 10 + 5?\nA: 15\n"
        s += f"Q: What is {a} + {b}?\nA: " + rt.gen_int("n") + "\n"

    st = arithmetic.run(a=2, b=3, temperature=0)
    assert st["n"] == "5" and int(st["n"]) == 5
    assert st.text().endswith("A: 5\n")


def test_regex_shaped_gen(engine):
    ip = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

    @rt.function
    def regex_gen(s):
        s += "Q: What is the IP address of the Google DNS server?\nA: "
        s += rt.gen("ip", max_tokens=16, regex=ip) + "\n"

    st = regex_gen.run(temperature=0)
    assert re.fullmatch(ip, st["ip"]), st["ip"]
    assert st.text().endswith(st["ip"] + "\n")


CALC_FEW_SHOT = (
    "Question: What is 12 times 7?\nExpression: 12 * 7\nResult: 84\nAnswer: 84\n\n"
    "Question: What is 100 minus 37?\nExpression: 100 - 37\nResult: 63\nAnswer: 63\n\n"
)


def safe_eval(expr: str) -> str:
    if not re.fullmatch(r"[\d\s+\-*/().]+", expr):
        return "invalid expression"
    return str(eval(expr, {"__builtins__": {}}))  # noqa: S307 - digits and operators only


@embedded_only
def test_tool_use_loop_with_python_between_gens(engine):
    @rt.function
    def calculator(s, questions):
        s += CALC_FEW_SHOT
        results = []
        for q in questions:
            s += "Question: " + q + "\nExpression: " + rt.gen("expr", max_tokens=16, stop="\n")
            value = safe_eval(s["expr"])  # the tool runs in Python, between two generations
            s += "\nResult: " + value + "\nAnswer: " + rt.gen("answer", max_tokens=8, stop="\n") + "\n\n"
            results.append((s["expr"], value, s["answer"]))
        return results

    st = calculator.run(questions=["What is 23 times 19?", "What is 45 plus 78?"], temperature=0)
    assert st.error() is None
    assert st.ret_value == [("23 * 19", "437", "437"), ("45 + 78", "123", "123")]


REACT_FEW_SHOT = """Answer questions by choosing actions: search [topic], calculate [expression] or finish [answer].

Question: How many inhabitants do Tokyo and Berlin have together?
Action: search [Tokyo]
Observation: Tokyo has 14000000 inhabitants.
Action: search [Berlin]
Observation: Berlin has 3700000 inhabitants.
Action: calculate [14000000 + 3700000]
Observation: 17700000
Action: finish [17700000]

Question: How many inhabitants does Rome have?
Action: search [Rome]
Observation: Rome has 2800000 inhabitants.
Action: finish [2800000]

"""
KB = {"paris": "Paris has 2100000 inhabitants.", "rome": "Rome has 2800000 inhabitants."}


@embedded_only
def test_react_loop_follows_select(engine):
    def search(topic: str) -> str:
        return next((v for k, v in KB.items() if k in topic.lower()), "No result.")

    @rt.function
    def react(s, question):
        s += REACT_FEW_SHOT + "Question: " + question + "\n"
        steps = []
        for _ in range(4):
            s += "Action:" + rt.select("action", choices=[" search", " calculate", " finish"])
            action = s["action"].strip()
            s += " [" + rt.gen("arg", max_tokens=16, stop="]") + "]\n"
            steps.append((action, s["arg"]))
            if action == "search":
                s += "Observation: " + search(s["arg"]) + "\n"
            elif action == "calculate":
                s += "Observation: " + safe_eval(s["arg"]) + "\n"
            else:
                break
        return steps

    st = react.run(question="How many inhabitants does Paris have?", temperature=0)
    assert st.error() is None
    assert st.ret_value == [("search", "Paris"), ("finish", "2100000")]
    assert "Observation: Paris has 2100000 inhabitants.\nAction: finish [2100000]" in st.text()


def test_branches_never_joined_end_their_threads(engine):
    """A fork left unjoined (an abandoned branch, an early return) ends its branches' worker
    threads once the states are dropped, as SGLang's ProgramState.__del__ does."""
    import gc
    import threading
    import time

    @rt.function
    def abandons(s):
        s += "Hi"
        for branch in s.fork(2):
            branch += "x" + rt.gen("y", max_tokens=1)

    abandons.run()
    gc.collect()
    before = threading.active_count()
    for _ in range(10):
        abandons.run()
    gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_fork_of_five_branches(engine):
    @rt.function
    def fan_out(s):
        s += "Here are five short facts about the ocean.\n"
        forks = s.fork(5)
        for i, f in enumerate(forks):
            f += f"Fact {i + 1}:" + rt.gen("fact", max_tokens=10, stop="\n", temperature=0.8, top_p=0.9)
        forks.join()
        s += "Summary:" + rt.gen("summary", max_tokens=6, temperature=0)

    st = fan_out.run()
    assert st.error() is None
    facts = st["fact"]
    assert isinstance(facts, list) and len(facts) == 5
    metas = st.get_meta_info("fact")
    prefix = ntok(engine, "Here are five short facts about the ocean.\n")
    assert all(m["cached_tokens"] >= prefix - 1 for m in metas)
    assert st.text().startswith("Here are five short facts about the ocean.\nSummary:")

    @rt.function
    def concat(s):
        s += "List:"
        forks = s.fork(3)
        forks += lambda i: f" item{i}" + rt.gen("w", max_tokens=2, temperature=0)
        forks.join(mode="concate_and_append")

    st = concat.run()
    assert st.text().startswith("List: item0") and " item1" in st.text() and " item2" in st.text()


def test_fork_of_eight_after_500_token_prefix_computes_prefix_once(engine):
    rt.flush_cache()
    sentences = [f"Note {i}: the station logged a reading of {i * 37 % 101} units at hour {i % 24}." for i in range(40)]
    document = "\n".join(sentences) + "\n"
    assert ntok(engine, document) >= 520

    @rt.function
    def analyze(s, doc):
        s += "Read the log below.\n" + doc
        forks = s.fork(8)
        for i, f in enumerate(forks):
            f += f"Question {i}: what was logged in note {i}?\nAnswer:" + rt.gen("answer", max_tokens=4)
        forks.join()

    st = analyze.run(doc=document, temperature=0)
    assert st.error() is None
    cached = [m["cached_tokens"] for m in st.get_meta_info("answer")]
    assert len(cached) == 8 and all(c >= 500 for c in cached), cached


def test_streaming(engine):
    @rt.function
    def story(s):
        s += rt.user("Tell me a very short story about a cat.")
        s += rt.assistant(rt.gen("story", max_tokens=12))

    st = story.run(stream=True, temperature=0)
    chunks = list(st.text_iter("story"))
    assert len(chunks) > 1
    assert "".join(chunks) == st["story"]
    full = "".join(st.text_iter())
    assert full == st.text()

    st2 = story.run(stream=True, temperature=0)

    async def consume():
        return [c async for c in st2.text_async_iter("story")]

    assert "".join(asyncio.run(consume())) == st["story"]


def test_errors_surface(engine):
    @rt.function
    def bad(s):
        s += "Hello" + rt.gen("ok", max_tokens=2, temperature=0)
        s += " there" + rt.gen("broken", max_tokens=2, temperature=-3.0)
        s += "!" + rt.gen("after", max_tokens=2)

    st = bad.run()
    assert isinstance(st["ok"], str)
    assert_request_failure_surfaces(st, "broken", later="after")

    @rt.function
    def with_image(s):
        s += rt.user(rt.image("photo.png") + "Describe it.")

    with pytest.raises(rt.UnsupportedModalityError):
        with_image.run()


@embedded_only
def test_var_scope_copy_and_admin(engine):
    @rt.function
    def p(s):
        s += CAPITALS_FEW_SHOT + "Q: What is the capital of France?\nA:"
        with s.var_scope("span"):
            s += rt.gen("a", max_tokens=4, stop="\n")
        with s.copy() as c:
            c += " Also" + rt.gen("b", max_tokens=3)
            assert c["b"] is not None

    st = p.run(temperature=0)
    assert st["span"] == st["a"] == " Paris"
    info = rt.get_server_info()
    assert "model_path" in info
    assert rt.flush_cache() is True


@embedded_only
def test_sglang_programs_run_unchanged(engine):
    """SGLang programs (as in SGLang's docs) run with ``import radixrt as sgl``."""
    import radixrt as sgl

    if not hasattr(sgl, "function"):
        pytest.skip("radixrt/__init__.py does not re-export the frontend language yet")

    program = multi_turn_question(sgl, max_tokens=16)
    state = program.run(
        question_1="What is the capital of France?", question_2="What is the capital of Italy?", temperature=0
    )
    assert "Paris" in state["answer_1"] and "Rome" in state["answer_2"]

    @sgl.function
    def tip_suggestion(s):
        s += "Here are two tips for staying healthy: "
        s += "1. Balanced Diet. 2. Regular Exercise.\n\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Now, expand tip {i + 1} into a paragraph:\n"
            f += sgl.gen("detailed_tip", max_tokens=12, stop="\n\n")
        s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
        s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
        s += "In summary" + sgl.gen("summary", max_tokens=8)

    state = tip_suggestion.run(temperature=0)
    assert state.error() is None and state.text().count("Tip ") == 2

    @sgl.function
    def classify(s, text):
        s += "Text: " + text + "\nSentiment:" + sgl.gen("label", choices=[" positive", " negative"])

    states = classify.run_batch([{"text": "I love this!"}, {"text": "This is terrible and I hate it."}])
    assert [st["label"] for st in states] == [" positive", " negative"]
    assert sgl.flush_cache() is True


@pytest.fixture
def sglang_bound_to_radixrt(monkeypatch):
    """``sglang`` and its ``sglang.lang.*`` modules bound to radixrt's frontend
    (for this test only), as a program written for SGLang runs here."""
    import sys
    import types

    from radixrt.frontend import api, choices, interpreter, ir

    lang = types.ModuleType("sglang.lang")
    for name, module in (("api", api), ("ir", ir), ("choices", choices), ("interpreter", interpreter)):
        setattr(lang, name, module)
        monkeypatch.setitem(sys.modules, f"sglang.lang.{name}", module)
    monkeypatch.setitem(sys.modules, "sglang.lang", lang)
    monkeypatch.setitem(sys.modules, "sglang", rt)
    return rt


@embedded_only
def test_sglang_decode_json_regex_program(engine, sglang_bound_to_radixrt):
    """SGLang's own ``test_decode_json_regex`` program (sglang/test/test_programs.py),
    its import of ``sglang.lang.ir``'s regexes included."""
    import json

    import sglang as sgl

    @sgl.function
    def decode_json(s):
        from sglang.lang.ir import REGEX_FLOAT, REGEX_INT, REGEX_STR

        s += "Generate a JSON object to describe the basic city information of Paris.\n"
        s += "Here are the JSON object:\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "name": ' + sgl.gen(regex=REGEX_STR) + ",\n"
            s += '  "population": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "area": ' + sgl.gen(regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "latitude": ' + sgl.gen(regex=REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
            s += "}"

    ret = decode_json.run(temperature=0.0)
    assert ret.error() is None
    js_obj = json.loads(ret["json_output"])
    assert isinstance(js_obj["name"], str) and isinstance(js_obj["population"], int)
    assert isinstance(js_obj["area"], int) and isinstance(js_obj["latitude"], (int, float))


def test_sglangs_stream_logprobs_program_runs_unchanged(engine, monkeypatch):
    """SGLang's own ``test_stream_logprobs`` (sglang/test/test_programs.py) with ``sgl`` being
    radixrt's frontend: each streamed chunk's ``output_token_logprobs`` holds only its new tokens
    (SGLang's frontend's shape, whatever the server streams), the counts are running totals."""
    programs = pytest.importorskip("sglang.test.test_programs")
    if not hasattr(programs, "test_stream_logprobs"):
        pytest.skip("this SGLang has no test_stream_logprobs (scripts/setup.sh installs 0.5.23)")
    monkeypatch.setattr(programs, "sgl", rt)
    programs.test_stream_logprobs()
