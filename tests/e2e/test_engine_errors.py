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
        (
            dict(prompt="hi there", sampling_params={"beam_width": 2}, return_logprob=True, logprob_start_len=0),
            "logprob_start_len cannot be combined with beam_width",
        ),
        (dict(prompt="hi", sampling_params={"beam_width": 10**12}), r"'beam_width' must be in \[0, 64\]"),
        (dict(prompt="hi", sampling_params={"stop": [f"s{i}" for i in range(65)]}), "at most 64"),
        (dict(prompt="hi", sampling_params={"stop": ["x" * 513]}), "at most 512"),
        (dict(prompt="hi", sampling_params={"stop_token_ids": [1] * 4097}), "at most 4096"),
        (dict(prompt="hi", lora_path="nope"), "unknown LoRA adapter 'nope'"),  # as the server's 400
        (dict(prompt="hi", sampling_params={"max_new_tokens": 10**6}), "KV pool.s 4096 tokens"),  # the tighter bound
        (dict(prompt="hi", image_data="cat.png"), "'image_data' is not supported"),
        (dict(prompt="hi", custom_logit_processor="{}"), "'custom_logit_processor' is not supported"),
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
        for budget, max_new in [(1e15, 4), (3e38, 4), (0.5, 240)]:
            out = e.generate("Say hi.", {"max_new_tokens": max_new, "temperature": 0, "kv_budget": budget})
            assert out["meta_info"]["completion_tokens"] >= 1, (budget, out["meta_info"])
        assert e.generate("Say hi.", {"max_new_tokens": 3, "temperature": 0})["meta_info"]["completion_tokens"] == 3


def test_auto_truncate_cuts_what_does_not_fit_instead_of_refusing(tiny_llama):
    """SGLang's allow_auto_truncate in the Engine: a prompt past the context keeps its first tokens
    (one fewer than the context) and one output token; a max_new_tokens past it is cut to what fits."""
    prompt = list(range(10, 110))  # 100 token ids, past a context of 64
    greedy = {"max_new_tokens": 8, "temperature": 0}
    with radixrt.Engine(tiny_llama, context_length=64, allow_auto_truncate=True) as e:
        cut = e.generate(input_ids=prompt, sampling_params=greedy)
        assert (cut["meta_info"]["prompt_tokens"], cut["meta_info"]["completion_tokens"]) == (63, 1)
        assert e.generate(input_ids=prompt[:63], sampling_params=greedy)["output_ids"] == cut["output_ids"]
        room = e.generate(input_ids=prompt[:50], sampling_params={**greedy, "max_new_tokens": 40})
        assert room["meta_info"]["completion_tokens"] == 14
    with radixrt.Engine(tiny_llama, context_length=64) as e:
        with pytest.raises(ValueError, match="context length is 64"):
            e.generate(input_ids=prompt, sampling_params=greedy)


def test_sglang_arguments_unset_are_taken(engine):
    """SGLang's Engine.generate arguments radixrt lacks: wrappers that pass every one unset work."""
    unset = dict(image_data=None, custom_logit_processor=None, return_hidden_states=False, session_params=None)
    out = engine.generate("Say hi.", {"max_new_tokens": 2, "temperature": 0}, **unset, data_parallel_rank=None)
    assert out["meta_info"]["completion_tokens"] == 2 and "prompt_token_ids" not in out
    asked = engine.generate("Say hi.", {"max_new_tokens": 2}, return_prompt_token_ids=True)
    assert asked["prompt_token_ids"] == engine.tokenizer.encode("Say hi.")
    prompt = "A prompt whose prefix only its own extra_key may reuse, " * 3
    keyed = [engine.generate(prompt, {"max_new_tokens": 1}, extra_key=k)["meta_info"] for k in ("t1", "t1", "t2")]
    assert keyed[1]["cached_tokens"] > 0 and keyed[2]["cached_tokens"] == 0, keyed
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_argument'"):
        engine.generate("Say hi.", no_such_argument=1)


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


def test_a_missing_rid_aborts_nobody(engine):
    """``abort_request(None)`` (a rid read with ``dict.get``) raised nothing and aborted every
    caller's requests; only ``""`` aborts all. A rid that is not a string is a TypeError."""
    import threading

    out = {}
    t = threading.Thread(
        target=lambda: out.update(r=engine.generate("x", {"max_new_tokens": 24, "ignore_eos": True}, rid="victim"))
    )
    t.start()
    for bad in (None, 0, ["victim"]):
        with pytest.raises(TypeError, match="rid must be a string"):
            engine.abort_request(bad)
    t.join(120)
    assert out["r"]["meta_info"]["finish_reason"]["type"] == "length"


def test_asyncio_run_per_request_leaves_no_mailbox_behind(engine):
    """One ``asyncio.run`` per request (a common script) kept every loop, and its mailbox,
    alive for good: the mailbox held its loop, the weak map's key."""
    import asyncio
    import gc

    gc.collect()
    before = len(engine.router._mailboxes)  # (the sync API's own loop, when it ran)
    for _ in range(5):
        asyncio.run(engine.async_generate("hi", {"max_new_tokens": 1}))
    gc.collect()
    assert len(engine.router._mailboxes) <= before + 1, (before, len(engine.router._mailboxes))


def test_shutdown_ends_running_requests_with_an_error(tiny_llama):
    """Callers of requests still running when the engine shuts down get their results so far,
    ended by an abort naming the shutdown, sync, streamed and async alike, rather than waiting
    forever."""
    import asyncio
    import threading

    e = radixrt.Engine(tiny_llama, max_total_tokens=4096)
    long = {"max_new_tokens": 4000, "ignore_eos": True}
    got: dict = {}

    def call(name, fn):
        try:
            got[name] = fn()
        except BaseException as ex:  # noqa: BLE001 - what the caller sees
            got[name] = ex

    callers = [
        threading.Thread(target=call, args=("sync", lambda: e.generate("x", long))),
        threading.Thread(target=call, args=("stream", lambda: list(e.generate("y", long, stream=True)))),
        threading.Thread(target=call, args=("async", lambda: asyncio.run(e.async_generate("z", long)))),
    ]
    for t in callers:
        t.start()
    deadline = 60
    while e.router.inflight < 3 and deadline:
        threading.Event().wait(0.1)
        deadline -= 0.1
    e.shutdown()
    for t in callers:
        t.join(20)
    assert not any(t.is_alive() for t in callers), got
    assert sorted(got) == ["async", "stream", "sync"], got
    if isinstance(got["stream"], RuntimeError):  # its next chunk was asked for once the loop had stopped
        assert "shut down" in str(got.pop("stream"))
    ends = {k: (v[-1] if k == "stream" else v)["meta_info"]["finish_reason"] for k, v in got.items()}
    assert all(f["type"] == "abort" and "shut down" in f["message"] for f in ends.values()), ends
    loops_before = sum(t.name == "radixrt-engine-loop" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate("after", {"max_new_tokens": 1})
    assert sum(t.name == "radixrt-engine-loop" for t in threading.enumerate()) == loops_before  # none started
