"""stop_regex (SGLang's sampling parameter): validation, the bounded tail the
scheduler searches, and how the final text is trimmed (as SGLang does: at the
pattern's own text, when it occurs)."""

from __future__ import annotations

import time

import pytest

from radixrt.requests.detokenizer import IncrementalDetokenizer
from radixrt.requests.finish import FinishReason
from radixrt.sampling import stop_regex as sr
from radixrt.sampling.params import SamplingParams


# ---------------------------------------------------------------- sampling params
def test_stop_regex_is_stored_as_a_list():
    assert SamplingParams.from_dict({"stop_regex": r"\d+"}).stop_regex == [r"\d+"]
    assert SamplingParams.from_dict({"stop_regex": ("a", "b")}).stop_regex == ["a", "b"]
    # SGLang's frontend sends an empty list (its default) or None
    assert SamplingParams.from_dict({"stop_regex": []}) == SamplingParams()
    assert SamplingParams.from_dict({"stop_regex": None}).stop_regex == []
    p = SamplingParams.from_dict({"stop_regex": ["x+", "y"]})
    assert SamplingParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize(
    "value, why",
    [
        ("(", "invalid regex"),
        (["ok", "[a-"], "invalid regex"),
        ([""], "empty"),
        ([1], "list of strings"),
        (5, "list of strings"),
        ({"a": 1}, "list of strings"),
        (["a"] * (sr.MAX_STOP_REGEX_COUNT + 1), "at most"),
        ("a" * (sr.MAX_STOP_REGEX_BYTES + 1), "bytes"),
        ("é" * (sr.MAX_STOP_REGEX_BYTES // 2 + 1), "bytes"),  # counted in UTF-8 bytes
    ],
)
def test_bad_stop_regex_is_a_value_error_naming_the_field(value, why):
    with pytest.raises(ValueError, match="'stop_regex'") as ei:
        SamplingParams.from_dict({"stop_regex": value})
    assert why in str(ei.value)


# ---------------------------------------------------------------- the searched tail
@pytest.mark.parametrize(
    "pattern, chars",
    [
        ("abc", 3),
        ("END|STOP", 4),
        (r"[0-9]{3}", 3),
        (r"a{2,5}", 5),
        (r"(?:ab)?c", 3),
        (r"(?i)hello", 5),
        (r"\bcat\b", 3),
        (r"(?<=x)ab", 3),
        (r"a(?=bcd)", 4),
        ("^x$", 1),
        (r"\d+", None),
        (".*", None),
        (r"a*?b", None),
        (r"(a)\1", None),
    ],
)
def test_max_match_chars(pattern, chars):
    assert sr.max_match_chars(pattern) == chars


def test_window_covers_the_longest_match_and_caps_unbounded_patterns():
    assert sr.window_tokens(["abc"]) == 3 + 8
    assert sr.window_tokens(["abc", "[0-9]{20}"]) == 20 + 8
    assert sr.window_tokens([r"\d+"]) == sr.UNBOUNDED_WINDOW_TOKENS + 8
    assert sr.window_tokens(["a{1000}"]) == sr.UNBOUNDED_WINDOW_TOKENS + 8


def test_search_reports_the_first_pattern_that_matches():
    assert sr.search(["zzz", r"\d{2}", "a"], "abc 12", True, 2) == r"\d{2}"
    assert sr.search(["zzz"], "abc 12", True, 2) is None


def test_search_in_a_partial_tail_finds_matches_inside_the_newest_token():
    # the newest token is "123xyz": the match ends inside it, not at the end
    assert sr.search([r"\d{3}"], "abcdefghij123xyz", False, 6) == r"\d{3}"
    assert sr.search([r"\d+"], "abcdefghij123xyz", False, 6) == r"\d+"


def test_search_in_a_partial_tail_does_not_invent_matches_at_its_start():
    # "^" is the output's start, which a partial tail does not hold
    assert sr.search(["^x"], "x marks the spot", False, 5) is None
    assert sr.search(["^x"], "x marks the spot", True, 5) == "^x"
    # \b where a tail could start ("...con|cat dog"): the search starts past it, with context
    assert sr.search([r"\bcat\b"], "xxxxxxxxxxxxconcat dog", False, 4) is None
    assert sr.search([r"\bcat\b"], "xxxxxxxxxxxxa cat", False, 4) == r"\bcat\b"
    # MULTILINE ^ sees the real newline before the match
    assert sr.search(["(?m)^END"], "some words here\nEND", False, 3) == "(?m)^END"


# ---------------------------------------------------------------- the final text (detokenizer)
class CharTokenizer:
    """One token per character (ids are code points): enough for the detokenizer."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _finish(text: str, matched: str, **kw) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(CharTokenizer(), **kw)
    ids = [ord(c) for c in text]
    streamed = [d.push([t]) for t in ids[:-1]]
    return streamed, d.push(ids[-1:], FinishReason.stop(matched))


def test_a_pattern_with_metacharacters_keeps_the_matched_text():
    # SGLang reports the pattern and cuts where its own text occurs: nowhere here
    streamed, final = _finish("I have 12", r"\d{2}", stop_regex=[r"\d{2}"])
    assert final == "I have 12"
    assert all(final.startswith(s) for s in streamed)


def test_a_plain_text_pattern_is_cut_like_a_stop_string_and_held_back_while_streaming():
    streamed, final = _finish("one two END", "END", stop_regex=["END"])
    assert final == "one two "
    assert all(final.startswith(s) for s in streamed)  # "E", "EN" were held back
    _, kept = _finish("one two END", "END", stop_regex=["END"], no_stop_trim=True)
    assert kept == "one two END"


def test_a_pattern_that_backtracks_without_end_times_out():
    # the scheduler must not stall on it: the search gives up and says which pattern
    assert sr.search([r"(a|aa)+b"], "a" * 8, True, 1) is None
    with pytest.raises(sr.SearchTimeout, match=r"\(a\|aa\)\+b"):
        sr.search([r"(a|aa)+b"], "a" * 80, True, 1)  # exponential: 2**40 ways
    with pytest.raises(sr.SearchTimeout):
        sr.search(["ok", r"(a|aa)+b"], "x" * 20 + "a" * 80, False, 1)


def test_many_slow_patterns_share_one_time_limit_per_step():
    """32 patterns that each take a little under the limit (polynomial backtracking) would
    have cost a step 32 times it: together they get the limit once, then the request stops."""
    patterns = [f"(?:a+)+c{i}" for i in range(sr.MAX_STOP_REGEX_COUNT)]
    tail = "a" * 240
    start = time.perf_counter()
    with pytest.raises(sr.SearchTimeout):
        sr.search(patterns, tail, True, 1)
    assert time.perf_counter() - start < 4 * sr.SEARCH_TIMEOUT_S


def test_the_held_tail_is_the_longest_proper_prefix_of_a_stop_string():
    """`stop_prefix_len` (which tries only the stop's first character's positions) against
    the direct search over every length, on random and repetitive texts."""
    import random

    from radixrt.requests.detokenizer import stop_prefix_len

    def direct(text: str, stops: list[str]) -> int:
        best = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.choice(["ab", "abc", "a", "xyz\n"])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        assert stop_prefix_len(text, stops) == direct(text, stops), (text, stops)
    assert stop_prefix_len("x" + "a" * 600, ["a" * 512]) == 511


def test_a_requests_samples_share_one_time_limit_per_step(tiny_llama, monkeypatch):
    """n samples used to get the limit each (n=128: 6.4 s of search a step, on the step loop):
    they share it. Each search here takes 10 ms: one sample runs to its end; of eight (80 ms a
    step), those past the limit are stopped with a 400, and no step searches longer."""
    from radixrt.config import EngineConfig
    from radixrt.requests.messages import GenerateReq
    from radixrt.scheduler.scheduler import Scheduler

    calls: list[int] = []

    def slow_search(p, tail, whole, new_chars, timeout, min_end=0):
        calls[-1] += 1
        began = time.thread_time()
        while time.thread_time() - began < 0.01:  # the budget is the scheduler thread's CPU time
            pass
        if timeout < 0.01:
            raise TimeoutError
        return False

    monkeypatch.setattr(sr, "_search_one", slow_search)
    sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=4096, disable_overlap_schedule=True))
    try:
        for rid, n in (("one", 1), ("eight", 8)):
            sp = SamplingParams(max_new_tokens=6, ignore_eos=True, n=n, stop_regex=["never"])
            sched.handle(GenerateReq(rid, [11, 12, 13], sp))
        finished = {}
        while sched.has_work():
            calls.append(0)
            for out in sched.step():
                if out.finish_reason is not None:
                    finished[out.rid] = out.finish_reason
        assert finished["one"].type == "length"
        eight = [r for rid, r in finished.items() if rid.startswith("eight")]
        stopped = [r for r in eight if r.is_abort]
        assert len(eight) == 8 and stopped and all(r.status_code == 400 for r in stopped), eight
        assert "other samples" in stopped[0].message
        assert max(calls) <= 1 + 6, calls  # the one sample's search, and the eight's 50 ms
    finally:
        sched.close()


def test_a_pattern_slow_every_step_is_stopped_within_its_life_budget(tiny_llama, monkeypatch):
    """A search of 20 ms a step fits the step's 50 ms, and slowed every co-running request for
    as long as its request generated (a 200-token request took 12.8 s with ``(.*)*$x``): one
    sample's searches get `life_budget_s` in all, then the request is stopped with a 400."""
    from radixrt.config import EngineConfig
    from radixrt.requests.messages import GenerateReq
    from radixrt.scheduler.scheduler import Scheduler

    calls = 0

    def slow_search(p, tail, whole, new_chars, timeout, min_end=0):
        nonlocal calls
        calls += 1
        began = time.thread_time()
        while time.thread_time() - began < 0.02:
            if time.thread_time() - began > timeout:
                raise TimeoutError
        return False

    monkeypatch.setattr(sr, "_search_one", slow_search)
    sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=4096, disable_overlap_schedule=True))
    try:
        sp = SamplingParams(max_new_tokens=200, ignore_eos=True, stop_regex=["never"])
        sched.handle(GenerateReq("slow", [11, 12, 13], sp))
        finish = None
        while sched.has_work():
            for out in sched.step():
                finish = out.finish_reason or finish
        assert finish is not None and finish.is_abort and finish.status_code == 400, finish
        assert "in all" in finish.message
        # about 0.25 s / (20 ms - 2 ms a token) searches, not one per token of the 200
        assert 10 <= calls <= 20, calls
    finally:
        sched.close()


def test_the_search_budget_is_cpu_time_so_a_busy_machine_stops_nothing(monkeypatch):
    """Waiting for the CPU (other processes' load, here a sleep) is not the pattern's cost:
    three searches of 30 ms wall time each, little CPU, stay within the 50 ms budget."""

    def waiting_search(p, tail, whole, new_chars, timeout, min_end=0):
        time.sleep(0.03)
        return False

    monkeypatch.setattr(sr, "_search_one", waiting_search)
    assert sr.search(["a", "b", "c"], "some tail", True, 4, 0.0) is None
