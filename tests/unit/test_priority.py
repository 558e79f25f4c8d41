"""Request priority (``--enable-priority-scheduling``): with a full batch, a
later urgent request is admitted before earlier ones; without the flag the
field is accepted and ignored. Driven through the real Scheduler and Engine
on the tiny random Llama."""

from __future__ import annotations

import time

import pytest

from radixrt.config import EngineConfig
from radixrt.requests.intake import Limits, RequestError, build_specs, split_prompts, validate_spec
from radixrt.requests.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.policy import by_priority, urgency
from radixrt.scheduler.request import Req
from radixrt.scheduler.scheduler import Scheduler


def _admission_order(
    tiny_llama: str, arrivals: tuple = (("b", 0, 0.0), ("c", 0, 0.0), ("d", 5, 0.0)), **config
) -> list[str]:
    """One long request fills the batch (max_running_requests=1); then the
    ``arrivals`` (rid, priority, seconds slept before it arrives) come, by
    default b, c (priority 0) and d (priority 5), in that order. Returns the
    order in which all were admitted."""
    sched = Scheduler(
        EngineConfig(
            model_path=tiny_llama,
            max_total_tokens=2048,
            max_running_requests=1,
            disable_overlap_schedule=True,
            debug_check_invariants=True,
            **config,
        )
    )
    try:

        def req(rid: str, prio: int, n_out: int) -> GenerateReq:
            sp = SamplingParams(max_new_tokens=n_out, ignore_eos=True)
            return GenerateReq(rid, [11 + ord(rid[0]), 12, 13, 14], sp, priority=prio)

        sched.handle(req("a", 0, 6))
        sched.step()
        for rid, prio, pause in arrivals:
            time.sleep(pause)
            sched.handle(req(rid, prio, 2))
        return _run_recording_admissions(sched, 100)
    finally:
        sched.close()


def _checked_scheduler(model_path: str, **settings) -> Scheduler:
    """A scheduler stepped by the test (no overlap) that checks its invariants every step."""
    return Scheduler(
        EngineConfig(model_path=model_path, disable_overlap_schedule=True, debug_check_invariants=True, **settings)
    )


def _run_recording_admissions(sched: Scheduler, max_steps: int) -> list[str]:
    """Step ``sched`` until it is idle; the rids in the order they started running."""
    order: list[str] = []
    for _ in range(max_steps):
        for r in sched.running:
            if r.rid not in order:
                order.append(r.rid)
        if not sched.has_work():
            break
        sched.step()
    sched.check_invariants()
    return order


def test_a_call_of_many_long_prompts_in_progress_leaves_room_for_the_next_call(tiny_llama):
    """Ten 2,500-token prompts of one call, admitted together (256 tokens each a step, eight
    in a 2,048-token step), then a short request of another call: it is admitted within two
    steps, not once the first prompts are computed (ten steps later)."""
    sched = _checked_scheduler(tiny_llama, max_total_tokens=40000, long_prefill_token_threshold=256)
    try:
        sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
        for i in range(10):
            sched.handle(GenerateReq(f"batch-{i}", [200 + i] + list(range(300, 2799)), sp, group="batch"))
        sched.step()
        assert len(sched.running) == 8
        sched.handle(GenerateReq("short", [7, 8, 9], sp))
        steps = 0
        while "short" not in {r.rid for r in sched.running}:
            sched.step()
            steps += 1
        assert steps <= 2, steps
        assert len(_run_recording_admissions(sched, 400)) == 11
    finally:
        sched.close()


def test_steps_shorten_while_another_call_has_work(tiny_llama):
    """A batch of 200 short prompts alone computes 2,048 prompt tokens a step; once a request
    of another call comes, each step computes at most four requests' shares (4 x 256) of
    prompt tokens besides the decoders, so that the decoders' tokens do not each wait seconds."""
    sched = _checked_scheduler(
        tiny_llama, max_total_tokens=40000, long_prefill_token_threshold=256, max_running_requests=400
    )
    try:
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
        for i in range(200):
            sched.handle(GenerateReq(f"batch-{i}", [200 + i] + list(range(300, 319)), sp, group="batch"))

        seen: set[str] = set()

        def prompt_tokens_of_a_step() -> int:
            before = sched.counters["prompt_tokens_computed"]
            sched.step()
            seen.update(r.rid for r in sched.running)
            return sched.counters["prompt_tokens_computed"] - before

        assert prompt_tokens_of_a_step() == 2048  # alone: a full step (the 103rd prompt in part)
        sched.handle(GenerateReq("short", [7, 8, 9], SamplingParams(max_new_tokens=4, ignore_eos=True)))
        sizes = [prompt_tokens_of_a_step() for _ in range(4)]
        assert "short" in seen and all(s <= 4 * 256 + 3 for s in sizes), sizes
        _run_recording_admissions(sched, 400)
        assert sched.counters["requests_finished"] == 201
    finally:
        sched.close()


def test_a_full_batch_of_one_call_makes_room_for_another_calls_request(tiny_llama):
    """Eight places (max_running_requests), all taken by one call's long requests, twelve more
    of them waiting: a request of another call runs within two steps (one of the call's is
    retracted, its KV kept in the tree), not once a wave of the call's requests finishes.
    A call keeps its share of the places (8 over 6 calls: 1, so each newcomer gets one), and
    everything finishes, the retracted ones too."""
    sched = _checked_scheduler(tiny_llama, max_total_tokens=20000, max_running_requests=8)
    try:
        sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
        for i in range(20):
            sched.handle(GenerateReq(f"batch-{i}", [300 + i, 301, 302, 303], sp, group="batch"))
        for _ in range(3):
            sched.step()
        assert len(sched.running) == 8
        for name in ("a", "b", "c", "d", "e"):
            sched.handle(GenerateReq(name, [7, 8, 9], SamplingParams(max_new_tokens=4, ignore_eos=True)))
        sched.step()
        sched.step()
        running = {r.rid for r in sched.running}
        assert {"a", "b", "c", "d", "e"} <= running and len(running) == 8, running
        assert sum(r.startswith("batch") for r in running) == 3
        _run_recording_admissions(sched, 2000)
        assert sched.counters["requests_finished"] == 25
    finally:
        sched.close()


def test_two_calls_sharing_a_full_batch_make_room_for_a_third(tiny_llama):
    """Two calls of n=4 fill the eight places, neither with more than half: a newcomer's request
    still runs within two steps (the rule is each call's share, not half of the places)."""
    sched = _checked_scheduler(tiny_llama, max_total_tokens=20000, max_running_requests=8)
    try:
        sp = SamplingParams(max_new_tokens=60, ignore_eos=True, n=4, temperature=1.0)
        for name in ("one", "two"):
            sched.handle(GenerateReq(name, [400, 401, 402, len(name)], sp))
        for _ in range(3):
            sched.step()
        assert len(sched.running) == 8
        sched.handle(GenerateReq("newcomer", [7, 8, 9], SamplingParams(max_new_tokens=4, ignore_eos=True)))
        sched.step()
        sched.step()
        assert "newcomer" in {r.rid for r in sched.running}
        _run_recording_admissions(sched, 2000)
        assert sched.counters["requests_finished"] == 9
    finally:
        sched.close()


def test_urgent_request_is_admitted_first(tiny_llama):
    assert _admission_order(tiny_llama, enable_priority_scheduling=True) == ["a", "d", "b", "c"]


def test_low_values_first_and_flag_off(tiny_llama):
    # lower value = more urgent: d (5) goes last
    assert _admission_order(tiny_llama, enable_priority_scheduling=True, schedule_low_priority_values_first=True) == [
        "a",
        "b",
        "c",
        "d",
    ]
    assert _admission_order(tiny_llama, schedule_policy="fcfs") == ["a", "b", "c", "d"]  # ignored


def test_priority_is_checked_at_the_front_door():
    prompts = split_prompts(None, [[1, 2], [3, 4]], lambda s: [])
    specs = build_specs(prompts, priority=[1, None])
    assert [s.priority for s in specs] == [1, None]
    assert specs[0].to_generate_req("x").priority == 1
    for bad in ("high", "1", 1.5, True):
        with pytest.raises(RequestError, match="'priority' must be an integer") as e:
            build_specs(prompts, priority=bad)
        assert e.value.param == "priority"
    limits = Limits(context_length=64, kv_total_slots=64, vocab_size=100, max_client_priority=10)
    for ok in (10, -10, 0):
        validate_spec(build_specs(prompts, priority=ok)[0], limits)
    for bad in (11, -11, 2**63 - 1, -(2**63), 10**40):  # beyond the cap: a 400 on the server
        spec = build_specs(prompts, priority=bad)[0]
        with pytest.raises(RequestError, match=r"accepts priorities from -10 to 10 \(--max-client-priority\)") as e:
            validate_spec(spec, limits)
        assert e.value.param == "priority"
        assert "admin key" in str(e.value)
    # with the admin key any 64-bit integer passes; beyond that even the admin gets a RequestError
    for ok in (11, 2**63 - 1, -(2**63)):
        validate_spec(build_specs(prompts, priority=ok, admin=True)[0], limits)
    for bad in (2**63, -(2**63) - 1, 10**40):
        with pytest.raises(RequestError, match="64-bit integer") as e:
            validate_spec(build_specs(prompts, priority=bad, admin=True)[0], limits)
        assert e.value.param == "priority"


def test_urgency_ages_by_whole_ticks_and_is_bounded():
    # one tick per second: arriving 6.5 s later costs 6 units (whole ticks passed: 16 - 10)
    assert urgency(0, 10.0, aging_s=1.0) == -10 and urgency(5, 16.5, aging_s=1.0) == -11
    assert urgency(7, 16.5, aging_s=1.0) == -9  # more than the ticks between them: more urgent
    assert urgency(5, 1e6) == 5  # aging off: the priority alone
    assert urgency(5, 3.0, low_values_first=True, aging_s=1.0) == -8  # a lower value is more urgent
    assert urgency(2**63 - 1, 0.0, max_priority=100) == 100 and urgency(-(2**63), 0.0, max_priority=100) == -100


def test_by_priority_orders_by_aged_urgency_and_keeps_the_policy_order_among_equals():
    def req(rid: str, priority: int, arrived_s: float) -> Req:
        return Req(
            rid,
            [1],
            SamplingParams(),
            0,
            priority=priority,
            urgency=urgency(priority, arrived_s, aging_s=0.5, max_priority=100),
        )

    old = req("old", 0, 100.0)  # waited 30 ticks longer than the flood
    flood = [req(f"f{i}", 20, 115.0 + i / 10) for i in range(3)]  # ticks 230-230.6: equal urgency
    same_tick = req("same", 0, 100.2)  # the same tick as "old"
    fresh_urgent = req("urgent", 100, 116.0)  # outranks the 30-tick head start
    ordered = [same_tick, *flood, old, fresh_urgent]  # the policy's order (e.g. lpm)
    got = [r.rid for r in by_priority(ordered)]
    assert got == ["urgent", "same", "old", "f0", "f1", "f2"]
    # without aging the flood (20) comes before both priority-0 requests
    for r in ordered:
        r.urgency = urgency(r.priority, 0.0)
    assert [r.rid for r in by_priority(ordered)] == ["urgent", "f0", "f1", "f2", "same", "old"]


def test_a_request_that_waited_goes_before_a_fresh_more_urgent_one(tiny_llama):
    """b (priority 0) waits 0.5 s, about 10 ticks of 0.05 s; then c (priority 3)
    arrives: b has outgrown it. d (priority 100) outranks b's age."""
    arrivals = (("b", 0, 0.0), ("c", 3, 0.5), ("d", 100, 0.0))
    assert _admission_order(tiny_llama, arrivals, enable_priority_scheduling=True, priority_aging_s=0.05) == [
        "a",
        "d",
        "b",
        "c",
    ]
    # no aging: priority alone
    assert _admission_order(tiny_llama, arrivals, enable_priority_scheduling=True, priority_aging_s=0) == [
        "a",
        "d",
        "c",
        "b",
    ]


@pytest.mark.slow  # three more schedulers; the fast path keeps the admission-order tests
def test_much_more_urgent_request_preempts_and_the_preempted_one_still_answers_right(tiny_llama):
    def run(finish: bool = True, **config) -> tuple[dict[str, list[int]], list[str], int]:
        sched = Scheduler(
            EngineConfig(
                model_path=tiny_llama,
                max_total_tokens=2048,
                max_running_requests=1,
                debug_check_invariants=True,
                **config,
            )
        )
        try:
            sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
            outputs: dict[str, list[int]] = {"low": [], "urgent": []}

            def step() -> None:
                for out in sched.step():
                    outputs[out.rid].extend(out.new_token_ids)

            sched.handle(GenerateReq("low", [5, 6, 7, 8], sp))
            for _ in range(2):
                step()
            sched.handle(GenerateReq("urgent", [9, 10, 11], sp, priority=50))
            step()
            running_after = [r.rid for r in sched.running]
            while finish and sched.has_work():
                step()
            sched.check_invariants()
            return outputs, running_after, sched.stats()["retractions"]
        finally:
            sched.close()

    outputs, running_after, retractions = run(enable_priority_scheduling=True)
    assert running_after == ["urgent"] and retractions == 1  # the low-priority request gave up its slot
    ref, ref_running, ref_retractions = run()  # no priority scheduling: nobody is preempted
    assert ref_running == ["low"] and ref_retractions == 0
    assert outputs == ref  # greedy: the preempted request recomputed its KV and answered the same
    # less than the threshold more urgent (50 < 60): no preemption
    _, running_after, retractions = run(
        False, enable_priority_scheduling=True, priority_scheduling_preemption_threshold=60
    )
    assert running_after == ["low"] and retractions == 0


def test_interleave_calls_takes_turns_between_client_calls():
    from radixrt.scheduler.policy import interleave_calls

    def req(rid: str, group: str) -> Req:
        r = Req(rid, [1], SamplingParams(), 0)
        r.group = group
        return r

    ordered = [req("a0", "A"), req("a1", "A"), req("a2", "A"), req("b0", "B"), req("c0", "C"), req("b1", "B")]
    assert [r.rid for r in interleave_calls(ordered)] == ["a0", "b0", "c0", "a1", "b1", "a2"]
    alone = [req(f"x{i}", f"G{i}") for i in range(3)]
    assert interleave_calls(alone) == alone  # one request per call: the policy's order
    one_call = [req(f"y{i}", "Y") for i in range(3)]
    assert interleave_calls(one_call) == one_call


def test_a_call_of_many_prompts_does_not_hold_up_the_call_behind_it(tiny_llama):
    """A batch of 24 long prompts (one call, sharing a prefix, so LPM ranks them first)
    then a short request: the short one is admitted in the step after the first, not
    after the batch's last prompt."""
    sched = _checked_scheduler(tiny_llama, max_total_tokens=8192, chunked_prefill_size=256)
    try:
        sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
        shared = list(range(20, 120))
        for i in range(24):
            sched.handle(GenerateReq(f"batch-{i}", shared + [200 + i] * 60, sp, group="batch"))
        sched.step()
        sched.handle(GenerateReq("short", [7, 8, 9], sp))
        admitted = _run_recording_admissions(sched, 200)
        assert admitted.index("short") <= 4, admitted  # 256 prompt tokens a step: the batch's first few, then it
        assert len(admitted) == 25
    finally:
        sched.close()


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_a_request_that_shares_nothing_waits_a_bounded_time_under_the_cache_aware_policies(policy):
    """lpm admits the longest cached match first, dfs-weight the heaviest branch: a request with no
    match waited as long as matching ones kept arriving (24 s behind a 25 s flood). Past
    MAX_CACHE_AWARE_WAIT_S it goes first, the oldest first; before that the policy's order stands."""
    from types import SimpleNamespace

    from radixrt.scheduler.policy import MAX_CACHE_AWARE_WAIT_S, order_waiting

    class Node:  # a tree node as dfs-weight reads it (hashable)
        def __init__(self, parent: object, id: int) -> None:
            self.parent, self.id = parent, id

    root = Node(None, 0)
    cached, other = Node(root, 1), Node(root, 2)  # the flood's branch, and a lighter one

    def req(rid: str, arrival: int, queued_at: float) -> Req:
        r = Req(rid, [1], SamplingParams(), 0, arrival=arrival)
        r.queued_at = queued_at
        return r

    now = 1000.0
    lonely = req("lonely", 0, now - 1.0)  # matches nothing
    flood = [req(f"f{i}", i + 1, now - 0.5 + i / 10) for i in range(3)]  # each matches 300 cached tokens

    def match(r: Req) -> SimpleNamespace:
        hit = r.rid != "lonely"
        return SimpleNamespace(length=300 if hit else 0, node=cached if hit else other)

    waiting = [lonely, *flood]
    assert [r.rid for r in order_waiting(policy, waiting, match, now)][-1] == "lonely"  # the policy's order
    late = lonely.queued_at + MAX_CACHE_AWARE_WAIT_S + 0.01  # only "lonely" is overdue
    assert [r.rid for r in order_waiting(policy, waiting, match, late)] == ["lonely", "f0", "f1", "f2"]
    flood[2].queued_at = lonely.queued_at - 1  # two overdue: the oldest arrival first
    assert [r.rid for r in order_waiting(policy, waiting, match, late)][:2] == ["lonely", "f2"]


def test_sglang_s_lof_and_random_policies():
    """SGLang's lof (the longest max_new_tokens first, then arrival) and random (any order of the same
    requests); both are accepted as --schedule-policy."""
    from radixrt.scheduler.policy import order_waiting

    waiting = [Req(f"r{i}", [1], SamplingParams(max_new_tokens=n), 0, arrival=i) for i, n in enumerate((4, 64, 16, 64))]
    assert [r.rid for r in order_waiting("lof", waiting, lambda r: None)] == ["r1", "r3", "r2", "r0"]
    assert sorted(r.rid for r in order_waiting("random", waiting, lambda r: None)) == ["r0", "r1", "r2", "r3"]
    for policy in ("lof", "random"):
        assert EngineConfig(model_path="default", schedule_policy=policy).scheduling.schedule_policy == policy
