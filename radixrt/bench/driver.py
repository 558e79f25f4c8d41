"""Driving one workload and summarizing it: the part of ``radixrt bench``
that the offline runner (in-process Engine, :mod:`radixrt.bench.offline`) and
the online runner (HTTP server, :mod:`radixrt.bench.online`) share.

A workload's programs start at Poisson arrival times (all at once offline);
every request they issue is recorded, and :func:`summarize` turns the records
plus the engine's or server's counters into one table row.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from typing import Any, Callable

from radixrt.bench.common import ReqResult, arrivals, ideal_prompt_tokens, latency_stats
from radixrt.bench.workloads import PERSON_SCHEMA, Workload

REF = "radixrt"  # the row every ratio is taken against
OFF = "radixrt, cache off"
HF_LABEL = "transformers generate"
# Warm-up requests for every engine and server: first-call costs, and the
# compilation of the JSON workload's grammar (compiled once per schema and
# cached; the steady state is what the table should show).
WARMUP_SAMPLING = [
    {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
    {"max_new_tokens": 4, "temperature": 0, "json_schema": json.dumps(PERSON_SCHEMA)},
]


async def drive(
    wl: Workload, submit: Callable[[dict], Any], rate: float, seed: int, bar: Any = None
) -> tuple[list[dict], float]:
    """Run every program of ``wl``; programs start at Poisson arrival times
    (``rate`` programs/s; inf: all at once). Returns the request records
    (submission order, stage, ids, outcome) and the wall time."""
    records: list[dict] = []
    order = itertools.count()

    async def gen(ids: list[int], sp: dict, stage: int) -> ReqResult:
        idx = next(order)
        res = await submit({"input_ids": ids, "sampling_params": sp})
        records.append(
            {
                "order": idx,
                "stage": stage,
                "input_ids": ids,
                "output_ids": list(res.output_ids),
                "completion_tokens": res.output_tokens,
                "res": res,
            }
        )
        if bar is not None:
            bar.update(1)
        return res

    starts = arrivals(random.Random(seed), len(wl.programs), rate)
    t0 = time.perf_counter()

    async def one(program: Any, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        await program(gen)

    await asyncio.gather(*(one(p, at) for p, at in zip(wl.programs, starts)))
    return records, time.perf_counter() - t0


def summarize(wl: Workload, records: list[dict], wall: float, counters: dict) -> dict:
    """One row: throughput, latency percentiles, cache figures (``counters`` from the engine/server)."""
    results = [r["res"] for r in records]
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ideal = ideal_prompt_tokens((r["input_ids"], r["output_ids"]) for r in sorted(records, key=lambda r: r["order"]))
    row = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "wall_s": wall,
        "programs": len(wl.programs),
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": out / wall if wall else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": out,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "ideal_prompt_tokens": ideal,
        **counters,
        **latency_stats(ok),
    }
    computed = row.get("prompt_tokens_computed")
    row["computed_vs_ideal"] = computed / ideal if computed is not None and ideal else None
    if wl.validate is not None:
        row["valid_outputs"] = sum(bool(wl.validate(r.text)) for r in ok)
    return row


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr, dynamic_ncols=True)
