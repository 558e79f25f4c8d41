"""SGLang's sessions (radixrt/requests/sessions.py): the prompt a turn runs under each of
``session_params``' options, and the store's bounds."""

from __future__ import annotations

import pytest

from radixrt.requests import sessions as sessions_module
from radixrt.requests.errors import RequestError
from radixrt.requests.sessions import SessionStore

BOS = 1


def test_a_streaming_session_continues_its_last_good_turn():
    store = SessionStore()
    sid = store.open(streaming=True)
    first = store.begin({"id": sid}, [BOS, 5, 6], BOS)
    assert first.prompt == [BOS, 5, 6]
    with pytest.raises(RequestError, match="already has a turn running"):
        store.begin({"id": sid}, [7], BOS)
    store.finish(first, "r1", [8, 9], ok=True)
    second = store.begin({"id": sid, "rid": "ignored"}, [BOS, 7], BOS)
    assert second.prompt == [BOS, 5, 6, 8, 9, 7]  # the new turn's BOS dropped
    store.finish(second, "r2", [10], ok=False)  # aborted: forgotten
    third = store.begin({"id": sid}, [11], BOS)
    assert third.prompt == [BOS, 5, 6, 8, 9, 11]
    for bad in ({"replace": True}, {"offset": 2}, {"drop_previous_output": True}):
        store.finish(third, "r3", [], ok=False)
        with pytest.raises(RequestError, match="streaming session takes neither"):
            store.begin({"id": sid, **bad}, [1], BOS)


def test_a_tree_session_continues_the_turn_it_names():
    store = SessionStore()
    sid = store.open()
    root = store.begin({"id": sid}, [BOS, 2, 3], BOS)
    store.finish(root, "a", [4, 5], ok=True)
    child = store.begin({"id": sid, "rid": "a"}, [6], BOS)
    assert child.prompt == [BOS, 2, 3, 4, 5, 6]
    store.finish(child, "b", [7], ok=True)
    assert store.begin({"id": sid, "rid": "a", "drop_previous_output": True}, [6], BOS).prompt == [BOS, 2, 3, 6]
    assert store.begin({"id": sid, "rid": "b", "offset": 2}, [9], BOS).prompt == [BOS, 2, 9]
    assert store.begin({"id": sid}, [BOS, 9], BOS).prompt == [BOS, 9]  # no rid: a new root
    store.begin({"id": sid, "rid": "a", "replace": True}, [6], BOS)  # forgets a's children
    with pytest.raises(RequestError, match="no finished turn 'b'"):
        store.begin({"id": sid, "rid": "b"}, [6], BOS)
    # SGLang's offsets slice as Python does: 0 keeps the context (its own tests send it every turn),
    # a negative one counts from the end, one past the end keeps it all
    context = [BOS, 2, 3, 4, 5]
    for flag in ("replace", "drop_previous_output"):  # "no" read as true before
        with pytest.raises(RequestError, match="must be booleans"):
            store.begin({"id": sid, "rid": "a", flag: "no"}, [6], BOS)
    for offset, kept in ((0, context), (-1, context[:-1]), (99, context), (True, None)):
        if kept is None:
            with pytest.raises(RequestError, match="'offset' an integer"):
                store.begin({"id": sid, "rid": "a", "offset": offset}, [6], BOS)
        else:
            assert store.begin({"id": sid, "rid": "a", "offset": offset}, [6], BOS).prompt == kept + [6]
    store.close(sid)
    with pytest.raises(RequestError, match="no open session"):
        store.begin({"id": sid}, [6], BOS)
    with pytest.raises(RequestError, match="no open session"):
        store.close(sid)


def test_the_store_is_bounded(monkeypatch):
    monkeypatch.setattr(sessions_module, "MAX_SESSIONS", 3)
    monkeypatch.setattr(sessions_module, "MAX_TURNS", 2)
    store = SessionStore()
    ids = [store.open() for _ in range(3)]
    with pytest.raises(RequestError, match="3 sessions are open, none idle for 600 s"):
        store.open()
    store.close(ids[2])
    with pytest.raises(RequestError, match="already open"):
        store.open(session_id=ids[0])
    for rid in ("x", "y"):
        store.finish(store.begin({"id": ids[0]}, [5], BOS), rid, [6], ok=True)
    # a linear chat past the cap goes on (it was refused at its 33rd turn): each turn past it is kept
    # whole, and the oldest turn that no other continues makes room
    last, expected = "y", [5, 6]
    for k in range(5):
        turn = store.begin({"id": ids[0], "rid": last}, [10 + k], BOS)
        expected += [10 + k]
        assert turn.prompt == expected
        store.finish(turn, f"z{k}", [20 + k], ok=True)
        last, expected = f"z{k}", expected + [20 + k]
    assert store.begin({"id": ids[0], "rid": last}, [99], BOS).prompt == expected + [99]
    expiring = store.open(timeout=0.001)
    import time

    time.sleep(0.01)
    with pytest.raises(RequestError, match="no open session"):
        store.begin({"id": expiring}, [5], BOS)
    for bad in ({"session_id": 5}, {"streaming": "yes"}, {"timeout": 0}):
        with pytest.raises(RequestError):
            store.open(**bad)


def test_turn_ids_cannot_tie_turns_into_loops_and_every_turn_counts_against_the_bounds(monkeypatch):
    """A client names its turns: a turn named like one the session holds is served, not remembered
    (it made a turn its own parent, and replacing it recursed without end); turns begun together
    are bounded when they finish too; all sessions' turns share one token budget."""
    store = SessionStore()
    sid = store.open()
    store.finish(store.begin({"id": sid}, [5], BOS), "X", [6], ok=True)
    store.finish(store.begin({"id": sid, "rid": "X"}, [7], BOS), "X", [8], ok=True)  # not remembered
    assert store.begin({"id": sid, "rid": "X"}, [9], BOS).prompt == [5, 6, 9]
    store.begin({"id": sid, "rid": "X", "replace": True}, [9], BOS)  # no RecursionError
    monkeypatch.setattr(sessions_module, "MAX_TURNS", 3)
    begun = [store.begin({"id": sid}, [5], BOS) for _ in range(10)]
    for i, turn in enumerate(begun):
        store.finish(turn, f"t{i}", [6], ok=True)
    with pytest.raises(RequestError, match="no finished turn 't6'"):  # a full session keeps its latest
        store.begin({"id": sid, "rid": "t6"}, [5], BOS)
    assert store.begin({"id": sid, "rid": "t9"}, [7], BOS).prompt == [5, 6, 7]
    monkeypatch.setattr(sessions_module, "MAX_STORED_TOKENS", 10)
    other = store.open()
    store.finish(store.begin({"id": other}, list(range(2, 20)), BOS), "big", [1], ok=True)
    with pytest.raises(RequestError, match="not remembered"):
        store.begin({"id": other, "rid": "big"}, [5], BOS)
    store.close(sid)
    store.close(other)
    assert store._stored == 0


def test_a_full_store_makes_room_by_closing_an_idle_session(monkeypatch):
    monkeypatch.setattr(sessions_module, "MAX_SESSIONS", 2)
    monkeypatch.setattr(sessions_module, "IDLE_EVICT_S", 0.0)
    store = SessionStore()
    first, second = store.open(), store.open()
    third = store.open()  # the least recently used idle one made room
    with pytest.raises(RequestError, match="no open session"):
        store.begin({"id": first}, [5], BOS)
    assert store.begin({"id": second}, [5], BOS).prompt == store.begin({"id": third}, [5], BOS).prompt == [5]
    for bad in (float("inf"), float("nan")):
        with pytest.raises(RequestError, match="finite"):
            store.open(timeout=bad)


def test_hidden_states_of_a_request_that_never_ran_are_an_empty_list():
    from radixrt.requests.hidden_states import unpack_rows

    assert unpack_rows((0, 0, b"")) == []


def test_a_streaming_turn_past_the_budget_starts_the_line_again(monkeypatch):
    """Its earlier turn is dropped when the new one finishes; not remembered either, the next turn
    starts afresh (it pointed at the dropped turn: a KeyError, a 500)."""
    monkeypatch.setattr(sessions_module, "MAX_STORED_TOKENS", 4)
    store = SessionStore()
    sid = store.open(streaming=True)
    store.finish(store.begin({"id": sid}, [5, 6], BOS), "a", [7], ok=True)
    store.finish(store.begin({"id": sid}, [8], BOS), "b", [9], ok=True)  # 5 tokens: past the budget
    assert store.begin({"id": sid}, [10], BOS).prompt == [10]


def test_a_line_of_turns_keeps_what_each_added_and_puts_every_prompt_back_together():
    """Twenty turns, each continuing the last (one with its output dropped, one cut by offset):
    every prompt is the whole conversation, and the store holds each turn's new tokens and
    output once (it held every prompt whole: the conversation's length times its turns)."""
    store = SessionStore()
    sid = store.open()
    whole: list[int] = []
    rid = None
    added = 0
    for i in range(20):
        new = [100 + 3 * i, 101 + 3 * i]
        params: dict = {"id": sid, "rid": rid}
        if i == 7:
            params["drop_previous_output"] = True
            whole = whole[: len(whole) - 1]  # the last turn's output (one token) left out
        if i == 12:
            params["offset"] = 5
            whole = whole[:5]
        turn = store.begin(params, new, BOS)
        assert turn.prompt == whole + new
        store.finish(turn, f"t{i}", [200 + i], ok=True)
        whole = turn.prompt + [200 + i]
        rid = f"t{i}"
        added += len(new) + 1
    assert store._stored == added  # not quadratic in the turns
    assert store.begin({"id": sid, "rid": "t19"}, [7], BOS).prompt == whole + [7]


def test_a_turn_whose_parent_or_session_went_while_it_ran_is_not_remembered():
    """A turn running while ``replace`` forgot its parent was remembered, and continuing it raised a
    KeyError (a 500) for good; one running while its session was closed and another opened under
    the same id became that new session's turn (the old context crossed into it)."""
    store = SessionStore()
    sid = store.open()
    root = store.begin({"id": sid}, [BOS, 2], BOS)
    store.finish(root, "a", [3], ok=True)
    running = store.begin({"id": sid, "rid": "a"}, [4], BOS)
    store.finish(store.begin({"id": sid, "replace": True}, [BOS, 9], BOS), "b", [1], ok=True)  # forgets "a"
    store.finish(running, "c", [5], ok=True)
    with pytest.raises(RequestError, match="no finished turn 'c'"):
        store.begin({"id": sid, "rid": "c"}, [6], BOS)
    reused = store.open(session_id="reused", streaming=True)
    old = store.begin({"id": reused}, [BOS, 7, 8], BOS)
    store.close(reused)
    store.open(session_id="reused", streaming=True)
    store.finish(old, "d", [9] * 5, ok=True)
    assert store.begin({"id": "reused"}, [BOS, 20], BOS).prompt == [BOS, 20]  # a fresh session
