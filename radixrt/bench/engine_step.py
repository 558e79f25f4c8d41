"""The step loop's cost through `Engine.generate`: ms per decode step by batch size.

    python -m radixrt.bench.step_time      # with the scheduler-only and HTTP figures, in one run

The same workload as `radixrt.bench.step_time` (``B`` greedy requests with
``prompt_len``-token prompts, the same prompt ids, the same engine settings),
sent as one batch through the public sync ``Engine.generate`` instead of
driving `Scheduler.step` directly, so the figure also counts what the front
costs: submitting, routing each step's outputs to the caller's event loop,
accumulating and detokenizing them, while the scheduler thread runs.

A decode step's cost is a difference of two calls, so that admission, prefill
and the answer's assembly cancel out: for repeat ``k``, one call with
``n = WARM_STEPS + k * steps`` new tokens and one with ``n + steps``, and
``(t_long - t_short) / steps`` (the same output positions as the
scheduler-only repeat ``k``); the median over the repeats is reported. The
prompts are cached by a first call, so both calls of a repeat do the same
prefill. ``step_time`` runs one such repeat after each of its own
(`EngineBench.repeat`), so that both figures see the same load.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

WARM_STEPS = 8


@dataclass
class EngineStepTime:
    batch: int
    ms_per_step: float


def engine_kwargs(
    batches: list[int], steps: int, repeats: int, prompt_len: int, device: str, overlap: Optional[bool]
) -> dict[str, Any]:
    """The engine settings of `step_time.measure` for this workload."""
    max_new = WARM_STEPS + steps * (repeats + 1) + 64
    return dict(
        device=device,
        max_running_requests=max(batches),
        max_total_tokens=max(batches) * (prompt_len + max_new + 16),
        chunked_prefill_size=1 << 16,
        context_length=prompt_len + max_new + 16,
        disable_overlap_schedule=None if overlap is None else not overlap,
    )


def prompts(batch: int, prompt_len: int) -> list[list[int]]:
    """`step_time.measure`'s prompts for ``batch`` requests."""
    return [[(7 * i + j) % 500 + 3 for j in range(prompt_len)] for i in range(batch)]


def _timed_generate(engine: Any, ids: list[list[int]], new_tokens: int) -> float:
    sampling = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=sampling)
    elapsed = time.perf_counter() - start
    assert all(o["meta_info"]["completion_tokens"] == new_tokens for o in outs), "every request must decode"
    return elapsed


class EngineBench:
    """One Engine for the workload; `repeat` times one repeat of a batch size
    (the first call for a batch caches its prompts first)."""

    def __init__(
        self,
        model_path: str,
        batches: list[int],
        steps: int,
        repeats: int,
        device: str = "cpu",
        overlap: Optional[bool] = None,
        prompt_len: int = 32,
    ) -> None:
        from radixrt.engine import Engine

        self.steps = steps
        self.prompt_len = prompt_len
        self.engine = Engine(model_path, **engine_kwargs(batches, steps, repeats, prompt_len, device, overlap))
        self.times: dict[int, list[float]] = {}  # ms per step of each repeat, by batch size

    def repeat(self, batch: int) -> None:
        """Time repeat ``k`` (the k-th call for ``batch``): its decode steps make
        output tokens ``WARM_STEPS + k * steps + 1`` to ``WARM_STEPS + (k + 1) * steps``,
        as the scheduler-only repeat ``k`` does, so both attend over as many tokens."""
        ids = prompts(batch, self.prompt_len)
        if batch not in self.times:
            _timed_generate(self.engine, ids, WARM_STEPS)  # caches the prompts, warms the paths
            self.times[batch] = []
        before = WARM_STEPS + len(self.times[batch]) * self.steps
        short = _timed_generate(self.engine, ids, before)
        long = _timed_generate(self.engine, ids, before + self.steps)
        self.times[batch].append(max(long - short, 0.0) * 1000 / self.steps)

    def rows(self) -> list[EngineStepTime]:
        """The median of each batch size's repeats."""
        return [EngineStepTime(b, statistics.median(ts)) for b, ts in self.times.items()]

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "EngineBench":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def measure_engine(
    model_path: str,
    batches: list[int],
    steps: int,
    repeats: int,
    device: str = "cpu",
    overlap: Optional[bool] = None,
    prompt_len: int = 32,
) -> list[EngineStepTime]:
    """ms per decode step through `Engine.generate` for each batch size (see the module docstring)."""
    with EngineBench(model_path, batches, steps, repeats, device, overlap, prompt_len) as bench:
        for batch in batches:
            for _ in range(repeats):
                bench.repeat(batch)
        return bench.rows()
