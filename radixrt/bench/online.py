"""The online half of ``radixrt bench``: a radixrt server with the radix cache
on and one with it off (both :class:`radixrt.server.local.LocalServer`
processes, up at once), each workload's programs arriving as a Poisson process
and every request streamed through the native ``/generate`` route.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time

from radixrt.bench.common import native_stream, server_counters, server_kv_peak
from radixrt.bench.driver import OFF, REF, WARMUP_SAMPLING, drive, progress_bar, summarize
from radixrt.bench.workloads import Workload


async def _online(url: str, wl: Workload, rate: float, args: argparse.Namespace, label: str) -> tuple[dict, list]:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        (await client.post("/flush_cache")).raise_for_status()
        before = await server_counters(client)
        stop = asyncio.Event()
        peak_task = asyncio.create_task(server_kv_peak(client, stop))
        bar = progress_bar(wl.num_requests, f"{wl.name} | {label} (online)", args.progress)
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


def run_online(workloads: list[Workload], rows_by_wl: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """Both servers up at once; each workload runs on one, then on the other."""
    from radixrt.server.local import LocalServer

    flags = [
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--chunked-prefill-size",
        str(args.chunked_prefill_size),
        "--page-size",
        str(args.page_size),
        "--schedule-policy",
        "lpm",
    ]
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
