"""Constrained decoding (regex, JSON schema, EBNF via xgrammar) and verified
jump-forward, end to end on the embedded model (slow), plus what any model
shows (bad grammars, compile failures and waits, aborts, min_new_tokens) on
a tiny random Llama as well, memory pressure on the tiny model and a few
unit checks.

Kept short: every batch of requests is submitted at once, generations are at
most 64 tokens, and the engines (the tiny one, the embedded model's with
jump-forward on and off) are shared by the module.
"""

from __future__ import annotations

import json
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

import radixrt
import radixrt.frontend as rt
from radixrt.sampling.grammar import GrammarBackend, apply_token_bitmask, check_grammar, new_bitmask

IP = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
SHORT = {"type": "string", "maxLength": 24}
PERSON = {
    "type": "object",
    "properties": {
        "name": SHORT,
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "London", "New York"]},
    },
    "required": ["name", "age", "city"],
}

# (kind, grammar, question, Python regex the output must fullmatch for ebnf)
CASES = [
    ("regex", IP, "What is the IP address of Google's public DNS server?", None),
    ("regex", r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)", "Write an example email address.", None),
    ("regex", r"\d{4}-\d{2}-\d{2}", "On what date did the Apollo 11 landing happen? Answer as YYYY-MM-DD.", None),
    ("regex", r"\(\d{3}\) \d{3}-\d{4}", "Give an example US phone number.", None),
    ("regex", r"(yes|no)", "Is the sky blue? Answer yes or no.", None),
    ("regex", r"-?\d{1,6}", "What is 12 times 12?", None),
    ("regex", r"\d{1,4}\.\d{2}", "What is the price of a coffee in dollars?", None),
    ("regex", r"#[0-9a-f]{6}", "Give the hex color code of pure red.", None),
    ("regex", r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}", "Name a famous scientist.", None),
    ("regex", r"([01]\d|2[0-3]):[0-5]\d", "What time is noon in 24-hour format?", None),
    ("regex", r"[a-z]{2,10}(, [a-z]{2,10}){2}", "List three fruits, lowercase, comma separated.", None),
    ("json_schema", PERSON, "Describe a person as JSON.", None),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "name": SHORT,
                        "address": {
                            "type": "object",
                            "properties": {"street": SHORT, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                            "required": ["street", "zip"],
                        },
                    },
                    "required": ["name", "address"],
                }
            },
            "required": ["user"],
        },
        "Give a user with a postal address as JSON.",
        None,
    ),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {
                "fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3}
            },
            "required": ["fruits"],
        },
        "List some fruits as JSON.",
        None,
    ),
    ("json_schema", {"type": "string", "enum": ["red", "green", "blue"]}, "What color is grass? Answer in JSON.", None),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {"valid": {"type": "boolean"}, "score": {"type": "number"}},
            "required": ["valid", "score"],
        },
        "Rate the sentence 'I like cats.' as JSON.",
        None,
    ),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "enum": ["new", "used"]}},
                        "required": ["id", "tag"],
                    },
                }
            },
            "required": ["items"],
        },
        "List inventory items as JSON.",
        None,
    ),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
            "required": ["year"],
        },
        "In what year did World War II end? Answer in JSON.",
        None,
    ),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {
                "title": SHORT,
                "pages": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
            },
            "required": ["title"],
        },
        "Describe a book as JSON.",
        None,
    ),
    (
        "json_schema",
        {
            "type": "object",
            "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["kind", "x", "y"],
        },
        "Give a 2D point as JSON.",
        None,
    ),
    (
        "json_schema",
        {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3},
        "Give the first three prime numbers as a JSON array.",
        None,
    ),
    ("json_schema", {"type": "object"}, "Return a JSON object describing a cat with its name and age.", None),
    ("ebnf", 'root ::= "The answer is " ("yes" | "no") "."', "Is water wet?", r"The answer is (yes|no)\."),
    (
        "ebnf",
        'root ::= num " " op " " num\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"',
        "Write a short arithmetic expression.",
        r"[1-9][0-9]? [+\-*] [1-9][0-9]?",
    ),
    (
        "ebnf",
        'root ::= "(" num (", " num)* ")"\nnum ::= [0-9]+',
        "Give the coordinates of a point as a tuple.",
        r"\(\d+(, \d+)*\)",
    ),
]
FREE_PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_NEW = 64


def _param(kind: str, grammar, **kw) -> dict:
    return {kind: json.dumps(grammar) if kind == "json_schema" else grammar, **kw}


def _check_output(case, text: str) -> None:
    kind, grammar, _, pattern = case
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), grammar)
    else:
        assert re.fullmatch(pattern or grammar, text), (grammar, text)


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    # overlap on (a CUDA default, off on the CPU otherwise): constrained rows next to plain ones with a step in flight
    eng = radixrt.Engine(tiny_llama, max_total_tokens=8192, debug_check_invariants=True, disable_overlap_schedule=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def embedded_engine():
    eng = radixrt.Engine(max_total_tokens=8192, debug_check_invariants=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", params=["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="module")
def engine_no_jf():
    """The embedded model without jump-forward."""
    eng = radixrt.Engine(max_total_tokens=8192, enable_jump_forward=False)
    yield eng
    eng.shutdown()


def _batch(eng, **kw):
    prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for _, _, q, _ in CASES] + FREE_PROMPTS
    params = [_param(k, g, max_new_tokens=MAX_NEW, **kw) for k, g, _, _ in CASES]
    params += [{"max_new_tokens": 16, **kw}] * len(FREE_PROMPTS)
    return prompts, params


@pytest.fixture(scope="module")
def greedy_runs(embedded_engine, engine_no_jf):
    """Every case plus two unconstrained prompts in one greedy batch, on both embedded-model engines."""
    out = {}
    for name, eng in (("jf", embedded_engine), ("no_jf", engine_no_jf)):
        before = eng.get_stats()
        prompts, params = _batch(eng, temperature=0)
        results = eng.generate(prompts, params)
        after = eng.get_stats()
        out[name] = (
            results,
            {
                k: after[k] - before[k]
                for k in ("steps", "generated_tokens", "jump_forward_tokens", "jump_forward_proposed")
            },
        )
    return out


@pytest.mark.slow
def test_outputs_follow_their_grammar(greedy_runs):
    results, _ = greedy_runs["jf"]
    for case, r in zip(CASES, results):
        assert r["meta_info"]["finish_reason"]["type"] == "stop", (case[1], r)
        _check_output(case, r["text"])


@pytest.mark.slow
def test_jump_forward_gives_token_by_token_output(greedy_runs):
    jf, jf_stats = greedy_runs["jf"]
    ref, ref_stats = greedy_runs["no_jf"]
    assert [r["output_ids"] for r in jf] == [r["output_ids"] for r in ref]
    assert [r["text"] for r in jf] == [r["text"] for r in ref]
    assert ref_stats["jump_forward_tokens"] == 0
    # forced JSON punctuation and keys, enum tails, EBNF literals: many decode steps saved
    assert jf_stats["jump_forward_tokens"] >= 100, jf_stats
    assert jf_stats["generated_tokens"] == ref_stats["generated_tokens"]


@pytest.mark.slow
def test_mixed_batch_leaves_unconstrained_requests_alone(embedded_engine, greedy_runs):
    results, _ = greedy_runs["jf"]
    alone = embedded_engine.generate(FREE_PROMPTS, {"max_new_tokens": 16, "temperature": 0})
    assert [r["output_ids"] for r in results[len(CASES) :]] == [r["output_ids"] for r in alone]


@pytest.mark.slow
def test_sampled_jump_forward_matches_with_logprobs(embedded_engine, engine_no_jf):
    """Seeded sampling, n=2, logprobs: verification samples each draft position
    with the same draw a decode step would use, so outputs and logprobs agree."""
    engine = embedded_engine
    picks = [CASES[i] for i in (0, 11, 12, 16, 19, 22)]
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for _, _, q, _ in picks]
    params = [
        _param(k, g, max_new_tokens=MAX_NEW, temperature=0.8, seed=11 + i, n=2) for i, (k, g, _, _) in enumerate(picks)
    ]
    a = engine.generate(prompts, params, return_logprob=True)
    b = engine_no_jf.generate(prompts, params, return_logprob=True)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    for ra, rb in zip(a, b):
        la, lb = ra["meta_info"]["output_token_logprobs"], rb["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in la] == [t for _, t, _ in lb] == ra["output_ids"]
        assert max(abs(x[0] - y[0]) for x, y in zip(la, lb)) < 1e-3
    for case, r in zip([c for c in picks for _ in range(2)], a):
        if r["meta_info"]["finish_reason"]["type"] == "stop":
            _check_output(case, r["text"])


BAD_GRAMMARS = [
    ({"regex": "("}, "regex"),
    ({"regex": "[a-"}, "regex"),
    ({"json_schema": '{"type": "foo"}'}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'}, "json_schema"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"regex": "a+", "json_schema": "{}"}, "exclusive"),
]


def test_bad_grammar_is_a_value_error_and_engine_keeps_serving(engine):
    for params, mention in BAD_GRAMMARS:
        with pytest.raises(ValueError, match=mention):
            engine.generate("Hello", {**params, "max_new_tokens": 4})
    for params, mention in BAD_GRAMMARS[:-1]:
        with pytest.raises(ValueError, match=mention):
            check_grammar(next(iter(params.items())))  # what the HTTP server checks before queueing
    r = engine.generate("The year is", {"regex": r" \d{4}", "max_new_tokens": 8, "temperature": 0})
    assert re.fullmatch(r" \d{4}", r["text"]) and r["meta_info"]["finish_reason"]["type"] == "stop"


def test_compile_failure_ends_the_request_not_the_scheduler(engine, monkeypatch):
    backend = engine.scheduler.grammars
    real = backend._compile

    def failing(key, small):
        if key == ("regex", "q[0-9]{3}"):
            raise RuntimeError("simulated compiler failure")
        return real(key, small)

    monkeypatch.setattr(backend, "_compile", failing)
    r = engine.generate("x", {"regex": "q[0-9]{3}", "max_new_tokens": 8})
    fr = r["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and "simulated compiler failure" in fr["message"]
    r = engine.generate("The year is", {"regex": r" 1[0-9]{3}", "max_new_tokens": 8, "temperature": 0})
    assert re.fullmatch(r" 1[0-9]{3}", r["text"])


def test_compiling_grammar_waits_without_blocking_others(engine, monkeypatch):
    """A request whose grammar is compiling waits in the queue; the rest of the
    batch keeps decoding meanwhile; each grammar is compiled once."""
    backend = engine.scheduler.grammars
    real = backend._compile
    release = threading.Event()
    slow_key = ("regex", "slow-[a-z]{2}")

    def slow(key, small):
        if key == slow_key:
            assert release.wait(60), "never released"
        return real(key, small)

    monkeypatch.setattr(backend, "_compile", slow)
    before = backend.compilations
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(engine.generate, "Say", {"regex": slow_key[1], "max_new_tokens": 8}) for _ in range(2)]
        free = engine.generate("Count: 1, 2,", {"max_new_tokens": 12, "temperature": 0})
        assert len(free["output_ids"]) > 0 and not any(f.done() for f in waiting)
        release.set()
        results = [f.result(timeout=60) for f in waiting]
    assert all(re.fullmatch(r"slow-[a-z]{2}", r["text"]) for r in results)
    assert backend.compilations == before + 1


def test_abort_constrained_requests(engine):
    schema = json.dumps(PERSON)
    stream = engine.generate(
        engine.apply_chat_template([{"role": "user", "content": "A person as JSON."}]),
        {"json_schema": schema, "max_new_tokens": 64, "temperature": 0},
        stream=True,
    )
    next(stream)
    stream.close()  # aborts it, possibly with a draft pending
    engine.wait_idle()
    engine.scheduler.check_invariants()
    assert engine.scheduler.kv_usage()["private_slots"] == 0


def test_min_new_tokens_yields_to_the_grammar(engine):
    r = engine.generate("Answer:", {"regex": "(yes|no)", "min_new_tokens": 5, "max_new_tokens": 8, "temperature": 0})
    assert r["text"] in ("yes", "no") and r["meta_info"]["finish_reason"]["type"] == "stop"


# ------------------------------------------------------------------ frontend
@pytest.mark.slow
def test_frontend_constraints(embedded_engine):
    engine = embedded_engine

    @rt.function
    def profile(s):
        s += rt.user("Invent a person. Give a name, an age and a city.")
        s += rt.assistant(rt.gen("person", json_schema=PERSON, max_tokens=MAX_NEW))
        s += rt.user("Their server's IP address?") + rt.assistant(rt.gen("ip", regex=IP, max_tokens=20))
        s += "Age in ten years:" + rt.gen_int("older", max_tokens=8)
        s += "\nNickname:" + rt.gen_string("nick", max_tokens=16)
        s += "\nHeight in meters:" + rt.gen("height", dtype=float, max_tokens=12)
        s += "\nLikes cats:" + rt.gen("cats", dtype=bool, max_tokens=4)

    st = profile.run(temperature=0, backend=engine)
    assert st.error() is None, st.error()
    jsonschema.validate(json.loads(st["person"]), PERSON)
    assert re.fullmatch(IP, st["ip"])
    assert re.fullmatch(r"[-+]?\d+", st["older"])
    assert re.fullmatch(r' ?"[^"\n]*"', st["nick"])
    assert re.fullmatch(r" ?[-+]?\d+(\.\d+)?", st["height"])
    assert st["cats"].strip() in ("True", "False")
    for name in ("person", "ip", "older", "nick", "height", "cats"):
        meta = st.get_meta_info(name)
        assert "constraint_violated" not in meta and "constraint_fallback" not in meta


# ------------------------------------------------------------------ memory pressure (tiny model)
@pytest.mark.slow
def test_retraction_and_pages_keep_constrained_outputs(tiny_llama):
    """A random model under grammars, in a pool small enough to retract, with
    pages of 4 and short prefill chunks: the same outputs as a roomy engine
    decoding token by token, and no KV leaked."""
    schema = {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0, "maximum": 99},
                        "tag": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
                        "ok": {"type": "boolean"},
                    },
                    "required": ["id", "tag", "ok"],
                },
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["items"],
    }
    regex = r"(abc|abd|xyz)-[0-9]{2}-(left|right)(, (abc|abd)-[0-9]{2}-(left|right)){0,5}"
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randrange(20, 60))] for _ in range(40)]
    params = []
    for i in range(40):
        p = {"max_new_tokens": rng.randrange(24, 80), "temperature": 0 if i % 2 else 0.9, "seed": i}
        p["json_schema" if i % 2 == 0 else "regex"] = json.dumps(schema) if i % 2 == 0 else regex
        params.append(p)

    def run(eng):
        with ThreadPoolExecutor(40) as pool:
            return list(pool.map(lambda a: eng.generate(input_ids=a[0], sampling_params=a[1]), zip(prompts, params)))

    ref_engine = radixrt.Engine(tiny_llama, max_total_tokens=65536, enable_jump_forward=False)
    try:
        reference = [r["output_ids"] for r in run(ref_engine)]
    finally:
        ref_engine.shutdown()
    # with overlap, against a reference without it
    engine = radixrt.Engine(
        tiny_llama,
        max_total_tokens=340,
        page_size=4,
        chunked_prefill_size=64,
        debug_check_invariants=True,
        disable_overlap_schedule=False,
    )
    try:
        results = run(engine)
        engine.wait_idle()
        stats = engine.get_stats()
        assert [r["output_ids"] for r in results] == reference
        assert stats["retractions"] > 0 and stats["jump_forward_tokens"] > 0, stats
        engine.scheduler.check_invariants()
        assert engine.scheduler.kv_usage()["private_slots"] == 0
    finally:
        engine.shutdown()
    for r, p in zip(results, params):
        if r["meta_info"]["finish_reason"]["type"] == "stop" and "regex" in p:
            assert re.fullmatch(regex, r["text"])
        elif r["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(r["text"]), schema)


# ------------------------------------------------------------------ units
def test_bitmask_application_matches_xgrammar():
    import xgrammar as xgr

    g = torch.Generator().manual_seed(0)
    V = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    logits = torch.randn(5, V, generator=g)
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, [0, 2, 4])
    theirs = logits.clone()
    full = new_bitmask(5, V)
    full[[0, 2, 4]] = bitmask
    xgr.apply_token_bitmask_inplace(theirs, full, vocab_size=V)
    assert torch.equal(ours, theirs)


def test_grammar_cache_is_lru_and_compiles_once(tokenizer):
    backend = GrammarBackend(tokenizer, 49152, [2], cache_size=2)
    try:
        a, b, c = ("regex", "a+"), ("regex", "b+"), ("regex", "c+")
        fa, fb = backend.compile_async(a), backend.compile_async(b)
        assert backend.compile_async(a) is fa  # cached, and now the most recent
        fc = backend.compile_async(c)  # evicts b+, the least recently used
        assert backend.compile_async(a) is fa
        fb2 = backend.compile_async(b)  # compiled again
        assert fb2 is not fb
        for f in (fa, fb, fc, fb2):
            f.result(timeout=30)
        assert backend.compilations == 4
        state = backend.new_state(fa.result())
        assert tokenizer.decode(state.propose_draft(8)) == "a"  # a+ forces one "a"
        state.settle_draft(1)
        assert state.propose_draft(8) == [] and state.accept(tokenizer.encode("a")[0])
    finally:
        backend.shutdown()


def test_draft_settles_and_rolls_back(tokenizer):
    backend = GrammarBackend(tokenizer, 49152, [2])
    try:
        compiled = backend.compile_async(("json_schema", json.dumps(PERSON))).result(timeout=30)
        state = backend.new_state(compiled)
        draft = state.propose_draft(64)
        assert tokenizer.decode(draft) == '{"name": "' and state.draft_len == len(draft)
        assert state.draft_masks.shape[0] == len(draft)
        state.settle_draft(1)  # keep '{"' only
        assert state.draft_len == 0
        again = state.propose_draft(64)
        assert tokenizer.decode(again) == 'name": "'
        state.settle_draft(0)
        assert tokenizer.decode(state.propose_draft(64)) == 'name": "'
    finally:
        backend.shutdown()


@pytest.mark.parametrize("bound", [{"maxLength": 12}, {"minLength": 1}, {}])
def test_a_schema_string_never_takes_a_raw_control_character(tokenizer, bound):
    """JSON forbids U+0000-U+001F raw inside a string (RFC 8259); xgrammar's grammar of a string
    with a length bound let them through (``json.loads`` then refused the answer)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", **bound}}, "required": ["name"]}
    backend = GrammarBackend(tokenizer, 49152, [2])
    try:
        compiled = backend.compile_async(("json_schema", json.dumps(schema))).result(timeout=30)
        for text, allowed in (("ab", True), ("\x19", False), ("\t", False), ("\x00", False)):
            state = backend.new_state(compiled)
            assert all(state.accept(t) for t in tokenizer.encode('{"name": "', add_special_tokens=False))
            token = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))
            assert len(token) == 1, text
            assert state.accept(token[0]) is allowed, (bound, repr(text))
    finally:
        backend.shutdown()


def test_a_structural_tags_schema_string_never_takes_a_raw_control_character(tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}
    backend = GrammarBackend(tokenizer, 49152, [2])
    try:
        compiled = backend.compile_async(("structural_tag", json.dumps(tag))).result(timeout=30)
        for text, allowed in (("ab", True), ("\x19", False)):
            state = backend.new_state(compiled)
            assert all(state.accept(t) for t in tokenizer.encode('{"name": "', add_special_tokens=False))
            assert state.accept(tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))[0]) is allowed, repr(text)
    finally:
        backend.shutdown()
