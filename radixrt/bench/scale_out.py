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
  through the router before each run);
* with ``--kv-events``: ``dp2 cache_aware + KV events``, the same router
  following the servers' KV cache events (``--kv-events-endpoint``) instead
  of its approximate tree, beside the tree's row;
* with ``--routers N``: N router processes of each policy in front of the
  pair, the requests dealt out among them in turn (as behind a load
  balancer): each router's approximate tree sees only its own share, while
  the events show every router what the servers hold.

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

from radixrt.bench.common import arrivals, ideal_prompt_tokens, native_stream, pct, report_out

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


async def _run(
    urls: list[str], reqs: list[Request], rate: float, max_new_tokens: int, seed: int, timeout: float
) -> dict:
    """Send ``reqs`` through ``urls`` (one server or router, or several routers
    in front of the same servers: request i goes to ``urls[i % len(urls)]``)."""
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    offsets = arrivals(random.Random(seed + 1), len(reqs), rate)
    clients = [httpx.AsyncClient(base_url=u, timeout=timeout, limits=limits) for u in urls]
    try:
        for c in clients:  # every router's trees are reset, and the servers' caches flushed
            (await c.post("/flush_cache")).raise_for_status()
        before = _evicted((await clients[0].get("/get_server_info")).json())
        t0 = time.perf_counter()

        async def one(i: int, req: Request, at: float) -> Any:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            payload = {
                "input_ids": req.input_ids,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            }
            return await native_stream(clients[i % len(clients)], payload)

        results = await asyncio.gather(*(one(i, q, at) for i, (q, at) in enumerate(zip(reqs, offsets))))
        wall = time.perf_counter() - t0
        infos = [(await c.get("/get_server_info")).json() for c in clients]
    finally:
        for c in clients:
            await c.aclose()
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    share: dict[str, int] = {}
    sources: dict[str, int] = {}
    decisions: dict[str, int] = {}
    for info in infos:
        router = info.get("router") or {}
        for w in router.get("workers", []):
            share[w["url"]] = share.get(w["url"], 0) + w["routed"]
        for field_name, total in (("sources", sources), ("decisions", decisions)):
            for k, v in router.get("policy_stats", {}).get(field_name, {}).items():
                total[k] = total.get(k, 0) + v
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
        "sources": sources,
        "decisions": decisions,
        "evicted_tokens": _evicted(infos[0]) - before,
    }


def _evicted(info: dict) -> int:
    """Tokens the radix caches behind ``info`` (every replica's) evicted since start."""
    return sum(s.get("cache", {}).get("evicted_tokens", 0) for s in info.get("internal_states", []))


class _RouterProc:
    """A `radixrt router` process in front of ``urls``; ``events``: the
    servers' KV-event endpoints (the router follows them), in ``urls`` order."""

    def __init__(self, urls: list[str], policy: str, events: Optional[list[str]] = None) -> None:
        from radixrt.server.local import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        self.events = events
        cmd = [sys.executable, "-m", "radixrt.cli", "router", "--policy", policy, "--port", self.url.rsplit(":", 1)[1]]
        for i, u in enumerate(urls):
            cmd += ["--worker-url", u]
            if events:
                cmd += ["--kv-events-endpoint", f"{u}={events[i]}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 60.0) -> "_RouterProc":
        """Healthy; with events, also live on every worker (a flush makes them so)."""
        import httpx

        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5) as client:  # one SSL context for all polls, not one per poll
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"router exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
                try:
                    if client.get(self.url + "/health").status_code == 200 and self._live(client):
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError("router not ready")

    def _live(self, client: Any) -> bool:
        if not self.events:
            return True
        stats = client.get(self.url + "/list_workers").json()["policy_stats"].get("kv_events", {})
        if len(stats) == len(self.events) and all(s["live"] for s in stats.values()):
            return True
        client.post(self.url + "/flush_cache", timeout=30)
        return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def _systems(args: argparse.Namespace) -> list[tuple[str, Optional[str], bool]]:
    """(label, policy or None for the single replica, on KV events) per system."""
    n = f" x{args.routers} routers" if args.routers > 1 else ""
    out: list[tuple[str, Optional[str], bool]] = [("1 replica, 2x KV", None, False)]
    for p in args.policies:
        out.append((f"dp2 {p}{n}", p, False))
        if p == "cache_aware" and args.kv_events:
            out.append((f"dp2 cache_aware + KV events{n}", p, True))
    return out


def _model(args: argparse.Namespace, tmp: str) -> str:
    if args.model:
        return str(args.model)
    from radixrt.bench.tiny_model import make_tiny_model

    return make_tiny_model(tmp, "llama", max_position_embeddings=8192)


def _events_flag(port: int) -> list[str]:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    return ["--kv-events-config", json.dumps(cfg)]


def run(args: argparse.Namespace) -> dict:
    from radixrt.server.local import LocalServer, free_port

    reqs = make_requests(args.tenants, args.system_len, args.question_len, args.requests, args.seed)
    total_prompt = sum(len(r.input_ids) for r in reqs)
    ideal = 1.0 - ideal_prompt_tokens((r.input_ids, []) for r in reqs) / total_prompt
    rows: list[dict] = []
    common = ["--chunked-prefill-size", str(args.chunked_prefill_size), "--log-level", "warning"]
    events = [free_port(), free_port()] if args.kv_events else []
    endpoints = [f"tcp://127.0.0.1:{p}" for p in events]
    with tempfile.TemporaryDirectory(prefix="radixrt-scale-out-") as tmp:
        model = _model(args, tmp)
        single = LocalServer("--max-total-tokens", str(2 * args.kv_tokens), *common, model=model)
        pair = [
            LocalServer(
                "--max-total-tokens", str(args.kv_tokens), *common, *(_events_flag(e) if e else []), model=model
            )
            for e in (events or [0, 0])
        ]
        servers = [single, *pair]
        try:
            for s in servers:
                s.wait_ready()
            for s in servers:  # warm-up: the first requests of a server pay one-time costs
                asyncio.run(_run([s.url], reqs[:2], math.inf, 1, args.seed, args.timeout))
            for label, policy, on_events in _systems(args):
                n = args.routers if policy else 0
                routers = [
                    _RouterProc([s.url for s in pair], policy or "", endpoints if on_events else None) for _ in range(n)
                ]
                try:
                    urls = [r.wait_ready().url for r in routers] or [single.url]
                    row = asyncio.run(_run(urls, reqs, args.rate, args.max_new_tokens, args.seed, args.timeout))
                finally:
                    for r in routers:
                        r.stop()
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
    for r in report["rows"]:
        src = r.get("sources") or {}
        if src.get("events"):
            tree = src.get("approx_tree", 0) + src.get("no_events", 0)
            lines.append(
                f"\n{r['system']}: {src['events']} routing decisions on the KV events, {tree} on the "
                f"approximate tree ({src.get('no_events', 0)} of them with the events not live)"
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
    p.add_argument(
        "--kv-events",
        action="store_true",
        help="the dp2 servers publish KV events, and cache_aware runs twice: on its approximate tree and "
        "on the events (radixrt router --kv-events-endpoint)",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router processes in front of the dp2 servers, requests dealt out in turn (each router's tree "
        "sees only its share; the events show every router all of it)",
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
    if args.routers < 1:
        raise SystemExit("--routers must be >= 1")
    report = run(args)
    return report_out(report, render(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
