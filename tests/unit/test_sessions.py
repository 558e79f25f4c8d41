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
    with pytest.raises(RequestError, match="outside the context"):
        store.begin({"id": sid, "rid": "a", "offset": 99}, [6], BOS)
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
    with pytest.raises(RequestError, match="3 sessions are open"):
        store.open()
    with pytest.raises(RequestError, match="already open"):
        store.close(ids[2]) or store.open(session_id=ids[0])
    for rid in ("x", "y"):
        store.finish(store.begin({"id": ids[0]}, [5], BOS), rid, [6], ok=True)
    with pytest.raises(RequestError, match="remembers 2 turns"):
        store.begin({"id": ids[0]}, [5], BOS)
    expiring = store.open(timeout=0.001)
    import time

    time.sleep(0.01)
    with pytest.raises(RequestError, match="no open session"):
        store.begin({"id": expiring}, [5], BOS)
    for bad in ({"session_id": 5}, {"streaming": "yes"}, {"timeout": 0}):
        with pytest.raises(RequestError):
            store.open(**bad)
