"""SGLang's sessions on the in-process Engine (tiny random Llama): `open_session`, turns through
``generate(..., session_params=...)`` that send only their new tokens, streamed or whole, and a
turn that is refused or aborted leaving its session able to go on."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from tests.support.engines import greedy, tiny_engine_fixture

engine = tiny_engine_fixture()


def test_turns_run_on_the_whole_conversation_and_reuse_its_cache(engine):
    sid = engine.open_session(1000, streaming=True)
    context: list[int] = []
    for i, ids in enumerate([[1, 500, 501, 502], [600, 601], [700]]):
        if i == 1:  # a streamed turn is remembered too
            out = list(
                engine.generate(input_ids=ids, sampling_params=greedy(6), session_params={"id": sid}, stream=True)
            )[-1]
        else:
            out = engine.generate(input_ids=ids, sampling_params=greedy(6), session_params={"id": sid})
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(context) + len(ids)
        if i:
            assert meta["cached_tokens"] >= len(context) - 1
        alone = engine.generate(input_ids=context + ids, sampling_params=greedy(6))
        assert out["output_ids"] == alone["output_ids"]
        context += ids + out["output_ids"]
    engine.close_session(sid)
    with pytest.raises(ValueError, match="no open session"):
        engine.generate(input_ids=[5], sampling_params=greedy(2), session_params={"id": sid})
    with pytest.raises(ValueError, match="no open session"):
        engine.close_session(sid)


def test_a_refused_or_aborted_turn_is_forgotten_and_the_session_goes_on(engine):
    sid = engine.open_session(session_id="mine", streaming=True)
    with pytest.raises(ValueError, match="already open"):
        engine.open_session(session_id="mine")
    first = engine.generate(input_ids=[1, 40, 41], sampling_params=greedy(4), session_params={"id": sid})
    with pytest.raises(ValueError, match="one prompt"):
        engine.generate(input_ids=[[5], [6]], sampling_params=greedy(2), session_params={"id": sid})
    with pytest.raises(ValueError):  # over the context: refused before it is queued
        engine.generate(input_ids=[5] * 100_000, sampling_params=greedy(2), session_params={"id": sid})
    stream = engine.generate(input_ids=[60], sampling_params=greedy(200), session_params={"id": sid}, stream=True)
    next(stream)
    stream.close()  # an aborted turn
    nxt = engine.generate(input_ids=[70], sampling_params=greedy(2), session_params={"id": sid})
    assert nxt["meta_info"]["prompt_tokens"] == 3 + len(first["output_ids"]) + 1  # after the first turn
    engine.close_session(sid)


@pytest.mark.slow
def test_a_timeout_counts_idle_time_from_the_end_of_the_last_turn(engine):
    """A session's timeout never closes it under a running turn, and counts from the turn's end."""
    sid = engine.open_session(timeout=0.3)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        turn = pool.submit(
            engine.generate, input_ids=list(range(10, 40)), sampling_params=greedy(1500), session_params={"id": sid}
        )
        time.sleep(0.6)
        engine.open_session()  # any call reaps the sessions past their timeout
        first = turn.result(timeout=120)
    nxt = engine.generate(
        input_ids=[50], sampling_params=greedy(2), session_params={"id": sid, "rid": first["meta_info"]["id"]}
    )
    assert nxt["meta_info"]["prompt_tokens"] == 30 + len(first["output_ids"]) + 1
    time.sleep(0.6)
    engine.open_session()
    with pytest.raises(ValueError, match="no open session"):
        engine.generate(input_ids=[5], sampling_params=greedy(2), session_params={"id": sid})
