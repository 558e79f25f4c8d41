"""Grammar bounds (radixrt/sampling/grammar_bounds.py): grammars with no finite
instance, huge forced strings and huge repetitions are refused from their
structure, before any compilation; ordinary grammars pass."""

from __future__ import annotations

import json
import time

import pytest

from radixrt.sampling.grammar import _parse, check_grammar
from radixrt.sampling.grammar_bounds import GrammarLimits

RECURSIVE = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}
TOOL_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "tags": [
            {
                "begin": "<tool_call>",
                "content": {"type": "json_schema", "json_schema": RECURSIVE},
                "end": "</tool_call>",
            }
        ],
    },
}

REFUSED = {
    "recursive_schema": (("json_schema", json.dumps(RECURSIVE)), "no finite instance"),
    "recursive_in_a_tool_tag": (("structural_tag", json.dumps(TOOL_TAG)), "no finite instance"),
    "recursive_ebnf": (("ebnf", 'root ::= "a" root'), "no finite instance"),
    "regex_bomb": (("regex", "a{3000000}"), "exceeds the limit"),
    "range_bomb": (("regex", "[a-z]{0,3000000}"), "exceeds the limit"),
    "pattern_bomb": (
        (
            "json_schema",
            json.dumps(
                {"type": "object", "properties": {"p": {"type": "string", "pattern": "a{3000000}"}}, "required": ["p"]}
            ),
        ),
        "exceeds the limit",
    ),
    "min_length_bomb": (("json_schema", json.dumps({"type": "string", "minLength": 3_000_000})), "exceeds the limit"),
    "min_items_bomb": (
        ("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000})),
        "exceeds the limit",
    ),
    # every repetition within bounds, their product not: 60000 x 60000 characters
    "nested_repeats": (("regex", "(a{60000}){60000}"), "needs at least 3600000000 characters"),
    "doubling_rules": (
        ("ebnf", "root ::= r30\n" + "\n".join(f"r{i + 1} ::= r{i} r{i}" for i in range(30)) + '\nr0 ::= "ab"'),
        "characters, more than the limit",
    ),
    # a long source costs its parse and compile whatever its structure (2 s and 7 s at 625,000
    # characters): refused before xgrammar reads it
    "long_alternation": (
        ("regex", "(" + "|".join(f"w{i}x" for i in range(40_000)) + ")"),
        "--grammar-max-source-chars",
    ),
    "long_enum": (
        ("json_schema", json.dumps({"enum": [f"value number {i}" for i in range(20_000)]})),
        "more than the limit of 262144",
    ),
}

ACCEPTED = {
    "self_reference_with_a_way_out": (
        "json_schema",
        json.dumps({"type": "object", "properties": {"n": {"$ref": "#"}}}),
    ),
    "tree": (
        "json_schema",
        json.dumps(
            {
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                        "required": ["children"],
                    }
                },
                "$ref": "#/$defs/node",
            }
        ),
    ),
    "person": (
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 64}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            }
        ),
    ),
    "date": ("regex", r"\d{4}-\d{2}-\d{2}"),
    "recursive_ebnf_with_base": ("ebnf", 'root ::= "(" root ")" | "x"'),
    "at_the_limit": ("regex", "a{65536}"),
    "a_large_enum": ("json_schema", json.dumps({"enum": [f"value number {i}" for i in range(10_000)]})),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_costly_grammars_are_refused_from_their_structure(case):
    key, mention = REFUSED[case]
    check_grammar(("regex", "x"))  # xgrammar imported (torch with it) before the clock starts
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=f"sampling parameter '{key[0]}' is refused: .*{mention}"):
        check_grammar(key)
    assert time.perf_counter() - t0 < 1.0  # structure only: nothing compiled, nothing searched


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_ordinary_grammars_pass(case):
    check_grammar(ACCEPTED[case])


def test_limits_are_the_operators():
    key = ("regex", "a{1000}")
    check_grammar(key)
    with pytest.raises(ValueError, match="needs at least 1000 characters, more than the limit of 999"):
        check_grammar(key, GrammarLimits(max_chars=999))
    with pytest.raises(ValueError, match="exceeds the limit of 100"):
        check_grammar(key, GrammarLimits(max_repeat=100))
    check_grammar(("regex", "a{100000}"), GrammarLimits(max_chars=100000, max_repeat=100000))
    with pytest.raises(ValueError, match="has 7 characters, more than the limit of 6"):
        check_grammar(key, GrammarLimits(max_source_chars=6))


@pytest.mark.slow
def test_the_scheduler_leaves_parsing_a_grammar_to_its_compile_thread(tiny_llama):
    """A distinct large grammar took half a second to parse on the step loop's thread, once
    per request (the front had parsed it already, in another process); the compile thread
    parses it now, and a bad one still fails its request alone with a 400."""
    from radixrt.config import EngineConfig
    from radixrt.requests.messages import GenerateReq
    from radixrt.sampling.grammar import _check_cached
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler

    sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, disable_overlap_schedule=True))
    words = "(" + "|".join(f"w{i}x" for i in range(3000)) + ")"  # parsed by no one before
    parsed = _check_cached.cache_info().misses
    try:
        for rid, regex in (("ok", words), ("bad", "(")):
            sched.add_request(GenerateReq(rid, [5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0, regex=regex)))
        assert _check_cached.cache_info().misses == parsed  # no parse on the scheduler's thread
        ends = {}
        while sched.has_work():
            for out in sched.step():
                if out.finish_reason is not None:
                    ends[out.rid] = out
    finally:
        sched.close()
    assert ends["bad"].finish_reason.status_code == 400 and "regex" in ends["bad"].finish_reason.message
    assert ends["ok"].finish_reason.status_code is None, ends["ok"].finish_reason


def test_the_earlier_structural_tag_form_sglang_takes_is_converted():
    """``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` (SGLang still takes
    it) constrains the text after a trigger to the schema; a malformed one is a clear error."""
    import json

    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    grammar = _parse(("structural_tag", json.dumps(tag)), GrammarLimits())
    assert accepts(grammar, 'free text <f>{"a": 1}</f> more') and not accepts(grammar, 'x <f>{"b": 1}</f>')
    for bad, says in (
        ({**tag, "structures": [{"begin": "<f>", "end": "</f>"}]}, "'structures'"),
        ({**tag, "triggers": []}, "'triggers'"),
    ):
        with pytest.raises(ValueError, match=says):
            check_grammar(("structural_tag", json.dumps(bad)))


def test_a_small_grammar_never_waits_behind_large_ones(monkeypatch):
    """One client's large grammars (seconds each to compile, within the limits) queue on their
    lane; a small one compiles on its own lane meanwhile (a probe measured 58 s behind twelve)."""
    from radixrt.sampling.grammar import SMALL_GRAMMAR_CHARS, GrammarBackend

    def compile_(self, key, small):
        time.sleep(0.01 if small else 1.0)
        return key

    monkeypatch.setattr(GrammarBackend, "_compile", compile_)
    backend = GrammarBackend(tokenizer=None, vocab_size=100, stop_token_ids=[])
    try:
        large = [backend.compile_async(("regex", f"({i}|" + "a" * SMALL_GRAMMAR_CHARS + ")")) for i in range(3)]
        began = time.perf_counter()
        assert backend.compile_async(("regex", "(yes|no)")).result(timeout=5) == ("regex", "(yes|no)")
        assert time.perf_counter() - began < 0.5 and not large[-1].done()
    finally:
        backend.shutdown()


def _optional_fields(n: int, kind: str = "integer") -> tuple[str, str]:
    """A JSON schema of ``n`` optional properties: its compilation grows far faster than its
    source (1,000 take about 1.4 s against the embedded model's vocabulary, 2,500 minutes)."""
    return ("json_schema", json.dumps({"type": "object", "properties": {f"f_{i}": {"type": kind} for i in range(n)}}))


@pytest.mark.slow
def test_a_large_grammar_that_would_compile_for_minutes_is_refused_at_the_deadline(tokenizer):
    """The large lane compiles a grammar only once a child process compiled it within the deadline:
    past it the child is killed and the grammar refused (cached: asked again, refused at once), and
    the lane goes on with the next large grammar."""
    from radixrt.sampling.grammar import SMALL_GRAMMAR_CHARS, GrammarBackend
    from radixrt.sampling.grammar_bounds import GrammarTooCostly

    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], limits=GrammarLimits(max_compile_s=1))
    try:
        slow, fine = _optional_fields(3000), _optional_fields(150)
        assert len(fine[1]) > SMALL_GRAMMAR_CHARS  # the large lane too
        began = time.monotonic()
        refused = backend.compile_async(slow)
        with pytest.raises(GrammarTooCostly, match=r"did not compile within 1 s \(--grammar-max-compile-s\)"):
            refused.result(timeout=120)
        assert time.monotonic() - began < 60  # the child's start-up (xgrammar's import) and 1 s
        assert backend.compile_async(slow) is refused
        assert backend.compile_async(fine).result(timeout=120) is not None
        assert backend.compilations == 1
    finally:
        backend.shutdown()


def test_shutting_down_does_not_wait_for_a_trial_under_way(tokenizer):
    from radixrt.sampling.grammar import GrammarBackend

    backend = GrammarBackend(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], limits=GrammarLimits(max_compile_s=60)
    )
    trial = backend.compile_async(_optional_fields(3000))  # minutes, were it let run
    deadline = time.monotonic() + 60
    while (backend._canary is None or backend._canary._proc is None) and time.monotonic() < deadline:
        time.sleep(0.05)  # its child is starting
    time.sleep(1.0)
    began = time.monotonic()
    backend.shutdown()
    assert time.monotonic() - began < 5
    with pytest.raises(ValueError):
        trial.result(timeout=30)
