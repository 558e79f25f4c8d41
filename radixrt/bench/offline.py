"""The offline half of ``radixrt bench``: in-process Engines (one per system:
the lpm reference, the other policies, the radix cache off), the plain
transformers ``generate`` loop replaying the reference's requests wave by wave,
and the offline sweeps (shared prefix length, concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
from typing import Any, Optional

from radixrt.bench.common import HFGenerate, engine_stream, ideal_prompt_tokens
from radixrt.bench.driver import HF_LABEL, OFF, REF, WARMUP_SAMPLING, drive, progress_bar, summarize
from radixrt.bench.report import add_ratios
from radixrt.bench.workloads import Tokens, Workload, shared_prefix, stage_waves


def _reset_peak(engine: Any) -> None:
    # The scheduler's peak counter only ever grows; the engine is idle here
    # (flush_cache succeeded), so zeroing it from this thread is safe.
    engine.scheduler.counters["peak_kv_used_slots"] = 0


def _delta_rate(before: dict, after: dict) -> float:
    """The radix tree's hit rate between two stats (its counters count from the start)."""
    queried = after["queried_tokens"] - before["queried_tokens"]
    return (after["hit_tokens"] - before["hit_tokens"]) / queried if queried else 0.0


def run_offline(engine: Any, wl: Workload, label: str, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    runs = []
    for _ in range(max(1, args.repeats)):
        if not engine.flush_cache():
            raise RuntimeError("engine busy: cannot flush the cache between runs")
        _reset_peak(engine)
        before = engine.get_stats()
        bar = progress_bar(wl.num_requests, f"{wl.name} | {label}", args.progress)
        records, wall = asyncio.run(drive(wl, lambda p: engine_stream(engine, p), math.inf, args.seed, bar))
        if bar is not None:
            bar.close()
        after = engine.get_stats()
        cache = after["cache"]
        counters = {
            "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
            "retractions": after["retractions"] - before["retractions"],
            "tree_hit_rate": _delta_rate(before["cache"], cache),
            "peak_kv_slots": after["peak_kv_used_slots"],
            "kv_pool_slots": after["kv"]["total_slots"],
        }
        runs.append((summarize(wl, records, wall, counters), records))
    mid = statistics.median(r["wall_s"] for r, _ in runs)
    row, records = min(runs, key=lambda x: abs(x[0]["wall_s"] - mid))
    return {**row, "system": label, "mode": "offline", "repeats": len(runs)}, records


def run_hf(
    hf: HFGenerate, wl: Workload, records: list[dict], args: argparse.Namespace, batch_size: Optional[int] = None
) -> dict:
    waves = stage_waves(records)
    hf.batch_size = batch_size or args.hf_batch_size
    walls = []
    for _ in range(max(1, args.repeats)):
        bar = progress_bar(sum(len(w) for w in waves), f"{wl.name} | {HF_LABEL}", args.progress)
        walls.append(hf.run(waves, bar))
        if bar is not None:
            bar.close()
    wall = statistics.median(walls)
    n = sum(len(w) for w in waves)
    out = sum(c for w in waves for _, c in w)
    prompt = sum(len(ids) for w in waves for ids, _ in w)
    return {
        "system": f"{HF_LABEL} (batch {hf.batch_size})",
        "mode": "offline",
        "repeats": len(walls),
        "requests": n,
        "completed": n,
        "failed": 0,
        "wall_s": wall,
        "programs": len(wl.programs),
        "request_throughput": n / wall,
        "output_throughput": out / wall,
        "prompt_tokens": prompt,
        "output_tokens": out,
        "cached_tokens": 0,
        "cache_hit_rate": 0.0,
        "ideal_prompt_tokens": ideal_prompt_tokens(
            (r["input_ids"], r["output_ids"]) for r in sorted(records, key=lambda r: r["order"])
        ),
        "prompt_tokens_computed": prompt,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class Systems:
    """The offline systems, created once and kept for the whole run."""

    def __init__(self, args: argparse.Namespace) -> None:
        from radixrt.engine import Engine

        common = dict(
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            log_level=args.log_level,
        )
        policies = [x.strip() for x in args.policies.split(",") if x.strip()]
        if "lpm" in policies:
            policies.remove("lpm")
        self.engines: dict[str, Any] = {REF: Engine(args.model, schedule_policy="lpm", **common)}
        if not args.skip_cache_off:
            self.engines[OFF] = Engine(args.model, schedule_policy="lpm", disable_radix_cache=True, **common)
        for pol in policies:
            self.engines[f"{REF} {pol}"] = Engine(args.model, schedule_policy=pol, **common)
        ref = self.engines[REF]
        self.model_path = ref.model_path
        self.tokens = Tokens(ref.tokenizer, ref.scheduler.vocab_size)
        self.hf: Optional[HFGenerate] = None
        if not args.skip_transformers:
            self.hf = HFGenerate(self.model_path, args.hf_batch_size)
        for e in self.engines.values():  # first-call costs (and the JSON grammar's compilation) out
            for sp in WARMUP_SAMPLING:
                e.generate(input_ids=list(range(100, 164)), sampling_params=sp)
        if self.hf is not None:
            self.hf.run([[(list(range(100, 164)), 4)]])

    def shutdown(self) -> None:
        for e in self.engines.values():
            e.shutdown()
        self.engines.clear()
        self.hf = None


def bench_workload_offline(systems: Systems, wl: Workload, args: argparse.Namespace) -> tuple[list[dict], list]:
    rows, ref_records = [], None
    for label, engine in systems.engines.items():
        row, records = run_offline(engine, wl, label, args)
        rows.append(row)
        if label == REF:
            ref_records = records
    if systems.hf is not None and ref_records is not None:
        rows.append(run_hf(systems.hf, wl, ref_records, args))
    return rows, ref_records


def run_sweep(kind: str, systems: Systems, args: argparse.Namespace) -> dict:
    """Offline cost growth: shared prefix length, or concurrency (requests at once)."""
    rows = []
    if kind == "prefix":
        xs, xname = _ints(args.prefix_lens), "shared prefix tokens"
    else:
        xs, xname = _ints(args.concurrency), "concurrent requests"
    for x in xs:
        if kind == "prefix":
            wl = shared_prefix(
                systems.tokens,
                requests=args.sweep_requests,
                prefix=x,
                unique=16,
                output=8,
                seed=args.seed + x,
                scale_requests=False,
            )
        else:
            wl = shared_prefix(
                systems.tokens,
                requests=x,
                prefix=args.concurrency_prefix,
                unique=16,
                output=16,
                seed=args.seed + x,
                scale_requests=False,
            )
        print(f"\n== sweep {kind}: {xname} = {x} ({wl.shape})", file=sys.stderr)
        point = []
        for label in (REF, OFF):
            if label in systems.engines:
                row, records = run_offline(systems.engines[label], wl, label, args)
                point.append(row)
                if label == REF:
                    ref_records = records
        if systems.hf is not None:
            point.append(run_hf(systems.hf, wl, ref_records, args, batch_size=x if kind == "concurrency" else None))
        add_ratios(point)
        rows += [{**r, "x": x} for r in point]
    return {
        "kind": kind,
        "x": xname,
        "rows": rows,
        "params": {"requests": args.sweep_requests, "concurrency_prefix": args.concurrency_prefix},
        "context": {"model": systems.model_path, "args": {"max_total_tokens": args.max_total_tokens}},
    }
