"""The result router both fronts share (`radixrt.requests.router`): groups of
samples, the rid table, the refused-n>1 fan-out, aborts, failures, and
delivery from another thread with one wake-up per consumer loop per batch.

The transport records what the router sends; the consumer loops are real
asyncio loops on their own threads, as the Engine's callers are."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Sequence

import pytest

from radixrt.requests.finish import FinishReason
from radixrt.requests.intake import RequestError, build_specs, split_prompts
from radixrt.requests.messages import TokenOutput
from radixrt.requests.results import ResultAccumulator
from radixrt.requests.rids import RidEntry
from radixrt.requests.router import ResultRouter
from radixrt.sampling.params import SamplingParams


class Recorder:
    """A transport that records what the router sends."""

    def __init__(self) -> None:
        self.requests: list[RidEntry] = []
        self.aborts: list[str] = []

    def send_request(self, spec: Any, entry: RidEntry) -> None:
        self.requests.append(entry)

    def send_abort(self, iids: Sequence[str]) -> None:
        self.aborts.extend(iids)


class CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts the wake-ups other threads send it."""

    wakeups = 0

    def call_soon_threadsafe(self, *args: Any, **kwargs: Any) -> Any:
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kwargs)


class LoopThread:
    def __init__(self) -> None:
        self.loop = CountingLoop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def loops():
    made: list[LoopThread] = []

    def make() -> LoopThread:
        made.append(LoopThread())
        return made[-1]

    yield make
    for lt in made:
        if not lt.loop.is_closed():
            lt.close()


def specs(tokenizer, prompts: list[str], rid: Any = None, **sampling: Any):
    return build_specs(
        split_prompts(prompts, None, tokenizer.encode), rid=rid, sampling_params={"max_new_tokens": 8, **sampling}
    )


async def submit(router: ResultRouter, specs_: list, **kw: Any):
    return router.submit(specs_, **kw)


def test_one_wakeup_per_loop_per_batch_and_results_in_order(tokenizer, loops):
    t = Recorder()
    router = ResultRouter(tokenizer, t)
    a, b = loops(), loops()
    ga = a.run(submit(router, specs(tokenizer, ["one", "two", "three"])))
    gb = b.run(submit(router, specs(tokenizer, ["four"], n=2)))
    ea, eb = t.requests[0], t.requests[-1]
    ids = tokenizer.encode(" hello world")
    # one step: a token for every sample of both loops, from this (another) thread
    step = [TokenOutput(st.rid, ids[:1], 2, 1, 0) for st in ga.states + gb.states]
    a.loop.wakeups = b.loop.wakeups = 0
    router.deliver(step)
    assert (a.loop.wakeups, b.loop.wakeups) == (1, 1)
    a.run(asyncio.sleep(0))
    b.run(asyncio.sleep(0))
    assert [st.acc.output_ids for st in ga.states + gb.states] == [ids[:1]] * 5
    # the last step finishes everything; the rids leave the table
    router.deliver([TokenOutput(st.rid, ids[1:2], 2, 2, 0, FinishReason.length(2)) for st in ga.states + gb.states])
    a.run(ga.wait())
    b.run(gb.wait())
    assert [st.acc.to_dict()["text"] for st in gb.states] == [tokenizer.decode(ids[:2])] * 2
    assert [st.acc.rid for st in gb.states] == [f"{eb.rid}-0", f"{eb.rid}-1"]
    assert router.inflight == 0 and not router._requests and len(router._rids) == 0
    a.run(submit(router, specs(tokenizer, ["again"], rid=ea.rid)))  # its rid is free again


def test_a_busy_loop_is_woken_once_for_many_batches(tokenizer, loops):
    router = ResultRouter(tokenizer, Recorder())
    a = loops()
    g = a.run(submit(router, specs(tokenizer, ["x"])))
    st = g.states[0]
    gate = threading.Event()
    a.loop.call_soon_threadsafe(gate.wait, 5)  # the loop is busy until the gate opens
    a.loop.wakeups = 0
    for k in range(10):
        router.deliver([TokenOutput(st.rid, [5], 2, k + 1, 0)])
    assert a.loop.wakeups == 1
    gate.set()
    a.run(asyncio.sleep(0))
    assert st.acc.output_ids == [5] * 10 and st.version == 10


def test_refused_request_ends_every_sample_and_aborts_resolve_exactly(tokenizer, loops):
    t = Recorder()
    router = ResultRouter(tokenizer, t)
    a = loops()
    g = a.run(submit(router, specs(tokenizer, ["p"], rid="job", n=3)))
    [entry] = t.requests
    router.abort_rid("job-1")
    router.abort_rid("job")
    router.abort_rid("jo")
    router.abort_rid("")
    assert t.aborts == [entry.sample_iids[1], entry.iid, ""]
    with pytest.raises(RequestError, match="already running"):
        a.run(submit(router, specs(tokenizer, ["p"], rid="job-2")))
    # the scheduler refuses the request as a whole, under the request's internal id
    router.deliver([TokenOutput(entry.iid, [], 2, 0, 0, FinishReason.abort("too long", 400))])
    a.run(g.wait())
    assert [st.acc.finish_reason for st in g.states] == [FinishReason.abort("too long", 400)] * 3
    assert router.inflight == 0 and len(router._rids) == 0


def test_abort_group_ends_now_and_late_outputs_are_dropped(tokenizer, loops):
    t = Recorder()
    router = ResultRouter(tokenizer, t)
    a = loops()
    g = a.run(submit(router, specs(tokenizer, ["p", "q"])))
    first = g.states[0]
    router.deliver([TokenOutput(first.rid, [5], 2, 1, 0, FinishReason.length(1))])
    a.run(asyncio.sleep(0))

    async def abort() -> None:
        router.abort_group(g, "aborted: gone")

    a.run(abort())
    assert t.aborts == [t.requests[1].iid]  # only the request still running
    assert g.done and g.states[1].acc.finish_reason == FinishReason.abort("aborted: gone")
    assert first.acc.finish_reason == FinishReason.length(1)
    router.deliver([TokenOutput(g.states[1].rid, [6], 2, 1, 0)])  # the scheduler's late output
    a.run(asyncio.sleep(0))
    assert g.states[1].acc.output_ids == [] and router.inflight == 0


def test_fail_all_and_finish_all(tokenizer, loops):
    router = ResultRouter(tokenizer, Recorder())
    a = loops()
    g = a.run(submit(router, specs(tokenizer, ["p"], n=2)))
    router.fail_all("the scheduler process exited")
    a.run(g.wait())
    assert [st.error for st in g.states] == ["the scheduler process exited"] * 2
    assert router.inflight == 0 and len(router._rids) == 0
    g = a.run(submit(router, specs(tokenizer, ["p"])))
    router.finish_all(FinishReason.abort("engine error: boom"))
    a.run(g.wait())
    assert g.states[0].acc.to_dict()["meta_info"]["finish_reason"] == {"type": "abort", "message": "engine error: boom"}


def test_a_closed_loops_requests_are_aborted_and_forgotten(tokenizer, loops):
    t = Recorder()
    router = ResultRouter(tokenizer, t)
    a = loops()
    a.run(submit(router, specs(tokenizer, ["p"], rid="gone")))
    a.close()
    router.deliver([TokenOutput(t.requests[0].iid, [5], 2, 1, 0)])
    assert t.aborts == [t.requests[0].iid]
    assert router.inflight == 0 and len(router._rids) == 0


def test_text_made_once_at_the_end_equals_the_live_text(tokenizer):
    ids = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    sp = SamplingParams.from_dict({"stop": [" lazy"]})
    live = ResultAccumulator("r", tokenizer, sp)
    once = ResultAccumulator("r", tokenizer, sp, live_text=False)
    for i, tid in enumerate(ids):
        fin = FinishReason.stop(" lazy") if i == len(ids) - 1 else None
        for acc in (live, once):
            acc.add(TokenOutput("r", [tid], 3, i + 1, 0, fin))
        if fin is None:
            assert once.text == "" and live.text
    a, b = once.to_dict(), live.to_dict()
    assert a["meta_info"].pop("e2e_latency") > 0 and b["meta_info"].pop("e2e_latency") > 0  # (their own clocks)
    assert a == b and once.text == " the quick brown fox jumps over the"


def test_an_output_that_cannot_be_read_fails_its_request_alone(tokenizer, loops):
    """A fault met reading one request's output (here: hidden-state bytes that are no float32
    array) fails that request; the other outputs of the same batch are delivered (the batch was
    dropped whole, and every request in it waited forever)."""
    router = ResultRouter(tokenizer, Recorder())
    a = loops()
    group = a.run(submit(router, specs(tokenizer, ["one", "two"])))
    bad, good = group.states
    done = FinishReason.length(1)
    broken = TokenOutput(bad.rid, [5], 2, 1, 0, done)
    broken.hidden_states = (1, 3, b"123")
    router.deliver([broken, TokenOutput(good.rid, [6], 2, 1, 0, done)])
    a.run(group.wait())
    assert bad.done and "internal error" in (bad.error or "") and good.acc.output_ids == [6] and good.error is None
    assert router.inflight == 0


def test_on_done_runs_once_when_the_last_sample_ends_however_it_ends(tokenizer, loops):
    """A group's hook sees it done: finished, aborted, failed, or its loop closed."""
    router = ResultRouter(tokenizer, Recorder())
    a = loops()
    seen: list[list] = []

    def hook(group) -> None:
        seen.append([st.acc.finish_reason or st.error for st in group.states])

    g = a.run(submit(router, specs(tokenizer, ["p", "q"]), on_done=hook))
    router.deliver([TokenOutput(g.states[0].rid, [5], 2, 1, 0, FinishReason.length(1))])
    a.run(asyncio.sleep(0))
    assert seen == []  # one sample still runs
    router.deliver([TokenOutput(g.states[1].rid, [6], 2, 1, 0, FinishReason.length(1))] * 2)
    a.run(g.wait())
    assert seen == [[FinishReason.length(1)] * 2]

    g = a.run(submit(router, specs(tokenizer, ["p"]), on_done=hook))

    async def abort() -> None:
        router.abort_group(g, "gone")
        router.abort_group(g, "gone")

    a.run(abort())
    assert seen[-1] == [FinishReason.abort("gone")] and len(seen) == 2
    a.run(submit(router, specs(tokenizer, ["p"], n=2), on_done=hook))
    router.fail_all("the scheduler process exited")
    a.run(asyncio.sleep(0))
    assert seen[-1] == ["the scheduler process exited"] * 2
    a.run(submit(router, specs(tokenizer, ["p"]), on_done=hook))
    a.close()
    router.deliver([TokenOutput(next(iter(router.states)), [5], 2, 1, 0)])
    assert len(seen) == 4
