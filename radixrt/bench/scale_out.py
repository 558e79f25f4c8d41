"""``radixrt bench --scale-out``: data parallel routing on a multi-tenant
workload (``python -m radixrt.bench.scale_out --help`` for the options).

The workload: ``--tenants`` system prompts of ``--system-len`` tokens, and
``--requests`` requests, each one user's question (``--question-len`` fresh
random tokens) after a tenant's system prompt drawn at random, arriving as a
Poisson process at ``--rate`` per second, ``--max-new-tokens`` greedy tokens
each. Every request goes through the native ``/generate`` route (streamed).

The systems, measured in one run on the same machine:

* ``1 replica, 2x KV``: one server with a pool of 2 x ``--kv-tokens``;
* ``dp2 <policy>``: two servers with ``--kv-tokens`` each behind a
  `radixrt router` process with that policy (round_robin, shortest_queue,
  cache_aware), the same two servers for every policy (caches flushed
  through the router before each run).

Per system: cache hit rate (cached prompt tokens / prompt tokens, from the
answers), request throughput, mean and p90 TTFT, the share of requests
each replica got, and the hit rate of an unlimited prefix cache on one
replica (the ideal). The servers run a tiny random-weight Llama unless
``--model`` names one (the embedded model: ``--model default``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

from radixrt.bench.common import arrivals, ideal_prompt_tokens, native_stream, pct

POLICIES = ("round_robin", "shortest_queue", "cache_aware")


@dataclass
class Request:
    tenant: int
    input_ids: list[int]


def make_requests(
    tenants: int, system_len: int, question_len: int, requests: int, seed: int, vocab: int = 49152
) -> list[Request]:
    """The multi-tenant workload (token ids drawn from [1000, vocab))."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, vocab) for _ in range(system_len)] for _ in range(tenants)]
    out = []
    for _ in range(requests):
        t = rng.randrange(tenants)
        out.append(Request(t, systems[t] + [rng.randrange(1000, vocab) for _ in range(question_len)]))
    return out


async def _run(url: str, reqs: list[Request], rate: float, max_new_tokens: int, seed: int, timeout: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    offsets = arrivals(random.Random(seed + 1), len(reqs), rate)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        r = await client.post("/flush_cache")
        r.raise_for_status()
        before = _evicted((await client.get("/get_server_info")).json())
        t0 = time.perf_counter()

        async def one(req: Request, at: float) -> Any:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            payload = {
                "input_ids": req.input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            }
            return await native_stream(client, payload)

        results = await asyncio.gather(*(one(q, at) for q, at in zip(reqs, offsets)))
        wall = time.perf_counter() - t0
        info = (await client.get("/get_server_info")).json()
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    router = info.get("router") or {}
    share = {w["url"]: w["routed"] for w in router.get("workers", [])}
    return {
        "requests": len(reqs),
        "ok": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "hit_rate": cached / prompt if prompt else 0.0,
        "req_per_s": len(ok) / wall if wall else 0.0,
        "wall_s": wall,
        "mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "p90_ttft_ms": 1000 * pct(ttfts, 0.9),
        "routed": share,
        "evicted_tokens": _evicted(info) - before,
    }


def _evicted(info: dict) -> int:
    """Tokens the radix caches behind ``info`` (every replica's) evicted since start."""
    return sum(s.get("cache", {}).get("evicted_tokens", 0) for s in info.get("internal_states", []))


class _RouterProc:
    def __init__(self, urls: list[str], policy: str) -> None:
        from radixrt.server.local import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "radixrt.cli", "router", "--policy", policy, "--port", self.url.rsplit(":", 1)[1]]
        for u in urls:
            cmd += ["--worker-url", u]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 60.0) -> "_RouterProc":
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("router not ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def _model(args: argparse.Namespace, tmp: str) -> str:
    if args.model:
        return str(args.model)
    from radixrt.bench.tiny_model import make_tiny_model

    return make_tiny_model(tmp, "llama", max_position_embeddings=8192)


def run(args: argparse.Namespace) -> dict:
    from radixrt.server.local import LocalServer

    reqs = make_requests(args.tenants, args.system_len, args.question_len, args.requests, args.seed)
    total_prompt = sum(len(r.input_ids) for r in reqs)
    ideal = 1.0 - ideal_prompt_tokens((r.input_ids, []) for r in reqs) / total_prompt
    rows: list[dict] = []
    common = ["--chunked-prefill-size", str(args.chunked_prefill_size), "--log-level", "warning"]
    with tempfile.TemporaryDirectory(prefix="radixrt-scale-out-") as tmp:
        model = _model(args, tmp)
        single = LocalServer("--max-total-tokens", str(2 * args.kv_tokens), *common, model=model)
        pair = [LocalServer("--max-total-tokens", str(args.kv_tokens), *common, model=model) for _ in range(2)]
        servers = [single, *pair]
        try:
            for s in servers:
                s.wait_ready()
            for s in servers:  # warm-up: the first requests of a server pay one-time costs
                asyncio.run(_run(s.url, reqs[:2], math.inf, 1, args.seed, args.timeout))
            systems: list[tuple[str, Optional[str]]] = [("1 replica, 2x KV", None)]
            systems += [(f"dp2 {p}", p) for p in args.policies]
            for label, policy in systems:
                router = _RouterProc([s.url for s in pair], policy).wait_ready() if policy else None
                try:
                    url = router.url if router else single.url
                    row = asyncio.run(_run(url, reqs, args.rate, args.max_new_tokens, args.seed, args.timeout))
                finally:
                    if router is not None:
                        router.stop()
                row["system"] = label
                rows.append(row)
                print(
                    f"{label:>22}: hit rate {row['hit_rate']:.3f}, {row['req_per_s']:.2f} req/s, "
                    f"{row['ok']}/{row['requests']} ok",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            for s in servers:
                s.cleanup()
    return {
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "func")},
        "ideal_hit_rate": ideal,
        "rows": rows,
    }


def render(report: dict) -> str:
    p = report["params"]
    lines = [
        f"scale-out: {p['tenants']} tenants x {p['system_len']}-token system prompts, {p['requests']} requests "
        f"(+{p['question_len']} tokens -> {p['max_new_tokens']}), Poisson {p['rate']}/s; "
        f"dp2: {p['kv_tokens']} KV tokens per replica; ideal hit rate {report['ideal_hit_rate']:.3f}",
        "",
        "| system | hit rate | vs 1 replica | req/s | mean TTFT ms | p90 TTFT ms | evicted tokens | ok | routed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = report["rows"][0]["hit_rate"] if report["rows"] else 0.0
    for r in report["rows"]:
        routed = "/".join(str(v) for v in r["routed"].values()) or "-"
        lines.append(
            f"| {r['system']} | {r['hit_rate']:.3f} | {100 * (r['hit_rate'] - base):+.1f} pt | "
            f"{r['req_per_s']:.2f} | {r['mean_ttft_ms']:.0f} | {r['p90_ttft_ms']:.0f} | "
            f"{r['evicted_tokens']} | {r['ok']}/{r['requests']} | {routed} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radixrt.bench.scale_out",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="a model folder or 'default' (default: a tiny random Llama)")
    p.add_argument("--tenants", type=int, default=16, help="system prompts")
    p.add_argument("--system-len", type=int, default=256, help="tokens per system prompt")
    p.add_argument("--question-len", type=int, default=16, help="fresh tokens per request")
    p.add_argument("--requests", type=int, default=320, help="requests in a run")
    p.add_argument("--rate", type=float, default=16.0, help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-new-tokens", type=int, default=4, help="tokens generated per request")
    p.add_argument(
        "--kv-tokens", type=int, default=3072, help="KV pool per dp2 replica (the single replica gets twice this)"
    )
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="servers' prefill chunk")
    p.add_argument(
        "--policies",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(POLICIES),
        help="routing policies to run, comma-separated",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--json", default=None, help="write the report here")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [x for x in args.policies if x not in POLICIES]
    if bad:
        raise SystemExit(f"unknown policies: {bad} (choose from {', '.join(POLICIES)})")
    report = run(args)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
