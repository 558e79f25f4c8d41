"""Request priority (``--enable-priority-scheduling``): with a full batch, a
later urgent request is admitted before earlier ones; without the flag the
field is accepted and ignored. Driven through the real Scheduler and Engine
on the tiny random Llama."""
from __future__ import annotations

import pytest

from radixrt.config import EngineConfig
from radixrt.requests.intake import RequestError, build_specs, split_prompts
from radixrt.requests.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler


def _admission_order(tiny_llama: str, **config) -> list[str]:
    """One long request fills the batch (max_running_requests=1); then b, c
    (priority 0) and d (priority 5) arrive, in that order. Returns the order
    in which the four were admitted."""
    sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=2048, max_running_requests=1,
                                   disable_overlap_schedule=True, debug_check_invariants=True, **config))
    try:
        def req(rid: str, prio: int, n_out: int) -> GenerateReq:
            sp = SamplingParams(max_new_tokens=n_out, ignore_eos=True)
            return GenerateReq(rid, [11 + ord(rid[0]), 12, 13, 14], sp, priority=prio)

        sched.handle(req("a", 0, 6))
        sched.step()
        for msg in (req("b", 0, 2), req("c", 0, 2), req("d", 5, 2)):
            sched.handle(msg)
        order: list[str] = []
        for _ in range(100):
            for r in sched.running:
                if r.rid not in order:
                    order.append(r.rid)
            if not sched.has_work():
                break
            sched.step()
        sched.check_invariants()
        return order
    finally:
        sched.close()


def test_urgent_request_is_admitted_first(tiny_llama):
    assert _admission_order(tiny_llama, enable_priority_scheduling=True) == ["a", "d", "b", "c"]


def test_low_values_first_and_flag_off(tiny_llama):
    # lower value = more urgent: d (5) goes last
    assert _admission_order(tiny_llama, enable_priority_scheduling=True,
                            schedule_low_priority_values_first=True) == ["a", "b", "c", "d"]
    assert _admission_order(tiny_llama, schedule_policy="fcfs") == ["a", "b", "c", "d"]  # ignored


def test_priority_is_checked_at_the_front_door():
    prompts = split_prompts(None, [[1, 2], [3, 4]], lambda s: [])
    specs = build_specs(prompts, priority=[1, None])
    assert [s.priority for s in specs] == [1, None]
    assert specs[0].to_generate_req("x").priority == 1
    for bad in ("high", 1.5, True):
        with pytest.raises(RequestError, match="'priority' must be an integer") as e:
            build_specs(prompts, priority=bad)
        assert e.value.param == "priority"


@pytest.mark.slow  # three more schedulers; the fast path keeps the admission-order tests
def test_much_more_urgent_request_preempts_and_the_preempted_one_still_answers_right(tiny_llama):
    def run(finish: bool = True, **config) -> tuple[dict[str, list[int]], list[str], int]:
        sched = Scheduler(EngineConfig(model_path=tiny_llama, max_total_tokens=2048, max_running_requests=1,
                                       debug_check_invariants=True, **config))
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
            return outputs, running_after, sched.planner.retractions
        finally:
            sched.close()

    outputs, running_after, retractions = run(enable_priority_scheduling=True)
    assert running_after == ["urgent"] and retractions == 1  # the low-priority request gave up its slot
    ref, ref_running, ref_retractions = run()  # no priority scheduling: nobody is preempted
    assert ref_running == ["low"] and ref_retractions == 0
    assert outputs == ref  # greedy: the preempted request recomputed its KV and answered the same
    # less than the threshold more urgent (50 < 60): no preemption
    _, running_after, retractions = run(False, enable_priority_scheduling=True,
                                        priority_scheduling_preemption_threshold=60)
    assert running_after == ["low"] and retractions == 0
