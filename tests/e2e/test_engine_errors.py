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
