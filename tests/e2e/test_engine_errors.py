"""Bad input raises a clear error and leaves the engine serving (a tiny
random Llama on the fast path, the embedded model in the slow set)."""

import pytest

import radixrt


@pytest.fixture(scope="module", params=["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def engine(request):
    model = request.getfixturevalue("tiny_llama") if request.param == "tiny" else "default"
    e = radixrt.Engine(model, max_total_tokens=4096)
    yield e
    e.shutdown()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt=""), "empty"),
        (dict(input_ids=[]), "empty"),
        (dict(prompt="hi " * 9000), "context length"),
        (dict(prompt="hi", sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
        (dict(prompt="hi", sampling_params={"top_p": 0}), "top_p"),
        (dict(prompt="hi", sampling_params={"top_p": 1.5}), "top_p"),
        (dict(prompt="hi", sampling_params={"temperature": -0.5}), "temperature"),
        (dict(prompt="hi", sampling_params={"temprature": 0.5}), "unknown sampling parameter"),
        (dict(input_ids=[1, 2, 10**9]), "vocabulary"),
        (dict(prompt="hi", priority=101), r"priorities from -100 to 100 \(--max-client-priority\)"),  # the default
        (dict(prompt="hi", priority=-(2**63)), "--max-client-priority"),
        (dict(prompt="hi", priority="1"), "'priority' must be an integer"),
        (dict(prompt="hi", priority=True), "'priority' must be an integer"),
        (dict(prompt="hi", sampling_params={"beam_width": 2, "max_new_tokens": 0}), "max_new_tokens >= 1"),
        (dict(prompt="hi", sampling_params={"beam_width": 2, "length_penalty": 300}), "length_penalty"),
        (dict(prompt="hi", sampling_params={"beam_width": 2, "length_penalty": -1000}), "length_penalty"),
        (dict(prompt="hi", sampling_params={"stop": [f"s{i}" for i in range(65)]}), "at most 64"),
        (dict(prompt="hi", sampling_params={"stop": ["x" * 513]}), "at most 512"),
        (dict(prompt="hi", sampling_params={"stop_token_ids": [1] * 4097}), "at most 4096"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    out = engine.generate("Say hi.", {"max_new_tokens": 3, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 3
    engine.wait_idle()
    engine.scheduler.check_invariants()
    assert engine.scheduler.kv_usage()["private_slots"] == 0


def test_a_huge_kv_budget_costs_no_more_than_the_request_can_hold(tiny_llama):
    """A budget (or a fraction of an enormous max_new_tokens) past what the request can ever
    hold is held to that: served, with the scheduler's buffers sized by the request."""
    with radixrt.Engine(tiny_llama, max_total_tokens=4096, page_size=1, context_length=256) as e:
        for budget, max_new in [(1e15, 4), (3e38, 4), (0.5, 2**62)]:
            out = e.generate("Say hi.", {"max_new_tokens": max_new, "temperature": 0, "kv_budget": budget})
            assert out["meta_info"]["completion_tokens"] >= 1, (budget, out["meta_info"])
        assert e.generate("Say hi.", {"max_new_tokens": 3, "temperature": 0})["meta_info"]["completion_tokens"] == 3


def test_a_grammar_with_no_text_ends_without_output(engine):
    """A regex no text matches: no token is output (none is the grammar's), a 400 reason."""
    out = engine.generate("hi", {"regex": "[^\\s\\S]", "max_new_tokens": 8})
    reason = out["meta_info"]["finish_reason"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert reason["type"] == "abort" and reason["status_code"] == 400 and "matches no text" in reason["message"]


def test_a_fault_in_one_requests_set_up_fails_that_request_alone(tiny_llama, monkeypatch):
    """A bug met while setting a request up (injected here) ends that request with a 500;
    the scheduler keeps serving the others."""
    with radixrt.Engine(tiny_llama, max_total_tokens=4096) as e:
        budgets = e.scheduler.budgets

        def broken(req):
            raise RuntimeError("injected")

        monkeypatch.setattr(budgets, "start", broken)
        out = e.generate("Say hi.", {"max_new_tokens": 3, "n": 2})
        reasons = [o["meta_info"]["finish_reason"] for o in (out if isinstance(out, list) else [out])]
        assert all(r["type"] == "abort" and r["status_code"] == 500 and "RuntimeError" in r["message"] for r in reasons)
        monkeypatch.undo()
        assert e.generate("Say hi.", {"max_new_tokens": 3, "temperature": 0})["meta_info"]["completion_tokens"] == 3
        e.wait_idle()
        kv = e.get_stats()["kv"]
        assert kv["private_slots"] == 0 and kv["free_slots"] + kv["tree_slots"] == kv["total_slots"]
