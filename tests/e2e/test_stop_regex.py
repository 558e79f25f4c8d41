"""stop_regex end to end on a tiny random Llama (in-process Engine, and the
frontend's ``gen(stop_regex=...)``).

A random model's text is noise, so the outputs here are pinned with a
``regex`` constraint: "abc 123 xyz" is generated whatever the weights, and
a stop regex must end it where the pattern first matches."""

from __future__ import annotations

import re

import pytest

import radixrt
import radixrt.frontend as rt

PINNED = {"max_new_tokens": 24, "temperature": 0, "regex": "abc 123 xyz"}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    # overlap on (the CUDA default, off on the CPU otherwise), so both loops run these tests
    e = radixrt.Engine(tiny_llama, max_total_tokens=8192, disable_overlap_schedule=False)
    yield e
    e.shutdown()


def test_stops_where_the_pattern_first_matches_and_reports_it(engine):
    r = engine.generate("Hi", {**PINNED, "stop_regex": r"\d{2}"})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\d{2}"}
    # the matched text stays (SGLang cuts at the pattern's own text, which does not occur)
    assert r["text"].startswith("abc 12") and "xyz" not in r["text"]
    assert r["text"] == engine.tokenizer.decode(r["output_ids"])


def test_plain_text_pattern_is_cut_like_a_stop_string(engine):
    r = engine.generate("Hi", {**PINNED, "stop_regex": ["nomatch", "12"]})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "12"}
    assert r["text"] == "abc "


def test_no_match_runs_to_the_end(engine):
    r = engine.generate("Hi", {**PINNED, "stop_regex": [r"\d{4}", "^123"]})  # "^": the output's start only
    assert r["text"] == "abc 123 xyz"
    assert r["meta_info"]["finish_reason"]["matched"] != "^123"


def test_anchored_pattern_matches_at_the_output_start(engine):
    r = engine.generate("Hi", {**PINNED, "stop_regex": "^ab"})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "^ab"}
    assert "xyz" not in r["text"]


def test_min_new_tokens_holds_the_stop_back(engine):
    early = engine.generate("Hi", {**PINNED, "stop_regex": "[a-z]"})
    late = engine.generate("Hi", {**PINNED, "stop_regex": "[a-z]", "min_new_tokens": 3})
    assert len(early["output_ids"]) == 1 and late["meta_info"]["finish_reason"]["matched"] == "[a-z]"
    # the first token from the third on whose text holds a match ends it
    pieces = [engine.tokenizer.decode([t]) for t in late["output_ids"]]
    assert len(pieces) >= 3 and re.search("[a-z]", pieces[-1])
    assert not any(re.search("[a-z]", p) for p in pieces[2:-1]), pieces


def test_a_stop_string_before_min_new_tokens_stays_text(engine):
    """Only a stop the output completes at or after min_new_tokens ends it, and the text is cut
    there: streamed or not (the occurrence min_new_tokens passed over cut the answer before)."""
    sp = {"max_new_tokens": 24, "temperature": 0, "regex": "ab END cd END ef", "stop": ["END"]}
    early = engine.generate("Hi", sp)
    assert early["text"] == "ab "
    late_sp = {**sp, "min_new_tokens": len(early["output_ids"]) + 1}
    late = engine.generate("Hi", late_sp)
    assert late["text"] == "ab END cd " and late["meta_info"]["finish_reason"]["matched"] == "END"
    texts = [c["text"] for c in engine.generate("Hi", late_sp, stream=True)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == late["text"]


def test_a_regex_match_before_min_new_tokens_stays_text(engine):
    """As for stop strings: a match in the text min_new_tokens held back does not end the
    request later (it cut the answer at that early match, dropping text it had counted)."""
    sp = {"max_new_tokens": 24, "temperature": 0, "regex": "ab END cd END ef", "stop_regex": ["E[A-Z]D"]}
    early = engine.generate("Hi", sp)
    assert early["text"] == "ab END"  # a pattern with metacharacters: the matched text stays
    late = engine.generate("Hi", {**sp, "min_new_tokens": len(early["output_ids"]) + 1})
    assert late["text"] == "ab END cd END" and late["meta_info"]["finish_reason"]["matched"] == "E[A-Z]D"
    plain = engine.generate("Hi", {**sp, "stop_regex": "END", "min_new_tokens": len(early["output_ids"]) + 1})
    assert plain["text"] == "ab END cd "  # a plain-text pattern: cut at the occurrence that ended it


def test_streaming_ends_with_the_final_text(engine):
    sp = {**PINNED, "stop_regex": ["12", "z$"]}
    full = engine.generate("Hi", sp)
    texts = [c["text"] for c in engine.generate("Hi", sp, stream=True)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"] == "abc "


def test_bad_pattern_is_refused_before_it_runs(engine):
    with pytest.raises(ValueError, match="'stop_regex'"):
        engine.generate("Hi", {"stop_regex": "(unclosed"})


def test_frontend_gen_stop_regex(engine):
    @rt.function
    def prog(s):
        s += "Hi " + rt.gen("a", max_tokens=24, regex="abc 123 xyz", stop_regex=r"\d\d")
        s += "|" + rt.gen("b", max_tokens=24, regex="abc 123 xyz", stop_regex=[r"x", r"\s1"])

    old = rt.get_default_backend()
    rt.set_default_backend(engine)
    try:
        state = prog.run(temperature=0)
    finally:
        rt.set_default_backend(old)
    assert state["a"] == "abc 12"
    assert state["b"] == "abc 1"  # "\s1" matched first; it is no text of the output, so it stays
    assert state.get_meta_info("b")["finish_reason"] == {"type": "stop", "matched": r"\s1"}
    with pytest.raises(ValueError, match="invalid regex"):
        rt.gen("c", stop_regex=["ok", "("])


def test_a_pattern_that_backtracks_without_end_fails_the_request_not_the_engine(engine):
    # "(a|aa)+b" over a growing run of a's: exponential, the search times out
    sp = {"max_new_tokens": 200, "temperature": 0, "regex": "a{150}", "stop_regex": r"(a|aa)+b"}
    fr = engine.generate("Hi", sp)["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and fr["message"].startswith(r"stop_regex '(a|aa)+b' took the request over"), fr
    assert engine.generate("Hi", {**PINNED, "stop_regex": r"\d"})["text"] == "abc 1"  # still serving
