"""The planner sorts ``running`` only when its order may have changed
(`RequestQueues.running_ordered`): a workload with staggered arrivals, chunked
prefill, different output lengths, retractions under KV pressure and stop
tokens gives the same tokens, step by step, as sorting every step, and the
order is checked against a fresh sort after every step (debug_check_invariants)."""

from __future__ import annotations

import pytest

from radixrt.config import EngineConfig
from radixrt.requests.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.planner import BatchPlanner
from radixrt.scheduler.scheduler import Scheduler


class _AlwaysSort(BatchPlanner):
    """The reference: forgets the order before every schedule."""

    def schedule(self, admit=True):  # type: ignore[no-untyped-def]
        self.queues.running_ordered = False
        return super().schedule(admit)


def _run(tiny_llama: str, overlap: bool, always_sort: bool) -> tuple[list[list[tuple[str, list[int]]]], int]:
    sched = Scheduler(
        EngineConfig(
            model_path=tiny_llama,
            max_total_tokens=160,
            max_running_requests=6,
            chunked_prefill_size=24,
            disable_overlap_schedule=not overlap,
            debug_check_invariants=True,
        )
    )
    if always_sort:
        p = sched.planner
        sched.planner = _AlwaysSort(p.config, p.kv, p.queues, p.context_length, p.swap_cost)
    try:
        steps: list[list[tuple[str, list[int]]]] = []
        arrivals = {0: 3, 2: 2, 5: 2, 9: 3}  # step -> requests arriving then
        n = 0
        for step in range(400):
            for _ in range(arrivals.get(step, 0)):
                sp = SamplingParams(
                    max_new_tokens=6 + 5 * (n % 4),
                    temperature=0,
                    stop_token_ids=[7] if n % 3 == 0 else None,
                    ignore_eos=True,
                )
                sched.add_request(GenerateReq(f"r{n}", [(5 * n + j) % 200 + 3 for j in range(10 + 7 * n)], sp))
                n += 1
            steps.append([(o.rid, o.new_token_ids) for o in sched.step()])
            if step > 9 and not sched.has_work():
                break
        assert not sched.has_work()
        return steps, sched.stats()["retractions"]
    finally:
        sched.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_skipping_the_sort_changes_nothing(tiny_llama: str, overlap: bool) -> None:
    lazy, lazy_retractions = _run(tiny_llama, overlap, always_sort=False)
    eager, eager_retractions = _run(tiny_llama, overlap, always_sort=True)
    assert lazy == eager
    assert lazy_retractions == eager_retractions > 0  # the pool is small enough to retract
