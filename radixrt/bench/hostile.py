"""What one hostile request costs everyone else, through a real server.

    python -m radixrt.bench.hostile [--model default] [--probes 5] [--only NAME] [--server-arg=--FLAG=V ...]

Starts `radixrt serve` on the model, measures a 4-token greedy /generate
(the *probe*) alone, then sends each hostile request below once and probes
while it is in flight. For each it prints the hostile request's status and
seconds, the probes' worst and median latency against the idle median, the
worst /health latency, and the growth of the largest server process's
resident memory. Requests that the server refuses (a 4xx) show how fast the
refusal is; the ones it serves show what they cost the others. A request
not answered within 300 s shows as ``t/o`` (and its seconds as a lower
bound); the run goes on.

The hostile requests are the ones of issue #22 and their neighbours: a JSON
schema with no finite instance, a regex bomb, the largest forced string the
default grammar limits allow, a large grammar never seen before (parsed and
compiled off the step loop), a prompt at the context length, a 30 MB body,
a maximal-priority request, and a tool list at the server's limits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any, Callable

import httpx

from radixrt.help_format import HelpFormatter
from radixrt.server.local import LocalServer

RECURSIVE = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}


def _hostile(context: int) -> dict[str, tuple[str, Any]]:
    """name -> (route, body)."""

    def gen(**sp: Any) -> dict:
        return {"text": "Write it:", "sampling_params": {"max_new_tokens": 64, "temperature": 0, **sp}}

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [
        {"type": "function", "function": {"name": f"t{i}", "description": "x" * 7000, "parameters": schema}}
        for i in range(128)
    ]
    return {
        "recursive schema": ("/generate", gen(json_schema=json.dumps(RECURSIVE))),
        "regex a{3000000}": ("/generate", gen(regex="a{3000000}")),
        "forced a{65536} (allowed)": ("/generate", gen(regex="a{65536}")),
        "62 KB alternation regex (allowed)": (
            "/generate",
            gen(regex="(" + "|".join(f"w{i}x{i * 7919 % 100003}" for i in range(5000)) + ")"),
        ),
        "prompt at the context": (
            "/generate",
            {"input_ids": [17] * (context - 2), "sampling_params": {"max_new_tokens": 1}},
        ),
        "30 MB body": ("/generate", {"text": "x" * 30_000_000}),
        "priority 2**63-1": ("/generate", {**gen(), "priority": 2**63 - 1}),
        "128 tools, 0.9 MB (at the limits)": (
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": tools,
                "tool_choice": "required",
                "max_tokens": 8,
            },
        ),
    }


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


TIMEOUT_S = 300.0  # a request (hostile or probe) not answered by then shows as "t/o" (its time a lower bound)


def _send(url: str, body: Any, done: dict[str, Any]) -> None:
    """POST ``body``; ``done`` gets the status ("status": the code, or "t/o")
    and the seconds ("s")."""
    t0 = time.perf_counter()
    try:
        done["status"] = httpx.post(url, json=body, timeout=TIMEOUT_S).status_code
    except httpx.TimeoutException:
        done["status"] = "t/o"
    done["s"] = time.perf_counter() - t0


def _max_rss_mib(pids: dict[str, int]) -> float:
    """The largest resident set among the server's processes, in MiB."""
    best = 0
    for pid in pids.values():
        try:
            with open(f"/proc/{pid}/status") as f:
                best = max(best, next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")))
        except (OSError, StopIteration):
            pass
    return best / 1024


def run(model: str, probes: int, only: str = "", server_args: tuple[str, ...] = ()) -> None:
    """``only``: run the hostile requests whose name contains it; ``server_args``: more `radixrt serve` flags."""
    srv = LocalServer("--max-total-tokens", "16384", *server_args, model=model).wait_ready()
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            info = c.get("/get_server_info").json()
            pids, context = info["process_ids"], int(info.get("context_length") or 8192)

            def probe() -> float:
                """Seconds to answer a 4-token /generate (TIMEOUT_S or more when it timed out)."""
                body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
                t0 = time.perf_counter()
                try:
                    c.post("/generate", json=body, timeout=TIMEOUT_S).raise_for_status()
                except httpx.TimeoutException:
                    pass
                return time.perf_counter() - t0

            idle = statistics.median(probe() for _ in range(probes))
            print(f"probe (4-token /generate) alone: median {idle * 1000:.0f} ms")
            print(
                f"{'hostile request':36} {'status':>6} {'its s':>7} {'probe worst':>12} {'median':>8} "
                f"{'/health worst':>14} {'RSS +MiB':>9}"
            )
            for name, (route, body) in _hostile(context).items():
                if only not in name:
                    continue
                rss0 = _max_rss_mib(pids)
                done: dict[str, Any] = {}
                th = threading.Thread(target=_send, args=(srv.url + route, body, done))
                th.start()
                lat, health = [], []
                while th.is_alive() or not lat:
                    lat.append(probe())
                    health.append(_timed(lambda: c.get("/health"))[1])
                th.join()
                print(
                    f"{name:36} {done['status']:>6} {done['s']:>7.2f} {max(lat) * 1000:>9.0f} ms "
                    f"{statistics.median(lat) * 1000:>5.0f} ms {max(health) * 1000:>11.0f} ms "
                    f"{_max_rss_mib(pids) - rss0:>9.0f}"
                )
    finally:
        srv.stop()
        srv.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--probes", type=int, default=5, help="probes for the idle median")
    p.add_argument("--only", default="", help="only the hostile requests whose name contains this")
    p.add_argument(
        "--server-arg", action="append", default=[], help="a `radixrt serve` flag, as --server-arg=--flag=value"
    )
    args = p.parse_args(argv)
    run(args.model, args.probes, args.only, tuple(args.server_arg))


if __name__ == "__main__":
    main()
