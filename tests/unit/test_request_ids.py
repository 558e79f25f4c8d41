"""Request ids: the front's RidTable (clients' rids -> random internal ids),
the scheduler's exact abort and the detokenizer's per-request bookkeeping."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import RequestError
from radixrt.requests.messages import TokenBatch, TokenOutput
from radixrt.requests.rids import RidTable, new_request_id, sample_rids
from radixrt.scheduler.queues import RequestQueues
from radixrt.scheduler.request import Req
from radixrt.scheduler.scheduler import Scheduler
from radixrt.server.ipc import DetokRegister
from radixrt.server.workers import DetokenizerLoop


def test_internal_ids_are_random_and_separate_from_rids():
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    t = RidTable()
    [a, auto] = t.add(["col2", None], [2, 1])
    assert a.rid == "col2" and a.iid != "col2" and re.fullmatch(r"[0-9a-f]{32}", a.iid)
    assert a.sample_rids == ["col2-0", "col2-1"] and a.sample_iids == sample_rids(a.iid, 2)
    assert re.fullmatch(r"[0-9a-f]{32}", auto.rid) and auto.iid != auto.rid
    assert len(t) == 2


def test_a_running_rid_is_refused_including_sample_rids():
    t = RidTable()
    [b] = t.add(["col2-0"], [1])  # B first, under what would be a sample rid of "col2"
    with pytest.raises(RequestError, match="'col2-0' is already running") as ei:
        t.add(["col2"], [2])  # A's samples would be "col2-0" (B's rid) and "col2-1"
    assert ei.value.param == "rid"
    with pytest.raises(RequestError, match="'col2-0' is already running"):
        t.add(["col2-0x", "col2"], [1, 3])  # in one batch, too: all or nothing
    assert t.resolve("col2-0x") == []
    with pytest.raises(RequestError, match="'e-0' is earlier in this call"):
        t.add(["e", "e-0"], [2, 1])  # a conflict inside one call says so
    with pytest.raises(RequestError, match="'e-0' is earlier in this call"):
        t.add(["e-0", "e"], [1, 2])
    assert len(t) == 1
    t.remove(b.iid)
    [a] = t.add(["col2"], [2])
    for rid in ("col2", "col2-0", "col2-1"):
        with pytest.raises(RequestError, match="already running") as ei:
            t.add([rid], [1])
        assert ei.value.param == "rid"
    for rid in ("col2-2", "col2-01", "col2-", "col", "col2-0-0", "col2-١"):
        t.remove(t.add([rid], [1])[0].iid)  # not running: fine
    # all or nothing: a batch with one running rid adds none of its rids
    with pytest.raises(RequestError):
        t.add(["fresh", "col2"], [1, 1])
    assert t.resolve("fresh") == []
    with pytest.raises(RequestError):
        t.add(["twice", "twice"], [1, 1])
    assert t.resolve("twice") == []
    # aborts: the exact rid, then a sample's rid, never a prefix
    assert t.resolve("col2") == [a.iid]
    assert t.resolve("col2-1") == [a.sample_iids[1]]
    assert t.resolve("col") == [] and t.resolve("col2-") == [] and t.resolve("") == []
    assert t.resolve("col2-0") == [a.sample_iids[0]]
    t.remove(a.iid)
    assert len(t) == 0 and t.add(["col2"], [1])


def _sched() -> SimpleNamespace:
    finished = []
    queues = RequestQueues()

    def finish(r: Req, reason: object) -> list[str]:
        finished.append(r.rid)
        return [r.rid]

    arriving = SimpleNamespace(drop=lambda hit: [])
    return SimpleNamespace(queues=queues, arriving=arriving, _finish=finish, _queued_outputs=[], finished=finished)


def test_scheduler_abort_matches_ids_exactly():
    s = _sched()
    reqs = [
        Req(rid=rid, input_ids=[1], sampling=None, seed=0, parent=parent)  # type: ignore[arg-type]
        for rid, parent in (("job", "job"), ("job-7", "job-7"), ("p-0", "p"), ("p-1", "p"), ("p-10", "p-10"))
    ]
    s.queues.running.extend(reqs)
    Scheduler.abort(s, "job")
    assert s.finished == ["job"]
    Scheduler.abort(s, "p")
    assert s.finished == ["job", "p-0", "p-1"]
    Scheduler.abort(s, "")
    assert s.finished == ["job", "p-0", "p-1", "job-7", "p-10"]
    assert s._queued_outputs == s.finished  # each abort's last output goes out with the next step


def test_scheduler_aborts_a_whole_batch_in_one_pass():
    """A disconnected batch of thousands of prompts is one abort of all its ids: one pass
    over the queues (one pass per id took the scheduler minutes for a 2,000-prompt batch)."""
    s = _sched()
    reqs = [
        Req(rid=f"b{i}-{j}", input_ids=[1], sampling=None, seed=0, parent=f"b{i}")  # type: ignore[arg-type]
        for i in range(10_000)
        for j in range(2)
    ]
    s.queues.waiting.extend(reqs[::2])
    s.queues.running.extend(reqs[1::2])
    start = time.perf_counter()
    Scheduler.abort(s, *(f"b{i}" for i in range(0, 10_000, 2)))
    assert time.perf_counter() - start < 5
    assert len(s.finished) == 10_000 and all(int(r.parent[1:]) % 2 for r in s.queues.waiting + s.queues.running)
    assert len(s.queues.waiting) == len(s.queues.running) == 5_000


def test_detokenizer_forgets_only_its_own_samples(tokenizer):
    loop = DetokenizerLoop(tokenizer)
    loop.handle(DetokRegister(["job-0", "job-1"], parent="job"))
    loop.handle(DetokRegister(["job-7"], parent="job-7"))
    loop.handle(DetokRegister(["job-10"], parent="job-10"))
    # the request "job" refused as a whole: its samples go, "job-7" and "job-10" stay
    out = loop.handle(TokenBatch([TokenOutput("job", [], 2, 0, 0, FinishReason.abort("bad"))]))
    assert out[0].items[0].rid == "job"
    assert set(loop.detoks) == {"job-7", "job-10"} and not loop.children and not loop.parent_of
    # samples finishing one by one clear their request's entry
    loop.handle(DetokRegister(["q-0", "q-1"], parent="q"))
    loop.handle(TokenBatch([TokenOutput("q-0", [5], 2, 1, 0, FinishReason.length(1))]))
    assert loop.children == {"q": {"q-1"}}
    loop.handle(TokenBatch([TokenOutput("q-1", [5], 2, 1, 0, FinishReason.length(1))]))
    assert not loop.children and not loop.parent_of and set(loop.detoks) == {"job-7", "job-10"}
