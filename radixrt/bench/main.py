"""``radixrt bench``: radixrt against its baselines on the workloads of the
SGLang paper and the seeds, offline (in-process Engine) and online (HTTP
server, Poisson arrivals), in one process and one run.

    radixrt bench                                    # every workload, offline + online, all baselines
    radixrt bench --workload shared-prefix --repeats 3 --offline-only
    radixrt bench --scale 0.1 --no-online            # a quick look
    radixrt bench --sweep prefix --sweep concurrency --offline-only --workload none
    radixrt bench --json-out r.json --markdown-out r.md --plot-dir docs/img

Workloads: see ``radixrt/bench_workloads.py`` (shared-prefix, few-shot,
multi-turn, agent-fanout, tree-of-thought, json-extraction, no-sharing).

Systems, measured in the same run on the same machine:

* offline: radixrt with the lpm policy (the reference row), the fcfs and
  dfs-weight policies, radixrt with the radix cache off, and the plain
  transformers ``generate`` loop (batched, left-padded, replaying radixrt's
  requests wave by wave with the same output lengths);
* online: a radixrt server with the radix cache on and one with it off,
  programs arriving as a Poisson process at ``--request-rate`` (``auto``:
  ``--load`` times the offline radixrt program throughput of that workload).

Per run: wall time and its ratio to radixrt, request and output-token
throughput, TTFT and ITL percentiles (from streaming), cache hit rate in
tokens (cached prompt tokens / prompt tokens, from the responses), prompt
tokens computed against the ideal (a prefix cache with unlimited memory:
``bench_common.ideal_prompt_tokens``), peak KV slots in use (tree + running)
and retractions. Figures are ratios from one run; absolute times only mean
something on the machine they were taken on.

Sweeps (offline; radixrt, cache off, transformers): the cost as the shared
prefix grows (``--prefix-lens``; ``--sweep-requests`` requests, each the
prefix + 16 unique tokens -> 8 output tokens) and as concurrency grows
(``--concurrency``: that many requests at once, each a
``--concurrency-prefix``-token shared prefix + 16 unique -> 16 output tokens;
the transformers loop gets the same batch size).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any, Callable, Optional

from radixrt.bench.common import (
    HFGenerate, ReqResult, arrivals, engine_stream, ideal_prompt_tokens, latency_stats, native_stream,
    server_counters, server_kv_peak,
)
from radixrt.bench.workloads import PERSON_SCHEMA, WORKLOADS, Tokens, Workload, make_workload, shared_prefix, stage_waves

REF = "radixrt"  # the row every ratio is taken against
OFF = "radixrt, cache off"
HF_LABEL = "transformers generate"
# Warm-up requests for every engine and server: first-call costs, and the
# compilation of the JSON workload's grammar (compiled once per schema and
# cached; the steady state is what the table should show).
WARMUP_SAMPLING = [{"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                   {"max_new_tokens": 4, "temperature": 0, "json_schema": json.dumps(PERSON_SCHEMA)}]


# ---------------------------------------------------------------------- driving a workload
async def drive(wl: Workload, submit: Callable[[dict], Any], rate: float, seed: int,
                bar: Any = None) -> tuple[list[dict], float]:
    """Run every program of ``wl``; programs start at Poisson arrival times
    (``rate`` programs/s; inf: all at once). Returns the request records
    (submission order, stage, ids, outcome) and the wall time."""
    records: list[dict] = []
    order = itertools.count()

    async def gen(ids: list[int], sp: dict, stage: int) -> ReqResult:
        idx = next(order)
        res = await submit({"input_ids": ids, "sampling_params": sp})
        records.append({"order": idx, "stage": stage, "input_ids": ids, "output_ids": list(res.output_ids),
                        "completion_tokens": res.output_tokens, "res": res})
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
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "wall_s": wall, "programs": len(wl.programs),
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": out / wall if wall else 0.0,
        "prompt_tokens": prompt, "output_tokens": out, "cached_tokens": cached,
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


def _bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------- offline (in-process Engine)
def _reset_peak(engine: Any) -> None:
    # The scheduler's peak counter only ever grows; the engine is idle here
    # (flush_cache succeeded), so zeroing it from this thread is safe.
    engine.scheduler.counters["peak_kv_used_slots"] = 0


def run_offline(engine: Any, wl: Workload, label: str, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    runs = []
    for _ in range(max(1, args.repeats)):
        if not engine.flush_cache():
            raise RuntimeError("engine busy: cannot flush the cache between runs")
        _reset_peak(engine)
        before = engine.get_stats()
        bar = _bar(wl.num_requests, f"{wl.name} | {label}", args.progress)
        records, wall = asyncio.run(drive(wl, lambda p: engine_stream(engine, p), math.inf, args.seed, bar))
        if bar is not None:
            bar.close()
        after = engine.get_stats()
        cache = after["cache"]
        counters = {
            "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
            "retractions": after["retractions"] - before["retractions"],
            "tree_hit_rate": cache["hit_tokens"] / cache["queried_tokens"] if cache["queried_tokens"] else 0.0,
            "peak_kv_slots": after["peak_kv_used_slots"],
            "kv_pool_slots": after["kv"]["total_slots"],
        }
        runs.append((summarize(wl, records, wall, counters), records))
    mid = statistics.median(r["wall_s"] for r, _ in runs)
    row, records = min(runs, key=lambda x: abs(x[0]["wall_s"] - mid))
    return {**row, "system": label, "mode": "offline", "repeats": len(runs)}, records


def run_hf(hf: HFGenerate, wl: Workload, records: list[dict], args: argparse.Namespace,
           batch_size: Optional[int] = None) -> dict:
    waves = stage_waves(records)
    hf.batch_size = batch_size or args.hf_batch_size
    walls = []
    for _ in range(max(1, args.repeats)):
        bar = _bar(sum(len(w) for w in waves), f"{wl.name} | {HF_LABEL}", args.progress)
        walls.append(hf.run(waves, bar))
        if bar is not None:
            bar.close()
    wall = statistics.median(walls)
    n = sum(len(w) for w in waves)
    out = sum(c for w in waves for _, c in w)
    prompt = sum(len(ids) for w in waves for ids, _ in w)
    return {
        "system": f"{HF_LABEL} (batch {hf.batch_size})", "mode": "offline", "repeats": len(walls),
        "requests": n, "completed": n, "failed": 0, "wall_s": wall, "programs": len(wl.programs),
        "request_throughput": n / wall, "output_throughput": out / wall, "prompt_tokens": prompt,
        "output_tokens": out, "cached_tokens": 0, "cache_hit_rate": 0.0,
        "ideal_prompt_tokens": ideal_prompt_tokens((r["input_ids"], r["output_ids"]) for r in
                                                   sorted(records, key=lambda r: r["order"])),
        "prompt_tokens_computed": prompt,
    }


# ---------------------------------------------------------------------- online (HTTP server)
async def _online(url: str, wl: Workload, rate: float, args: argparse.Namespace, label: str) -> tuple[dict, list]:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        (await client.post("/flush_cache")).raise_for_status()
        before = await server_counters(client)
        stop = asyncio.Event()
        peak_task = asyncio.create_task(server_kv_peak(client, stop))
        bar = _bar(wl.num_requests, f"{wl.name} | {label} (online)", args.progress)
        records, wall = await drive(wl, lambda p: native_stream(client, p), rate, args.seed, bar)
        if bar is not None:
            bar.close()
        stop.set()
        peak = await peak_task
        after = await server_counters(client)
    q = after["queried_tokens"] - before["queried_tokens"]
    counters = {
        "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
        "retractions": after["retractions"] - before["retractions"],
        "tree_hit_rate": (after["hit_tokens"] - before["hit_tokens"]) / q if q else 0.0,
        "peak_kv_slots": peak,
    }
    row = summarize(wl, records, wall, counters)
    return {**row, "system": label, "mode": "online", "request_rate": rate}, records


def _warm_server(url: str) -> None:
    import httpx

    for sp in WARMUP_SAMPLING:
        body = {"input_ids": list(range(100, 164)), "sampling_params": sp}
        httpx.post(url + "/generate", json=body, timeout=300).raise_for_status()
    httpx.post(url + "/flush_cache", timeout=30)


# ---------------------------------------------------------------------- tables
COLUMNS = [
    # key, header, format, width
    ("system", "system", "{}", 30),
    ("mode", "mode", "{}", 7),
    ("wall_s", "wall s", "{:.2f}", 8),
    ("time_ratio", "x radixrt", "{:.2f}", 9),
    ("request_throughput", "req/s", "{:.2f}", 7),
    ("output_throughput", "out tok/s", "{:.1f}", 9),
    ("p50_ttft_ms", "TTFT p50", "{:.0f}", 8),
    ("p99_ttft_ms", "TTFT p99", "{:.0f}", 8),
    ("p50_itl_ms", "ITL p50", "{:.0f}", 7),
    ("p99_itl_ms", "ITL p99", "{:.0f}", 7),
    ("cache_hit_rate", "hit", "{:.1%}", 6),
    ("prompt_tokens_computed", "computed", "{:.0f}", 8),
    ("computed_vs_ideal", "/ideal", "{:.2f}", 6),
    ("peak_kv_slots", "peak KV", "{:.0f}", 7),
    ("retractions", "retr", "{:.0f}", 4),
]


def _fmt(fmt: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def add_ratios(rows: list[dict]) -> None:
    """time_ratio: wall time over the radixrt row of the same mode (>1: slower than radixrt)."""
    ref = {r["mode"]: r["wall_s"] for r in rows if r["system"] == REF}
    for r in rows:
        base = ref.get(r["mode"], ref.get("offline"))
        r["time_ratio"] = r["wall_s"] / base if base else None


def format_table(rows: list[dict], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(h for _, h, _, _ in COLUMNS) + " |",
                 "|" + "|".join("---" if k in ("system", "mode") else "---:" for k, *_ in COLUMNS) + "|"]
        lines += ["| " + " | ".join(_fmt(f, r.get(k)) for k, _, f, _ in COLUMNS) + " |" for r in rows]
        return "\n".join(lines)
    head = " ".join(f"{h:<{w}}" if i < 2 else f"{h:>{w}}" for i, (_, h, _, w) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(f"{_fmt(f, r.get(k)):<{w}}" if i < 2 else f"{_fmt(f, r.get(k)):>{w}}"
                              for i, (k, _, f, w) in enumerate(COLUMNS)))
    return "\n".join(lines)


def headline(report: dict) -> list[dict]:
    """One line per workload: the ratios people decide on."""
    out = []
    for w in report["workloads"]:
        rows = {(r["mode"], r["system"].split(" (")[0]): r for r in w["rows"]}
        ref = rows.get(("offline", REF))
        if ref is None:
            continue

        def speed(key: tuple[str, str], base: Optional[dict] = ref) -> Optional[float]:
            r = rows.get(key)
            return r["wall_s"] / base["wall_s"] if r and base else None

        on, off = rows.get(("online", REF)), rows.get(("online", OFF))
        out.append({
            "workload": w["name"],
            "vs_transformers": speed(("offline", HF_LABEL)),
            "vs_cache_off": speed(("offline", OFF)),
            "fcfs_time": speed(("offline", f"{REF} fcfs")),
            "dfs_weight_time": speed(("offline", f"{REF} dfs-weight")),
            "hit_rate": ref["cache_hit_rate"],
            "computed_vs_ideal": ref.get("computed_vs_ideal"),
            "cache_off_computed_vs_ideal": (rows.get(("offline", OFF)) or {}).get("computed_vs_ideal"),
            "online_ttft_p50_off_over_on": (off["p50_ttft_ms"] / on["p50_ttft_ms"]
                                            if on and off and on.get("p50_ttft_ms") else None),
            "online_throughput_on_over_off": (on["output_throughput"] / off["output_throughput"]
                                              if on and off and off.get("output_throughput") else None),
        })
    return out


HEADLINE_COLUMNS = [
    ("workload", "workload", "{}"),
    ("vs_transformers", "speedup vs transformers", "{:.2f}x"),
    ("vs_cache_off", "speedup vs cache off", "{:.2f}x"),
    ("hit_rate", "cache hit (tokens)", "{:.1%}"),
    ("computed_vs_ideal", "computed / ideal", "{:.2f}"),
    ("cache_off_computed_vs_ideal", "cache off: computed / ideal", "{:.2f}"),
    ("fcfs_time", "fcfs time / lpm", "{:.2f}"),
    ("dfs_weight_time", "dfs-weight time / lpm", "{:.2f}"),
    ("online_ttft_p50_off_over_on", "online TTFT p50 off/on", "{:.2f}x"),
    ("online_throughput_on_over_off", "online tok/s on/off", "{:.2f}x"),
]


def format_headline(lines: list[dict], markdown: bool = False) -> str:
    cols = [c for c in HEADLINE_COLUMNS if any(line.get(c[0]) is not None for line in lines)]
    cells = [[_fmt(f, line.get(k)) for k, _, f in cols] for line in lines]
    if markdown:
        out = ["| " + " | ".join(h for _, h, _ in cols) + " |",
               "|" + "|".join("---" if k == "workload" else "---:" for k, *_ in cols) + "|"]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
    out = ["  ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, ((_, h, _), w) in enumerate(zip(cols, widths)))]
    out += ["  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(row, widths)))
            for row in cells]
    return "\n".join(out)


SWEEP_COLUMNS = [("x", "", "{}"), ("system", "system", "{}"), ("wall_s", "wall s", "{:.2f}"),
                 ("time_ratio", "x radixrt", "{:.2f}"), ("output_throughput", "out tok/s", "{:.1f}"),
                 ("prompt_tokens_computed", "computed", "{:.0f}"), ("ideal_prompt_tokens", "ideal", "{:.0f}"),
                 ("peak_kv_slots", "peak KV", "{:.0f}"), ("p50_ttft_ms", "TTFT p50", "{:.0f}"),
                 ("retractions", "retr", "{:.0f}")]


def format_sweep(sweep: dict, markdown: bool = False) -> str:
    xname = sweep["x"]
    heads = [xname if k == "x" else h for k, h, _ in SWEEP_COLUMNS]
    rows = [[_fmt(f, r.get(k)) for k, _, f in SWEEP_COLUMNS] for r in sweep["rows"]]
    if markdown:
        out = ["| " + " | ".join(heads) + " |", "|" + "|".join("---:" if i != 1 else "---"
                                                             for i in range(len(heads))) + "|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    out = ["  ".join(f"{h:>{w}}" if i != 1 else f"{h:<{w}}" for i, (h, w) in enumerate(zip(heads, widths)))]
    out += ["  ".join(f"{c:>{w}}" if i != 1 else f"{c:<{w}}" for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------- the run
def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--workload", action="append", choices=[*WORKLOADS, "all", "none"],
                   help="repeatable; default all (none: only the sweeps)")
    p.add_argument("--repeats", type=int, default=1, help="offline runs per system; the median is reported")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the number of requests / programs")
    p.add_argument("--policies", default="lpm,fcfs,dfs-weight",
                   help="schedule policies to compare offline (lpm is the reference row)")
    p.add_argument("--skip-cache-off", action="store_true", help="no radix-cache-off baseline")
    p.add_argument("--skip-transformers", action="store_true", help="no transformers generate baseline")
    p.add_argument("--hf-batch-size", type=int, default=8)
    online = p.add_mutually_exclusive_group()
    online.add_argument("--offline-only", "--no-online", dest="online", action="store_false", default=True,
                        help="skip the HTTP server runs")
    p.add_argument("--request-rate", default="auto",
                   help="online program arrivals per second, or auto (--load x the offline program rate)")
    p.add_argument("--load", type=float, default=0.8, help="for --request-rate auto")
    p.add_argument("--timeout", type=float, default=1800.0, help="online per-request timeout (s)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool size in tokens")
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--sweep", action="append", choices=["prefix", "concurrency"], default=[],
                   help="also measure cost growth with the shared prefix length / with concurrency")
    p.add_argument("--prefix-lens", default="256,512,1024,2048,4096")
    p.add_argument("--sweep-requests", type=int, default=4, help="prefix sweep: requests sharing the prefix")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    p.add_argument("--concurrency-prefix", type=int, default=128, help="concurrency sweep: shared prefix tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false", default=True)
    p.add_argument("--json-out", default=None, help="write every row as JSON here")
    p.add_argument("--markdown-out", default=None, help="write the tables as Markdown here")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here (needs matplotlib: pip install "
                                                    "'radixrt[bench]')")
    p.add_argument("--log-level", default="warning")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class _Systems:
    """The offline systems, created once and kept for the whole run."""

    def __init__(self, args: argparse.Namespace) -> None:
        from radixrt.engine import Engine

        common = dict(page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                      chunked_prefill_size=args.chunked_prefill_size, log_level=args.log_level)
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


def bench_workload_offline(systems: _Systems, wl: Workload, args: argparse.Namespace) -> tuple[list[dict], list]:
    rows, ref_records = [], None
    for label, engine in systems.engines.items():
        row, records = run_offline(engine, wl, label, args)
        rows.append(row)
        if label == REF:
            ref_records = records
    if systems.hf is not None and ref_records is not None:
        rows.append(run_hf(systems.hf, wl, ref_records, args))
    return rows, ref_records


def run_online(workloads: list[Workload], rows_by_wl: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """Both servers up at once; each workload runs on one, then on the other."""
    from radixrt.server.local import LocalServer

    flags = ["--max-total-tokens", str(args.max_total_tokens), "--chunked-prefill-size",
             str(args.chunked_prefill_size), "--page-size", str(args.page_size), "--schedule-policy", "lpm"]
    configs = [(REF, [])] + ([] if args.skip_cache_off else [(OFF, ["--disable-radix-cache"])])
    servers = []
    try:
        for label, extra in configs:
            servers.append((label, LocalServer(*flags, *extra, model=args.model)))
        for label, srv in servers:
            t0 = time.perf_counter()
            srv.wait_ready()
            _warm_server(srv.url)
            print(f"[online] {label} server ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for wl in workloads:
            rate = _rate(wl, rows_by_wl[wl.name], args)
            for label, srv in servers:
                row, _ = asyncio.run(_online(srv.url, wl, rate, args, label))
                rows_by_wl[wl.name].append(row)
    finally:
        for label, srv in servers:
            code = srv.stop()
            if code not in (0, None, -15):
                print(f"[online] {label} server exited with {code}:\n{srv.log_tail()}", file=sys.stderr)
            srv.cleanup()


def _rate(wl: Workload, rows: list[dict], args: argparse.Namespace) -> float:
    if args.request_rate != "auto":
        return float(args.request_rate)
    ref = next((r for r in rows if r["system"] == REF and r["mode"] == "offline"), None)
    if ref is None:
        return math.inf
    return args.load * len(wl.programs) / ref["wall_s"]


def run_sweep(kind: str, systems: _Systems, args: argparse.Namespace) -> dict:
    """Offline cost growth: shared prefix length, or concurrency (requests at once)."""
    rows = []
    if kind == "prefix":
        xs, xname = _ints(args.prefix_lens), "shared prefix tokens"
        make = lambda x: shared_prefix(systems.tokens, requests=args.sweep_requests, prefix=x, unique=16,
                                       output=8, seed=args.seed + x, scale_requests=False)
    else:
        xs, xname = _ints(args.concurrency), "concurrent requests"
        make = lambda x: shared_prefix(systems.tokens, requests=x, prefix=args.concurrency_prefix, unique=16,
                                       output=16, seed=args.seed + x, scale_requests=False)
    for x in xs:
        wl = make(x)
        print(f"\n== sweep {kind}: {xname} = {x} ({wl.shape})", file=sys.stderr)
        point = []
        for label in (REF, OFF):
            if label in systems.engines:
                row, records = run_offline(systems.engines[label], wl, label, args)
                point.append(row)
                if label == REF:
                    ref_records = records
        if systems.hf is not None:
            point.append(run_hf(systems.hf, wl, ref_records, args,
                                batch_size=x if kind == "concurrency" else None))
        add_ratios(point)
        rows += [{**r, "x": x} for r in point]
    return {"kind": kind, "x": xname, "rows": rows,
            "params": {"requests": args.sweep_requests, "concurrency_prefix": args.concurrency_prefix},
            "context": {"model": systems.model_path, "args": {"max_total_tokens": args.max_total_tokens}}}


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "res"} for r in rows]


def bench_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    names = args.workload or ["all"]
    if "none" in names:
        names = []
    elif "all" in names:
        names = list(WORKLOADS)
    started = time.perf_counter()
    systems = _Systems(args)
    import torch

    report: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "model": systems.model_path, "torch_threads": torch.get_num_threads(),
        "workloads": [], "sweeps": [],
    }
    workloads = [make_workload(n, systems.tokens, args.scale, args.seed) for n in names]
    rows_by_wl: dict[str, list[dict]] = {}
    try:
        for wl in workloads:
            print(f"\n== {wl.name}: {wl.shape}", file=sys.stderr)
            rows_by_wl[wl.name], _ = bench_workload_offline(systems, wl, args)
        for kind in args.sweep:
            report["sweeps"].append(run_sweep(kind, systems, args))
    finally:
        systems.shutdown()
    if args.online and workloads:
        run_online(workloads, rows_by_wl, args)
    for wl in workloads:
        rows = rows_by_wl[wl.name]
        add_ratios(rows)
        report["workloads"].append({"name": wl.name, "shape": wl.shape, "params": wl.params,
                                    "rows": _strip(rows)})
    report["elapsed_s"] = time.perf_counter() - started

    print(render(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    if args.markdown_out:
        with open(args.markdown_out, "w") as f:
            f.write(render(report, markdown=True) + "\n")
    if args.plot_dir:
        from radixrt.bench.plots import plot_report

        for path in plot_report(report, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    failed = sum(r.get("failed", 0) for w in report["workloads"] for r in w["rows"])
    return 1 if failed else 0


def render(report: dict, markdown: bool = False) -> str:
    parts = [f"radixrt bench: model {report['model']}, torch threads {report['torch_threads']}, "
             f"scale {report['args']['scale']}, KV pool {report['args']['max_total_tokens']} tokens"]
    for w in report["workloads"]:
        title = f"{w['name']}: {w['shape']}"
        parts.append(f"\n### {title}\n" if markdown else f"\n== {title}")
        parts.append(format_table(w["rows"], markdown))
        valid = [(r["system"], r["mode"], r["valid_outputs"], r["completed"]) for r in w["rows"]
                 if "valid_outputs" in r]
        if valid:
            parts.append("valid outputs: " + ", ".join(f"{s} ({m}) {v}/{n}" for s, m, v, n in valid))
    if report["workloads"]:
        parts.append("\n### Headline ratios\n" if markdown else "\n== headline (offline unless marked online)")
        parts.append(format_headline(headline(report), markdown))
    for s in report["sweeps"]:
        parts.append(f"\n### Sweep: {s['x']}\n" if markdown else f"\n== sweep: {s['x']}")
        parts.append(format_sweep(s, markdown))
    return "\n".join(parts)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixrt.bench.main", description=__doc__.split("\n\n")[0])
    add_bench_args(p)
    return bench_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
