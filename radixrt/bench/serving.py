"""Serving benchmark: radixrt's HTTP server under Poisson arrivals, radix cache
on against off, in one run.

    python -m radixrt.bench.serving                       # both workloads, cache on vs off
    python -m radixrt.bench.serving --workload shared-prefix --request-rate 8 --num-prompts 64
    python -m radixrt.bench.serving --base-url http://127.0.0.1:30000 --no-compare   # an existing server

Workloads:

* ``shared-prefix``: ``--num-groups`` long system prompts (``--prefix-len``
  words each); every request is one of them plus a unique question
  (``--suffix-len`` words), streamed through the native ``/generate`` route
  with ``--output-len`` tokens (``ignore_eos``, so every request generates
  the same amount with the cache on or off).
* ``multi-turn``: ``--num-users`` chat users, each holding a ``--turns``-turn
  conversation over ``/v1/chat/completions`` (streaming); a user's next turn
  is sent when the previous answer arrives, so every turn re-sends the whole
  history -- the prefix the radix cache keeps.

Users (or requests) arrive as a Poisson process at ``--request-rate`` per
second (``inf``: all at once). Reported per run: request and token
throughput, time to first token (TTFT) and inter-token latency (ITL)
percentiles, end-to-end latency, and the cache hit rate (prompt tokens served
from the radix cache / prompt tokens), from the responses and from the
server's own counters. Each configuration gets a fresh server (the same
flags but ``--disable-radix-cache``), warmed up by one request and flushed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from typing import Any, Optional

from radixrt.bench.common import WORDS, ReqResult, chat_stream, latency_stats, native_stream, server_counters
from radixrt.bench.common import arrivals as _arrivals
from radixrt.bench.common import words as _words


# ---------------------------------------------------------------------- workloads
async def run_shared_prefix(client: Any, args: argparse.Namespace) -> list[ReqResult]:
    rng = random.Random(args.seed)
    prefixes = [f"System prompt {g}. " + _words(rng, args.prefix_len) for g in range(args.num_groups)]
    payloads = []
    for i in range(args.num_prompts):
        text = prefixes[i % args.num_groups] + f"\nQuestion {i}: " + _words(rng, args.suffix_len) + "?\nAnswer:"
        payloads.append(
            {"text": text, "sampling_params": {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}}
        )
    order = list(range(len(payloads)))
    rng.shuffle(order)
    starts = _arrivals(rng, len(order), args.request_rate)
    t0 = time.perf_counter()

    async def one(i: int, at: float) -> ReqResult:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        return await native_stream(client, payloads[i])

    return list(await asyncio.gather(*(one(i, at) for i, at in zip(order, starts))))


async def run_multi_turn(client: Any, args: argparse.Namespace, model: str) -> list[ReqResult]:
    rng = random.Random(args.seed + 1)
    system = "You are a helpful assistant for a travel agency. " + _words(rng, args.system_len)
    starts = _arrivals(rng, args.num_users, args.request_rate)
    questions = [
        [f"Turn {t}: " + _words(rng, args.suffix_len) + "?" for t in range(args.turns)] for _ in range(args.num_users)
    ]
    t0 = time.perf_counter()

    async def user(u: int, at: float) -> list[ReqResult]:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        history = [{"role": "system", "content": system}]
        results = []
        for q in questions[u]:
            history.append({"role": "user", "content": q})
            res = await chat_stream(client, model, history, args.output_len)
            results.append(res)
            if not res.ok:
                break
            history.append({"role": "assistant", "content": res.text})
        return results

    per_user = await asyncio.gather(*(user(u, at) for u, at in enumerate(starts)))
    return [r for rs in per_user for r in rs]


# ---------------------------------------------------------------------- reporting
def summarize(results: list[ReqResult], duration: float, server_delta: dict) -> dict:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out / duration if duration else 0.0,
        "total_token_throughput": (prompt + out) / duration if duration else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": out,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "server_hit_rate": server_delta.get("hit_rate"),
        "prompt_tokens_computed": server_delta.get("prompt_tokens_computed"),
        **latency_stats(ok),
    }


ROWS = [
    ("completed", "completed requests", "{:.0f}"),
    ("failed", "failed requests", "{:.0f}"),
    ("duration_s", "duration (s)", "{:.2f}"),
    ("request_throughput", "request throughput (req/s)", "{:.3f}"),
    ("output_throughput", "output throughput (tok/s)", "{:.2f}"),
    ("total_token_throughput", "total token throughput (tok/s)", "{:.1f}"),
    ("prompt_tokens", "prompt tokens", "{:.0f}"),
    ("prompt_tokens_computed", "prompt tokens computed (server)", "{:.0f}"),
    ("cache_hit_rate", "cache hit rate (cached/prompt)", "{:.1%}"),
    ("server_hit_rate", "radix tree hit rate (server)", "{:.1%}"),
    ("mean_ttft_ms", "mean TTFT (ms)", "{:.1f}"),
    ("p50_ttft_ms", "p50 TTFT (ms)", "{:.1f}"),
    ("p90_ttft_ms", "p90 TTFT (ms)", "{:.1f}"),
    ("p99_ttft_ms", "p99 TTFT (ms)", "{:.1f}"),
    ("mean_itl_ms", "mean ITL (ms)", "{:.1f}"),
    ("p50_itl_ms", "p50 ITL (ms)", "{:.1f}"),
    ("p90_itl_ms", "p90 ITL (ms)", "{:.1f}"),
    ("p99_itl_ms", "p99 ITL (ms)", "{:.1f}"),
    ("mean_e2e_ms", "mean end-to-end latency (ms)", "{:.1f}"),
    ("p99_e2e_ms", "p99 end-to-end latency (ms)", "{:.1f}"),
]


def _fmt(fmt: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def print_table(workload: str, runs: dict[str, dict]) -> None:
    names = list(runs)
    print(f"\n=== {workload} ===")
    head = f"{'':34s}" + "".join(f"{n:>18s}" for n in names)
    if len(names) == 2:
        head += f"{'ratio':>10s}"
    print(head)
    for key, label, fmt in ROWS:
        vals = [runs[n].get(key) for n in names]
        line = f"{label:34s}" + "".join(f"{_fmt(fmt, v):>18s}" for v in vals)
        if len(names) == 2 and all(isinstance(v, (int, float)) and v for v in vals) and "rate" not in key:
            line += f"{vals[0] / vals[1]:>9.2f}x"
        print(line)
    for n in names:
        if runs[n].get("errors"):
            print(f"  {n} errors: {runs[n]['errors']}")


# ---------------------------------------------------------------------- driver
_server_counters = server_counters


def _delta(before: dict, after: dict) -> dict:
    q = after["queried_tokens"] - before["queried_tokens"]
    return {
        "hit_rate": (after["hit_tokens"] - before["hit_tokens"]) / q if q else None,
        "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
    }


async def bench_server(base_url: str, api_key: Optional[str], args: argparse.Namespace) -> dict[str, dict]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    out: dict[str, dict] = {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # warm up (first-call costs), then start from an empty cache
        await native_stream(
            client,
            {"text": "Warm up " + " ".join(WORDS[:40]), "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        )
        await client.post("/flush_cache")
        for workload in args.workloads:
            before = await _server_counters(client)
            t0 = time.perf_counter()
            if workload == "shared-prefix":
                results = await run_shared_prefix(client, args)
            else:
                results = await run_multi_turn(client, args, model)
            duration = time.perf_counter() - t0
            after = await _server_counters(client)
            out[workload] = summarize(results, duration, _delta(before, after))
            await client.post("/flush_cache")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m radixrt.bench.serving",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", choices=["shared-prefix", "multi-turn", "all"], default="all")
    p.add_argument("--request-rate", type=float, default=4.0, help="arrivals per second (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=32, help="shared-prefix: requests")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=400, help="shared-prefix: words in each shared prefix")
    p.add_argument("--suffix-len", type=int, default=24, help="words in each unique question / user turn")
    p.add_argument("--output-len", type=int, default=16, help="output tokens per request (ignore_eos)")
    p.add_argument("--num-users", type=int, default=8, help="multi-turn: users")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per user")
    p.add_argument("--system-len", type=int, default=200, help="multi-turn: words in the system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--base-url", default=None, help="benchmark this running server instead of launching one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default="default", help="model for the launched servers")
    p.add_argument("--no-compare", action="store_true", help="only radix cache on (no --disable-radix-cache run)")
    p.add_argument(
        "--server-args", default="--max-total-tokens 32768", help="extra flags for the launched servers (one string)"
    )
    p.add_argument("--output-json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    args.workloads = ["shared-prefix", "multi-turn"] if args.workload == "all" else [args.workload]

    print(
        f"radixrt.bench.serving: workloads {args.workloads}, request rate {args.request_rate}/s, "
        f"output {args.output_len} tokens",
        flush=True,
    )
    runs: dict[str, dict[str, dict]] = {}
    if args.base_url:
        runs["server"] = asyncio.run(bench_server(args.base_url, args.api_key, args))
    else:
        import shlex

        from radixrt.server.local import LocalServer

        configs = [("radix cache on", [])]
        if not args.no_compare:
            configs.append(("radix cache off", ["--disable-radix-cache"]))
        for name, flags in configs:
            srv = LocalServer(*shlex.split(args.server_args), *flags, model=args.model)
            try:
                t0 = time.perf_counter()
                srv.wait_ready()
                print(f"[{name}] server ready in {time.perf_counter() - t0:.1f} s", flush=True)
                runs[name] = asyncio.run(bench_server(srv.url, None, args))
            finally:
                code = srv.stop()
                if code not in (0, None):
                    print(f"[{name}] server exited with {code}:\n{srv.log_tail()}", file=sys.stderr)
                srv.cleanup()
    for workload in args.workloads:
        print_table(workload, {name: r[workload] for name, r in runs.items()})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "runs": runs}, f, indent=2, default=str)
    failed = sum(r[w]["failed"] for r in runs.values() for w in args.workloads)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
